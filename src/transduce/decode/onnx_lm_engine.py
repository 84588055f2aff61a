"""ONNX Runtime running a decoder-only export (export/onnx_decoder.py) behind the same
generation and searches as a DecoderOnly: `config`, `prefill(prompt, max_len,
src_mask=)` -> a state, `decode_step(tokens, state)` -> logits, and the state's
`reorder(rows)`.

The state holds the past keys and values as arrays, and which of their positions hold
real tokens (left padding does not), which the graph turns into each row's positions
and mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from transduce.config import ConfigError
from transduce.decode.onnx_engine import ExportedModel, PastArrays, open_session
from transduce.model.decoder_only import left_padded_tokens
from transduce.onnx_format import DECODER, cache_names


class OnnxLMState(PastArrays):
    """Past keys and values (R, Hkv, P, D) per layer (P counts left padding too) and
    key_mask (R, P), True where a real token is."""

    def __init__(self, past: list[np.ndarray], key_mask: np.ndarray):
        self.past, self.key_mask = past, key_mask

    def reorder(self, rows: Tensor, sources: Tensor | None = None) -> None:
        """Keep rows `rows` (R',) in that order (beams, running prompts); `sources` is
        accepted for the searches' sake (there is no source side)."""
        index = rows.cpu().numpy()
        self.past = [np.take(array, index, axis=0) for array in self.past]
        self.key_mask = np.take(self.key_mask, index, axis=0)

    def allow_rewind(self, tokens: int) -> None:
        """The whole past is held (and sliced by rewind), whatever the attention."""

    def rewind(self, length: int) -> None:
        """Forget the positions after the first `length` (a rejected draft)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} tokens to {length}")
        self.past = [np.ascontiguousarray(array[:, :, :length]) for array in self.past]
        self.key_mask = self.key_mask[:, :length]


class OnnxLanguageModel(ExportedModel):
    """A decoder-only model's export run by ONNX Runtime on the CPU (threads: as
    onnx_engine.open_session)."""

    def __init__(self, directory: Path | str, threads: int = 0):
        directory = Path(directory)
        super().__init__(directory, "decoder", "generation needs a language model")
        self.session = open_session(directory, DECODER, threads)
        self._past_names = cache_names(self.config.num_decoder_layers, "past")

    def prefill(self, prompt: Tensor, max_len: int, *, src_mask: Tensor | None = None,
                cache_dtype: torch.dtype | None = None) -> OnnxLMState:
        """Every prompt token but the last through the graph (the searches feed the last
        one as their first step). prompt (B, P) left-padded, src_mask (B, 1, 1, P) True
        for real tokens (None: no padding). The caches grow as steps need (max_len is
        what a preallocating engine would reserve)."""
        if cache_dtype not in (None, torch.float32):
            raise ConfigError(f"the ONNX export keeps its cache in the graph's type; "
                              f"kv_dtype={cache_dtype} needs the PyTorch engine")
        real = left_padded_tokens(prompt, src_mask).cpu().numpy()
        state = self._empty_state(prompt.shape[0])
        if prompt.shape[1] > 1:
            self._run(prompt[:, :-1], real[:, :-1], state)
        return state

    def logits(self, tokens: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """The whole causal pass, as DecoderOnly.forward: tokens (B, T) -> logits
        (B, T, V); key_mask (B, T), True for real tokens, only for left padding."""
        real = np.ones(tokens.shape, dtype=bool) if key_mask is None else key_mask.cpu().numpy()
        return self._run(tokens, real, self._empty_state(tokens.shape[0]))

    def decode_step(self, tokens: Tensor, state: OnnxLMState) -> Tensor:
        """tokens (R, T), all real, after state.length cached positions -> logits
        (R, T, V); the state's caches grow by T."""
        return self._run(tokens, np.ones(tokens.shape, dtype=bool), state)

    def _empty_state(self, rows: int) -> OnnxLMState:
        c = self.config
        empty = np.zeros((rows, c.kv_heads, 0, c.head_dim), dtype=np.float32)
        return OnnxLMState([empty] * (2 * c.num_decoder_layers), np.ones((rows, 0), dtype=bool))

    def _run(self, tokens: Tensor, real: np.ndarray, state: OnnxLMState) -> Tensor:
        """tokens (R, T) and which of them are real (R, T) -> logits (R, T, V)."""
        key_mask = np.concatenate([state.key_mask, real], axis=1)
        feeds = {"tokens": tokens.cpu().numpy().astype(np.int64), "key_mask": key_mask,
                 **dict(zip(self._past_names, state.past))}
        logits, *present = self.session.run(None, feeds)
        state.past, state.key_mask = present, key_mask
        return torch.from_numpy(logits)
