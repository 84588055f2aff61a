"""transduce.load(PATH): the model a directory holds, ready for what its kind does.

    transduce.load("runs/small/ema").translate(lines)        # encoder-decoder: Translator
    transduce.load("runs/lm/ema").generate(prompts)          # decoder-only: Generator
    transduce.load("models/bert").embed(lines)               # encoder-only: SentenceEncoder
"""

from __future__ import annotations

from pathlib import Path

import torch

from transduce import checkpoint
from transduce.config import ConfigError
from transduce.decode.encode import SentenceEncoder
from transduce.decode.generate import Generator
from transduce.decode.onnx_engine import exported_config, runs_on_onnxruntime
from transduce.decode.options import DecodeDtype, Engine, KvDtype
from transduce.decode.translate import Translator


def load(path: Path | str, device: torch.device | str = "cpu", dtype: DecodeDtype = "float32",
         kv_dtype: KvDtype | None = None,
         engine: Engine = "auto") -> Translator | Generator | SentenceEncoder:
    """A checkpoint directory, a run directory (its latest checkpoint) or an ONNX export
    -> a Translator, a Generator or a SentenceEncoder, by the model's architecture."""
    if runs_on_onnxruntime(path, engine):
        arch = exported_config(Path(path)).arch
    else:
        arch = checkpoint.read_configs(checkpoint.resolve(Path(path)))[0].arch
    if arch == "decoder":
        return Generator.load(path, device, dtype, kv_dtype, engine)
    if arch == "encoder":
        if kv_dtype is not None:
            raise ConfigError("kv_dtype applies to models that decode; an encoder-only "
                              "model keeps no KV cache")
        return SentenceEncoder.load(path, device, dtype, engine)
    return Translator.load(path, device, dtype, kv_dtype, engine)
