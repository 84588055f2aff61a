"""The models: the encoder-decoder Transformer (positions, layers, model), the
decoder-only model (GPT) on the same layers, and the RNN encoder-decoders with attention
that came before them."""

import dataclasses
from pathlib import Path

import torch

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig
from transduce.model.decoder_only import DecoderOnly, LMState
from transduce.model.encoder_only import EncoderOnly
from transduce.model.layers import DecoderLayer, EncoderLayer, FeedForward
from transduce.model.positional import (LearnedPositionalEmbedding, RotaryEmbedding,
                                        SinusoidalPositionalEncoding, sinusoidal_table)
from transduce.model.rnn import RNNEncoderDecoder, RNNState
from transduce.model.transformer import (Decoder, DecoderState, Encoder, TokenEmbedding,
                                         Transformer)


# What translation accepts: both share forward(src, tgt) / prefill / decode_step.
Seq2SeqModel = Transformer | RNNEncoderDecoder
# What the searches accept: prefill / decode_step, with or without a source.
Generative = Seq2SeqModel | DecoderOnly
# Every model a checkpoint can hold.
Model = Generative | EncoderOnly


def build_model(config: ModelConfig) -> Model:
    """The model config.arch names: a Transformer, a DecoderOnly, an EncoderOnly or an
    RNNEncoderDecoder."""
    if config.arch == "transformer":
        return Transformer(config)
    if config.arch == "decoder":
        return DecoderOnly(config)
    if config.arch == "encoder":
        return EncoderOnly(config)
    return RNNEncoderDecoder(config)


def load_model(path: Path | str, device: torch.device | str = "cpu") -> Model:
    """The model of a checkpoint (or of a run's latest checkpoint), in eval mode."""
    device = _usable_device(device)
    path = checkpoint.resolve(Path(path))
    config = checkpoint.read_configs(path)[0]
    if config.attention_impl == "triton" and torch.device(device).type != "cuda":
        # The kernel is how attention is computed, not what: a model trained with the
        # Triton kernel on a GPU loads anywhere, with PyTorch's kernel off the GPU.
        config = dataclasses.replace(config, attention_impl="sdpa")
    model = build_model(config)
    checkpoint.load_weights(model, path, device)
    if isinstance(model, EncoderOnly):
        model.labels = checkpoint.read_labels(path)
    elif config.arch != "decoder":
        model.languages = checkpoint.read_languages(path)
        model.language_codes = checkpoint.read_language_codes(path)
    return model.to(device).eval()


def _usable_device(device: torch.device | str) -> torch.device:
    """A device name PyTorch does not know, or CUDA where it has none, is a ConfigError
    naming it (reading the weights onto it would blame the weights file)."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r}: not a device PyTorch knows (such as 'cpu' or "
                          f"'cuda')") from None
    if found.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: this PyTorch sees no CUDA GPU "
                          f"(torch.cuda.is_available() is False)")
    return found


__all__ = ["FeedForward", "EncoderLayer", "DecoderLayer", "SinusoidalPositionalEncoding",
           "LearnedPositionalEmbedding", "RotaryEmbedding", "sinusoidal_table", "TokenEmbedding",
           "Encoder", "Decoder", "DecoderState", "Transformer", "RNNEncoderDecoder", "RNNState",
           "DecoderOnly", "LMState", "EncoderOnly", "build_model", "load_model", "Seq2SeqModel",
           "Generative", "Model"]
