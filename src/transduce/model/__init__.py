"""The models: the encoder-decoder Transformer (positions, layers, model) and the RNN
encoder-decoders with attention that came before it."""

from pathlib import Path

import torch

from transduce import checkpoint
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


def load_model(path: Path | str, device: torch.device | str = "cpu") -> Seq2SeqModel:
    """The model of a checkpoint (or of a run's latest checkpoint), in eval mode."""
    path = checkpoint.resolve(Path(path))
    model = build_model(checkpoint.read_configs(path)[0])
    checkpoint.load_weights(model, path, device)
    return model.to(device).eval()


__all__ = ["FeedForward", "EncoderLayer", "DecoderLayer", "SinusoidalPositionalEncoding",
           "LearnedPositionalEmbedding", "RotaryEmbedding", "sinusoidal_table", "TokenEmbedding",
           "Encoder", "Decoder", "DecoderState", "Transformer", "RNNEncoderDecoder", "RNNState",
           "build_model", "load_model", "Seq2SeqModel"]
