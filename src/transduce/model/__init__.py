"""The encoder-decoder Transformer: positions, layers, and the model."""

from transduce.model.layers import DecoderLayer, EncoderLayer, FeedForward
from transduce.model.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                                        SinusoidalPositionalEncoding, sinusoidal_table)
from transduce.model.transformer import (Decoder, DecoderState, Encoder, TokenEmbedding,
                                         Transformer)

__all__ = ["FeedForward", "EncoderLayer", "DecoderLayer", "SinusoidalPositionalEncoding",
           "LearnedPositionalEmbedding", "RotaryEmbedding", "sinusoidal_table", "TokenEmbedding",
           "Encoder", "Decoder", "DecoderState", "Transformer"]
