"""The models: the encoder-decoder Transformer (positions, layers, model) and the RNN
encoder-decoders with attention that came before it."""

from transduce.config import ModelConfig
from transduce.model.layers import DecoderLayer, EncoderLayer, FeedForward
from transduce.model.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                                        SinusoidalPositionalEncoding, sinusoidal_table)
from transduce.model.rnn import RNNEncoderDecoder, RNNState
from transduce.model.transformer import (Decoder, DecoderState, Encoder, TokenEmbedding,
                                         Transformer)


# What training, search and translation accept: both share forward / prefill / decode_step.
Seq2SeqModel = Transformer | RNNEncoderDecoder


def build_model(config: ModelConfig) -> Seq2SeqModel:
    """The model config.arch names: a Transformer or an RNNEncoderDecoder."""
    return Transformer(config) if config.arch == "transformer" else RNNEncoderDecoder(config)


__all__ = ["FeedForward", "EncoderLayer", "DecoderLayer", "SinusoidalPositionalEncoding",
           "LearnedPositionalEmbedding", "RotaryEmbedding", "sinusoidal_table", "TokenEmbedding",
           "Encoder", "Decoder", "DecoderState", "Transformer", "RNNEncoderDecoder", "RNNState",
           "build_model", "Seq2SeqModel"]
