"""The int8 export's tables (export/onnx_int8_tables.py), on a graph made by hand: an
embedding and a product by the same table, run by ONNX Runtime against numpy."""

import numpy as np
import pytest

from transduce.export.onnx_int8_tables import LEVELS, quantize_tables, quantized_rows

VOCAB, WIDTH = 50, 16


def _table():
    """Rows of very different sizes, and one of zeros (a pad embedding)."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    table *= np.geomspace(1e-3, 10, VOCAB, dtype=np.float32)[:, None]
    table[3] = 0
    return table


def _graph(table):
    """ids (2, 3) -> embedded = table[ids]; x (4, C) -> logits = x @ table^T (a Gemm)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embed"),
             helper.make_node("Gemm", ["x", "table"], ["logits"], transB=1, name="output")]
    graph = helper.make_graph(
        nodes, "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, WIDTH])],
        [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, [2, 3, WIDTH]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, VOCAB])],
        [numpy_helper.from_array(table, "table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, feeds):
    import onnxruntime

    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _dynamic_quantized(x):
    """ONNX's DynamicQuantizeLinear: uint8, the range widened to hold 0."""
    low, high = min(0.0, float(x.min())), max(0.0, float(x.max()))
    scale = np.float32((high - low) / 255)
    zero = np.clip(np.rint(-low / scale), 0, 255)
    return np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.int32) - int(zero), scale


def test_rows_are_quantized_symmetrically_each_with_its_own_scale():
    table = _table()
    matrix, scales = quantized_rows(table)
    assert matrix.shape == (WIDTH, VOCAB) and matrix.dtype == np.int8
    assert scales[3] == 1 and not matrix[:, 3].any()
    rows = [v for v in range(VOCAB) if v != 3]
    assert (np.abs(matrix[:, rows]).max(axis=0) == LEVELS).all()
    error = np.abs(matrix.T * scales[:, None] - table)
    assert (error <= scales[:, None] / 2 * (1 + 1e-6)).all()


def test_chunks_of_rows_quantize_as_the_whole_table(monkeypatch):
    from transduce.export import onnx_int8_tables

    whole = quantized_rows(_table())
    monkeypatch.setattr(onnx_int8_tables, "ROWS_AT_A_TIME", 7)
    for got, want in zip(quantized_rows(_table()), whole):
        np.testing.assert_array_equal(got, want)


def test_the_table_is_stored_once_and_both_operators_read_it():
    from onnx import numpy_helper

    table, model = _table(), _graph(_table())
    written, tied = quantize_tables(model)
    assert len(tied) == 1
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert sorted((a.dtype.name, a.shape) for a in stored.values()) == \
        [("float32", (VOCAB,)), ("int8", (WIDTH, VOCAB))]
    assert {n.name for n in model.graph.node} == set(written)
    matrix, scales = quantized_rows(table)
    ids = np.array([[0, 3, 49], [17, 17, 1]], np.int64)
    x = np.random.default_rng(1).standard_normal((4, WIDTH)).astype(np.float32)
    embedded, logits = _run(model, {"ids": ids, "x": x})

    # the embedding: exactly the int8 columns times their tokens' scales
    np.testing.assert_array_equal(embedded, matrix.T[ids] * scales[ids][..., None])
    assert (np.abs(embedded - table[ids]) <= scales[ids][..., None] / 2 * 1.001).all()
    # the product: x quantized per call, the integer product, both scales
    integers, x_scale = _dynamic_quantized(x)
    want = (integers @ matrix.astype(np.int32)).astype(np.float32) * (x_scale * scales)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)
    exact = x.astype(np.float64) @ table.T.astype(np.float64)
    assert np.abs(logits - exact).max() < 0.02 * np.abs(exact).max()


def _embedding_alone(table):
    """ids (any shape) -> table[ids], and no product: an encoder's graph."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["embedded"])], "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, None)],
        [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("ids_shape", [(1,), (1, 1), (2, 5, 3)])
def test_a_table_tied_in_another_graph_is_quantized_as_there(ids_shape):
    """The encoder's graph gathers from the table the step's graph multiplies by: it is
    rewritten to the same int8 matrix (for the two to share), the ids flattened for the
    column Gather and the result shaped back."""
    from onnx import numpy_helper

    table = _table()
    step, encoder, untied = _graph(table), _embedding_alone(table), _embedding_alone(table)
    _, tied = quantize_tables(step)
    assert quantize_tables(untied) == ([], set())        # left to the quantizer
    assert quantize_tables(encoder, tied)[1] == tied
    stored = [[t.raw_data for t in m.graph.initializer if t.data_type == 3]
              for m in (step, encoder)]
    assert len(stored[1]) == 1 and stored[0] == stored[1]
    assert [numpy_helper.to_array(t).dtype for t in untied.graph.initializer] == [np.float32]
    ids = np.random.default_rng(2).integers(0, VOCAB, ids_shape)
    (embedded,) = _run(encoder, {"ids": ids})
    matrix, scales = quantized_rows(table)
    np.testing.assert_array_equal(embedded, matrix.T[ids] * scales[ids][..., None])


def test_what_is_not_a_table_or_its_product_is_left_as_it_was():
    """A Gather along another axis, a Gemm with a bias (not a product by the table
    alone: the table it reads is not taken as tied), and integer tables stay."""
    from onnx import TensorProto, helper, numpy_helper

    table = _table()
    nodes = [helper.make_node("Gather", ["table", "ids"], ["columns"], axis=1),
             helper.make_node("Gemm", ["x", "other", "bias"], ["product"], transB=1),
             helper.make_node("Gather", ["other", "ids"], ["rows"]),
             helper.make_node("Gather", ["shape", "ids"], ["sizes"])]
    graph = helper.make_graph(
        nodes, "others",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, WIDTH])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
         for name in ("columns", "product", "rows")],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(table, "other"),
         numpy_helper.from_array(np.zeros(VOCAB, np.float32), "bias"),
         numpy_helper.from_array(np.arange(VOCAB, dtype=np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    assert quantize_tables(model) == ([], set())
    assert model.SerializeToString() == before
