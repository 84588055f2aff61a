"""transduce: the Transformer of "Attention Is All You Need" and its family.

    import transduce
    model = transduce.load("runs/small/average")      # a Translator
    model.translate(["En el principio crió Dios los cielos y la tierra."])
    transduce.load("runs/lm/ema").generate(["In the beginning"])   # a Generator (GPT)
    transduce.load("models/bert").embed(["Jesus wept."])           # a SentenceEncoder (BERT)

The names below load on first use, so that `import transduce` (and the command line's
--help) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "ModelConfig": "transduce.config", "TrainConfig": "transduce.config",
    "preset": "transduce.config", "Transformer": "transduce.model",
    "Translator": "transduce.decode.translate", "Generator": "transduce.decode.generate",
    "SentenceEncoder": "transduce.decode.encode", "load": "transduce.decode.load",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:
    from transduce.config import ModelConfig, TrainConfig, preset
    from transduce.decode.encode import SentenceEncoder
    from transduce.decode.generate import Generator
    from transduce.decode.load import load
    from transduce.decode.translate import Translator
    from transduce.model import Transformer


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'transduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
