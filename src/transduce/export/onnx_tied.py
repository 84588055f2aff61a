"""A tied embedding stored once in the exported graphs, not three times.

The tracer writes the output projection's weight transposed, (C, V) as MatMul takes it,
beside the (V, C) table the embedding's Gather reads: a tied matrix twice in the
decoder's graph, and a third time in the encoder's (NLLB-600M's is 1 GB). Here the
output's MatMul becomes a Gemm that multiplies by the (V, C) table itself (transB), on
the rows flattened to (N, C): ONNX Runtime packs its weight once as it does MatMul's
(the same time per step, measured), the embedding still gathers whole rows, and the
(C, V) copy goes. The encoder's graph keeps its (V, C) table, whose bytes the decoder's
graph then stores (onnx_files.share_stored_weights).
"""

from __future__ import annotations

import numpy as np


def multiply_by_gathered_tables(model) -> int:
    """Every MatMul in `model` by a (C, V) weight that is the transpose of a table one of
    its Gathers reads becomes a Gemm by that table; the (C, V) weight is dropped -> how
    many products."""
    from onnx import numpy_helper

    graph = model.graph
    weights = {tensor.name: tensor for tensor in graph.initializer}
    tables = {node.input[0] for node in graph.node if node.op_type == "Gather"
              and node.input[0] in weights and len(weights[node.input[0]].dims) == 2
              and _axis(node) == 0}
    by_shape = {tuple(weights[table].dims[::-1]): table for table in tables}
    nodes, rewritten = [], 0
    for node in graph.node:
        weight = node.input[1] if node.op_type == "MatMul" else None
        table = by_shape.get(tuple(weights[weight].dims)) if weight in weights else None
        if table is None or not np.array_equal(numpy_helper.to_array(weights[weight]),
                                               numpy_helper.to_array(weights[table]).T):
            nodes.append(node)
            continue
        nodes += _product_by_transposed(graph, weights, node.input[0], table, node.output[0])
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_unused(graph)
    return rewritten


def _product_by_transposed(graph, weights: dict, x: str, table: str, out: str) -> list:
    """Nodes for out = x @ table^T: x (..., C) flattened to (N, C), Gemm(transB=1) by the
    (V, C) table, the result reshaped to (..., V). `weights`: the graph's initializers by
    name, to which the shape constants are added."""
    from onnx import helper, numpy_helper

    def constant(name: str, values: list[int]) -> str:
        if name not in weights:
            weights[name] = numpy_helper.from_array(np.array(values, np.int64), name)
            graph.initializer.append(weights[name])
        return name

    width = weights[table].dims[1]
    rows, leading = f"{out}/rows", f"{out}/leading"
    return [
        helper.make_node("Reshape", [x, constant(f"tied/rows_of_{width}", [-1, width])],
                         [rows]),
        helper.make_node("Gemm", [rows, table], [f"{out}/product"], transB=1),
        helper.make_node("Shape", [x], [f"{out}/shape"]),
        helper.make_node("Slice", [f"{out}/shape", constant("tied/start", [0]),
                                   constant("tied/last", [-1])], [leading]),
        helper.make_node("Concat", [leading, constant("tied/all_columns", [-1])],
                         [f"{out}/out_shape"], axis=0),
        helper.make_node("Reshape", [f"{out}/product", f"{out}/out_shape"], [out]),
    ]


def _axis(node) -> int:
    return next((attribute.i for attribute in node.attribute if attribute.name == "axis"), 0)


def _drop_unused(graph) -> None:
    """Initializers no node reads any more."""
    read = {name for node in graph.node for name in node.input}
    for tensor in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(tensor)
