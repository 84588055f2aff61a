"""An int8 export's tied embedding table, quantized here, once, rather than by ONNX
Runtime's quantizer.

The quantizer stores a tied table twice in the graph that multiplies by it: uint8
(V, C) with one scale for the whole table for the Gather, and int8 (C, V) with a scale
per column for the output product; the encoder's graph holds a third copy (NLLB-600M's
table is 262 MB in int8, GPT-2's 39 MB). Here a tied table becomes one int8 (C, V)
matrix, symmetric, with a scale per token (per row of the table):
- the output's Gemm by the table (onnx_tied.py) becomes DynamicQuantizeLinear ->
  MatMulInteger -> Cast -> Mul, the product the quantizer writes, by that matrix;
- the Gather takes the matrix's columns (axis 1) and multiplies them by their tokens'
  scales: an embedding as close as the product's weights (closer than the quantizer's
  one scale for the table).
The encoder's copy becomes the same bytes, which onnx_files.share_stored_weights then
stores once for both graphs.
"""

from __future__ import annotations

import hashlib
from typing import Collection

import numpy as np

# Rows of a table quantized at a time: NLLB's 256k x 1024 table is 1 GB in float32.
ROWS_AT_A_TIME = 1 << 15
# Steps each side of zero of the int8 table: 7 bits (quantized_rows).
LEVELS = 63


def quantize_tables(model, tied_elsewhere: Collection[str] = ()) -> tuple[list[str], set[str]]:
    """Rewrite `model` (an onnx ModelProto) in place as the module says, for every float
    table a Gather reads that a product in the graph multiplies by, or whose digest is in
    `tied_elsewhere` (the encoder's copy of the step's table) -> the names of the nodes
    written, which the quantizer must leave as they are (it would quantize the Gather of
    the scales), and the digests of the tables quantized. An untied table is left to the
    quantizer, whose Gather reads whole rows: a column of the int8 matrix is C bytes
    apart, which costs a prompt's gather time and saves nothing there."""
    graph = model.graph
    weights = {tensor.name: tensor for tensor in graph.initializer}
    tables = _tied_tables(graph, weights, set(tied_elsewhere))
    quantized = {table: _add_quantized(graph, weights[table]) for table in tables}
    nodes, written = [], []
    for index, node in enumerate(graph.node):
        new = _rewritten(node, quantized, f"int8_tables/{index}")
        nodes += new or [node]
        written += [made.name for made in new]
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in graph.node for name in node.input}
    for tensor in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(tensor)
    return written, set(tables.values())


def _tied_tables(graph, weights: dict, tied_elsewhere: set[str]) -> dict[str, str]:
    """The float (V, C) tables a Gather reads (along axis 0) that a product in the graph
    multiplies by, or whose digest is in tied_elsewhere -> their digests."""
    from onnx import TensorProto

    gathered = {node.input[0] for node in graph.node if node.op_type == "Gather"
                and _attribute(node, "axis", 0) == 0 and node.input[0] in weights
                and len(weights[node.input[0]].dims) == 2
                and weights[node.input[0]].data_type == TensorProto.FLOAT}
    multiplied = {node.input[1] for node in graph.node if _a_product_by_table(node)}
    digests = {name: _digest(weights[name]) for name in gathered       # (hashed only
               if name in multiplied or tied_elsewhere}                   # when needed)
    return {name: digest for name, digest in digests.items()
            if name in multiplied or digest in tied_elsewhere}


def _rewritten(node, quantized: dict, prefix: str) -> list:
    """The nodes that replace `node` if it gathers from or multiplies by a quantized
    table (named under `prefix`), else none."""
    if node.op_type == "Gather" and _attribute(node, "axis", 0) == 0:
        table = node.input[0]
    else:
        table = node.input[1] if _a_product_by_table(node) else None
    if table not in quantized:
        return []
    matrix, scales, width = quantized[table]
    if node.op_type == "Gather":
        new = _gathered_columns(node.input[1], matrix, scales, width, node.output[0], prefix)
    else:
        new = _quantized_product(node.input[0], matrix, scales, node.output[0], prefix)
    for number, made in enumerate(new):
        made.name = f"{prefix}/{number}_{made.op_type}"
    return new


def _digest(tensor) -> str:
    """What identifies a float table's value across graphs."""
    from onnx import numpy_helper

    data = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
    return f"{tuple(tensor.dims)}:{hashlib.blake2b(data).hexdigest()}"


