"""The options of a search, validated where they enter the Python API: a bad value is a
ConfigError naming the option and its allowed range, before any work is done."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from transduce.config import ConfigError, Dtype, ValidatedConfig, check_at_least, check_positive

__all__ = ["Dtype", "KvDtype", "SearchOptions"]

KvDtype = Literal["float32", "bfloat16", "int8"]
# What runs a model: auto is ONNX Runtime for an ONNX export, PyTorch for a checkpoint.
Engine = Literal["auto", "torch", "onnxruntime"]


@dataclass(frozen=True)
class SearchOptions(ValidatedConfig):
    """beam: hypotheses kept per sentence (1 is greedy search); alpha: the GNMT length
    penalty's exponent; nbest: hypotheses returned per sentence (at most beam);
    batch_tokens: source tokens per batch counting padding; batch_sentences: at most
    this many lines per batch (0: no cap)."""

    beam: int = 4
    alpha: float = 0.6
    nbest: int = 1
    batch_tokens: int = 4096
    batch_sentences: int = 0

    def __post_init__(self) -> None:
        self._check_floats_finite()
        check_positive(self, "beam", "nbest", "batch_tokens")
        check_at_least(self, 0, "alpha")
        if isinstance(self.batch_sentences, bool) or not isinstance(self.batch_sentences, int) \
                or self.batch_sentences < 0:
            raise ConfigError(f"SearchOptions.batch_sentences={self.batch_sentences!r}: must be an integer "
                              f">= 0 (0: no cap)")
        if self.nbest > self.beam:
            raise ConfigError(f"SearchOptions.nbest={self.nbest}: must be at most beam={self.beam} (a beam "
                              f"search finds at most beam hypotheses)")
