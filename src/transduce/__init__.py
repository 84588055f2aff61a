"""transduce: the Transformer of "Attention Is All You Need" as a sequence-to-sequence toolkit."""

from transduce.config import ModelConfig, TrainConfig, preset
from transduce.decode.translate import Translator, load
from transduce.model import Transformer

__all__ = ["ModelConfig", "TrainConfig", "preset", "Transformer", "Translator", "load"]
__version__ = "0.1.0"
