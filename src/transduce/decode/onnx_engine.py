"""ONNX Runtime as a decoding engine behind the same searches as PyTorch.

The searches (search.py) talk to an engine through four things: `config`, `prefill(src,
max_len)` -> a state, `decode_step(tokens, state)` -> logits, and the state's
`reorder(rows, sources)`. A Transformer is one such engine; OnnxEngine is another, over
the two graphs `transduce export onnx` writes (onnx_format.py), so greedy search,
sampling, beam search and n-best lists work the same on both.

The past keys and values travel as graph inputs and come back as outputs (ONNX graphs
update nothing in place); the state keeps them as arrays and reorders their rows.

What the engines of the other two shapes share with it is here too: which engine runs a
directory (runs_on_onnxruntime), the settings an export accepts, opening a session, the
export's configuration and parameter count (onnx_lm_engine.py, onnx_encoder_engine.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig, choices
from transduce.decode.options import Engine, use_instead
from transduce.model import empty_model
from transduce.onnx_format import (DECODER_STEP, ENCODER, OnnxExportError, cache_names,
                                   is_onnx_export, read_info)


def runs_on_onnxruntime(path: Path | str, engine: Engine) -> bool:
    """Whether `path` is run by ONNX Runtime: engine "auto" runs an ONNX export so and a
    checkpoint with PyTorch; naming an engine refuses the other kind of directory."""
    if engine not in choices(Engine):
        raise ConfigError(f"engine={engine!r}: choose one of {', '.join(choices(Engine))}")
    onnx = is_onnx_export(path)
    if engine == "onnxruntime" and not onnx:
        raise ConfigError(f"{path}: engine onnxruntime needs an ONNX export (write one with "
                          f"`transduce export onnx {path} OUT`)")
    if engine == "torch" and onnx:
        raise ConfigError(f"{path} is an ONNX export, which only ONNX Runtime runs (engine "
                          "onnxruntime); this needs a PyTorch checkpoint")
    return onnx


def check_onnx_settings(dtype: str, kv_dtype: str | None, device: torch.device | str) -> None:
    """An export runs as it was exported: float32 ("auto" too), its own cache, the CPU."""
    if dtype not in ("auto", "float32") or kv_dtype is not None \
            or torch.device(device).type != "cpu":
        raise ConfigError("an ONNX export decodes in the types it was exported with, on the "
                          "CPU: --dtype, --kv-dtype and devices apply to PyTorch checkpoints")


def open_session(directory: Path, name: str, threads: int = 0):
    """An ONNX Runtime session over DIRECTORY/name on the CPU, with one intra-op thread
    per core this process may use (or `threads`); a clear error when it cannot load."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    options.inter_op_num_threads = 1
    try:
        return onnxruntime.InferenceSession(str(directory / name), options,
                                            providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own untyped errors
        raise OnnxExportError(f"{directory / name}: not loadable by ONNX Runtime "
                              f"({str(error).splitlines()[0]})") from None


def exported_config(directory: Path, arch: str | None = None, needs: str = "") -> ModelConfig:
    """An export's model configuration, after checking that the export is whole and, when
    `arch` is given, that it holds that shape (else a ConfigError: "`needs`; this export
    holds ..., use ...")."""
    read_info(directory)
    config = checkpoint.read_configs(directory)[0]
    if arch is not None and config.arch != arch:
        raise ConfigError(f"{directory}: {needs}; this export holds an arch={config.arch!r} "
                          f"model: {use_instead(config.arch)}")
    return config


class ExportedModel:
    """What every engine of an ONNX export shares: the configuration of the checkpoint it
    came from, checked to be of `arch` (else a ConfigError saying what `needs` it), and
    that checkpoint's parameter count."""

    def __init__(self, directory: Path, arch: str, needs: str):
        self.config = exported_config(directory, arch, needs)

    def num_parameters(self) -> int:
        """The trainable parameters, as the checkpoint counts them: counted on a model of
        its configuration built on the meta device (nothing allocated), since the graphs'
        initializers repeat shared matrices."""
        return empty_model(self.config, "meta").num_parameters()


class PastArrays:
    """What every ONNX decoding state holds: the past self-attention keys and values
    (R, Hkv, P, D) per layer, as arrays."""

    past: list[np.ndarray]

    @property
    def length(self) -> int:
        """Positions decoded (or cached) so far."""
        return self.past[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the self-attention caches."""
        return sum(array.nbytes for array in self.past)


class OnnxState(PastArrays):
    """The decoding state between steps, as arrays: past self-attention keys and values
    (R, Hkv, P, D) per layer, the sources' cross-attention keys and values (B, Hkv, S, D)
    per layer, the source mask (B, S), and which source each target row reads (R,)."""

    def __init__(self, past: list[np.ndarray], cross: list[np.ndarray], src_mask: np.ndarray):
        self.past, self.cross, self.src_mask = past, cross, src_mask
        self.row_source = np.arange(src_mask.shape[0], dtype=np.int64)

    def reorder(self, rows: Tensor, sources: Tensor | None = None) -> None:
        """Keep target rows `rows` (R',) and, when given, sources `sources` (B',), in
        that order (the contract of transformer.DecoderState.reorder)."""
        index = rows.cpu().numpy()
        self.past = [np.take(array, index, axis=0) for array in self.past]
        row_source = self.row_source[index]
        if sources is not None:
            chosen = sources.cpu().numpy()
            renumber = np.full(self.src_mask.shape[0], -1, dtype=np.int64)   # old -> new
            renumber[chosen] = np.arange(len(chosen))
            row_source = renumber[row_source]
            self.cross = [np.take(array, chosen, axis=0) for array in self.cross]
            self.src_mask = np.take(self.src_mask, chosen, axis=0)
        self.row_source = row_source


class OnnxEngine(ExportedModel):
    """An exported model run by ONNX Runtime on the CPU, with one intra-op thread per
    core this process may use (or `threads`)."""

    def __init__(self, directory: Path | str, threads: int = 0):
        directory = Path(directory)
        super().__init__(directory, "transformer", "translation needs an encoder-decoder")
        self.languages = checkpoint.read_languages(directory)   # as the checkpoint's
        self.language_codes = checkpoint.read_language_codes(directory)
        self.layers = self.config.num_decoder_layers
        self.encoder = open_session(directory, ENCODER, threads)
        self.decoder = open_session(directory, DECODER_STEP, threads)
        self._past_names = cache_names(self.layers, "past")
        self._cross_names = cache_names(self.layers, "cross")

    def prefill(self, src: Tensor, max_len: int, *, src_mask: Tensor | None = None,
                cache_dtype: torch.dtype | None = None) -> OnnxState:
        """src (B, S) right-padded ids -> the state before the first step: every layer's
        cross-attention keys and values, and empty self-attention caches. The caches
        grow as steps need (max_len is what a preallocating engine would reserve)."""
        if cache_dtype not in (None, torch.float32):
            raise ConfigError(f"the ONNX export keeps its cache in the graph's type; "
                              f"kv_dtype={cache_dtype} needs the PyTorch engine")
        ids = src.cpu().numpy().astype(np.int64)
        cross = self.encoder.run(None, {"src": ids})
        c = self.config
        empty = np.zeros((ids.shape[0], c.kv_heads, 0, c.head_dim), dtype=cross[0].dtype)
        mask = ids != c.pad_id if src_mask is None else src_mask.reshape(ids.shape).cpu().numpy()
        return OnnxState([empty] * (2 * self.layers), cross, mask)

    def decode_step(self, tokens: Tensor, state: OnnxState) -> Tensor:
        """tokens (R, T) after state.length cached ones -> logits (R, T, V); the state's
        caches grow by T."""
        feeds = {"tokens": tokens.cpu().numpy().astype(np.int64),
                 "row_source": state.row_source, "src_mask": state.src_mask,
                 **dict(zip(self._past_names, state.past)),
                 **dict(zip(self._cross_names, state.cross))}
        logits, *present = self.decoder.run(None, feeds)
        state.past = present
        return torch.from_numpy(logits)
