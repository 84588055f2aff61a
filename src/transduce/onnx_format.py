"""The on-disk layout of an ONNX export, shared by the exporter (export/onnx.py) and the
ONNX Runtime engine (decode/onnx_engine.py); it imports no model code.

    OUT/encoder.onnx, OUT/decoder_step.onnx   an encoder-decoder's two graphs
    OUT/decoder.onnx                          a decoder-only model's one graph
    OUT/sentence_encoder.onnx                 an encoder-only model's one graph
    OUT/config.json, OUT/spm.model            the model's configuration and tokenizer
                                              (or tokenizer.json, as its checkpoint's)
    OUT/onnx.json                             opset, quantization, the graphs' names
"""

from __future__ import annotations

import json
from pathlib import Path

from transduce.errors import TransduceError

ENCODER, DECODER_STEP, INFO = "encoder.onnx", "decoder_step.onnx", "onnx.json"
DECODER, SENTENCE_ENCODER = "decoder.onnx", "sentence_encoder.onnx"
GRAPHS = (ENCODER, DECODER_STEP, DECODER, SENTENCE_ENCODER)


class OnnxExportError(TransduceError, ValueError):
    """Not an ONNX export, or a damaged one; names the file."""


def cache_names(layers: int, prefix: str) -> list[str]:
    """prefix_k.0, prefix_v.0, prefix_k.1, ...: one key and one value tensor per layer."""
    return [f"{prefix}_{part}.{i}" for i in range(layers) for part in ("k", "v")]


def is_onnx_export(directory: Path | str) -> bool:
    return (Path(directory) / INFO).is_file()


def read_info(directory: Path | str) -> dict:
    """OUT/onnx.json, or a clear error when OUT is not an ONNX export."""
    info = Path(directory) / INFO
    if not info.is_file():
        raise OnnxExportError(f"{directory}: not an ONNX export (no {INFO}; write one with "
                              "`transduce export onnx RUN OUT`)")
    try:
        values = json.loads(info.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise OnnxExportError(f"{info}: unreadable ({error})") from None
    graphs = values.get("graphs") if isinstance(values, dict) else None
    if not isinstance(graphs, list) or not graphs or not all(name in GRAPHS for name in graphs):
        raise OnnxExportError(f"{info}: \"graphs\" must list the export's graphs (of "
                              f"{', '.join(GRAPHS)}), got {graphs!r}")
    for name in graphs:
        if not (Path(directory) / name).is_file():
            raise OnnxExportError(f"{directory}: {name} is missing")
    return values