def quantized_rows(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(V, C) float32 -> the int8 (C, V) matrix and the (V,) float32 scales: row v is
    matrix[:, v] * scales[v], its largest magnitude at +-LEVELS (an all-zero row: scale
    1): 7 bits, as the quantizer's reduce_range (export/onnx.py's _quantize_int8)."""
    vocabulary, width = table.shape
    matrix = np.empty((width, vocabulary), np.int8)
    scales = np.empty(vocabulary, np.float32)
    for start in range(0, vocabulary, ROWS_AT_A_TIME):
        rows = table[start:start + ROWS_AT_A_TIME]
        largest = np.abs(rows).max(axis=1)
        scale = np.where(largest > 0, largest / np.float32(LEVELS), np.float32(1)
                         ).astype(np.float32)
        matrix[:, start:start + len(rows)] = np.clip(
            np.rint(rows / scale[:, None]), -LEVELS, LEVELS).astype(np.int8).T
        scales[start:start + len(rows)] = scale
    return matrix, scales


def _add_quantized(graph, table) -> tuple[str, str, int]:
    """The table's int8 matrix and scales, added to the graph's initializers -> their
    names and the table's width."""
    from onnx import numpy_helper

    matrix, scales = quantized_rows(numpy_helper.to_array(table).astype(np.float32))
    names = f"{table.name}_int8_columns", f"{table.name}_int8_scales"
    graph.initializer.extend([numpy_helper.from_array(matrix, names[0]),
                              numpy_helper.from_array(scales, names[1])])
    return (*names, table.dims[1])


def _a_product_by_table(node) -> bool:
    """x (N, C) times a (V, C) weight transposed, and nothing else (onnx_tied.py's Gemm)."""
    return node.op_type == "Gemm" and len(node.input) == 2 and \
        _attribute(node, "transB", 0) == 1 and _attribute(node, "transA", 0) == 0 and \
        _attribute(node, "alpha", 1.0) == 1.0


def _gathered_columns(ids: str, matrix: str, scales: str, width: int, out: str,
                      prefix: str) -> list:
    """out (*ids, C) float = matrix[:, ids]^T * scales[ids]: the ids flattened to (N,),
    the (C, N) columns turned to rows, cast and scaled, reshaped to the ids' shape + C."""
    from onnx import TensorProto, helper

    def named(part: str) -> str:
        return f"{prefix}/{part}"

    return [
        helper.make_node("Constant", [], [named("flat_shape")],
                         value=helper.make_tensor("v", TensorProto.INT64, [1], [-1])),
        helper.make_node("Constant", [], [named("last")],
                         value=helper.make_tensor("v", TensorProto.INT64, [1], [1])),
        helper.make_node("Constant", [], [named("width")],
                         value=helper.make_tensor("v", TensorProto.INT64, [1], [width])),
        helper.make_node("Reshape", [ids, named("flat_shape")], [named("ids")]),
        helper.make_node("Gather", [matrix, named("ids")], [named("columns")], axis=1),
        helper.make_node("Transpose", [named("columns")], [named("rows")], perm=[1, 0]),
        helper.make_node("Cast", [named("rows")], [named("float_rows")], to=TensorProto.FLOAT),
        helper.make_node("Gather", [scales, named("ids")], [named("row_scales")], axis=0),
        helper.make_node("Unsqueeze", [named("row_scales"), named("last")],
                         [named("column_of_scales")]),
        helper.make_node("Mul", [named("float_rows"), named("column_of_scales")],
                         [named("embedded")]),
        helper.make_node("Shape", [ids], [named("ids_shape")]),
        helper.make_node("Concat", [named("ids_shape"), named("width")],
                         [named("out_shape")], axis=0),
        helper.make_node("Reshape", [named("embedded"), named("out_shape")], [out]),
    ]


def _quantized_product(x: str, matrix: str, scales: str, out: str, prefix: str) -> list:
    """out (N, V) = x (N, C) quantized per call (uint8, as the quantizer's products) times
    the int8 matrix, in int32, then scaled by x's scale and each column's."""
    from onnx import TensorProto, helper

    def named(part: str) -> str:
        return f"{prefix}/{part}"

    return [
        helper.make_node("DynamicQuantizeLinear", [x],
                         [named("x_quantized"), named("x_scale"), named("x_zero_point")]),
        helper.make_node("MatMulInteger", [named("x_quantized"), matrix, named("x_zero_point")],
                         [named("product_int32")]),
        helper.make_node("Cast", [named("product_int32")], [named("product_float")],
                         to=TensorProto.FLOAT),
        helper.make_node("Mul", [named("x_scale"), scales], [named("column_scales")]),
        helper.make_node("Mul", [named("product_float"), named("column_scales")], [out]),
    ]


def _attribute(node, name: str, default):
    from onnx import helper

    return next((helper.get_attribute_value(attribute) for attribute in node.attribute
                 if attribute.name == name), default)
