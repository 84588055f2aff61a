"""What every export shares: its error, and the models no format here can hold."""

from __future__ import annotations

from transduce.config import ModelConfig
from transduce.errors import TransduceError


class ExportError(TransduceError, ValueError):
    """The model has a feature the target format cannot express; names it."""


def not_a_plain_transformer(c: ModelConfig) -> list[str]:
    """What neither format can hold: RNN models and non-softmax self-attention."""
    problems = []
    if c.arch != "transformer":
        problems.append(f"arch={c.arch!r} (the format holds Transformers)")
    if c.attention_type != "softmax":
        problems.append(f"attention_type={c.attention_type!r} (the format has softmax attention)")
    if not c.attention_scale:
        problems.append("attention_scale=False (the format scales the scores)")
    if c.positional in ("t5", "alibi"):
        problems.append(f"positional={c.positional!r} (the format has no score bias)")
    return problems
