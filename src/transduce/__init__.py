"""transduce: the Transformer of "Attention Is All You Need" as a sequence-to-sequence toolkit."""

from transduce.config import ModelConfig, preset
from transduce.model import Transformer

__all__ = ["ModelConfig", "preset", "Transformer"]
__version__ = "0.1.0"
