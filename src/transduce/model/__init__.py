"""The models: the encoder-decoder Transformer (positions, layers, model), the
decoder-only model (GPT) on the same layers, and the RNN encoder-decoders with attention
that came before them."""

import dataclasses
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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


def empty_model(config: ModelConfig, device: torch.device | str = "cpu") -> Model:
    """The model config names with its parameters allocated on `device` but not
    initialised: for weights about to be loaded into it. A random initialisation costs
    more than the load itself (8 s of 12 for NLLB-600M's shape on 2 cores) and, until the
    load, touches every page of a second copy. On the meta device, nothing is allocated:
    a model to count."""
    with torch.device(device), _SkippedInitialisation():
        return build_model(config)


class _SkippedInitialisation(TorchFunctionMode):
    """While a model is built, torch.nn.init's functions, and in-place methods called on a
    parameter or a view of one (uniform_, normal_, zero_), leave it as torch.empty made
    it. Everything else runs: fixed tables are computed as always. (The meta device alone
    would not do: its normal_ imports torch._dynamo, 1.4 s.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if _initialises(func, target):
            return target
        return func(*args, **kwargs)


def _initialises(func, target) -> bool:
    if getattr(func, "__module__", None) == "torch.nn.init":
        return True
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__") and isinstance(target, torch.Tensor)
            and (isinstance(target, nn.Parameter) or isinstance(target._base, nn.Parameter)))


def load_model(path: Path | str, device: torch.device | str = "cpu") -> Model:
    """The model of a checkpoint (or of a run's latest checkpoint), in eval mode."""
    device = _usable_device(device)
    path = checkpoint.resolve(Path(path))
    config = checkpoint.read_configs(path)[0]
    if config.attention_impl == "triton" and torch.device(device).type != "cuda":
        # The kernel is how attention is computed, not what: a model trained with the
        # Triton kernel on a GPU loads anywhere, with PyTorch's kernel off the GPU.
        config = dataclasses.replace(config, attention_impl="sdpa")
    model = empty_model(config, device)
    checkpoint.load_weights(model, path, device)
    if isinstance(model, EncoderOnly):
        model.labels = checkpoint.read_labels(path)
        model.classifier_inputs = checkpoint.read_classifier_inputs(path)
        model.sentence_embedding = checkpoint.read_sentence_embedding(path)
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
           "DecoderOnly", "LMState", "EncoderOnly", "build_model", "empty_model", "load_model",
           "Seq2SeqModel", "Generative", "Model"]
