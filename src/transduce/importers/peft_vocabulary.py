"""A language model's PEFT adapter on its vocabulary matrices: LoRA on the output
projection (lm_head, a Linear: B A is (V, d)) and on the token embedding (embed_tokens,
GPT-2's wte: PEFT keeps A (r, V) and B (d, r), and the embedding's update is (B A)^T).
Where either is adapted, PEFT saves both matrices as they were when it trained
(base_layer.weight); modules_to_save saves them trained whole. Either replaces the
base's matrix, and one of another vocabulary size than the base's is refused by name.

PEFT adapts the two sides apart even where the base ties them (the adapted layer wraps
one of them), so a tied model whose embedding or output projection the adapter changes
comes out untied: each side with its own update, as the adapter computed it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from transduce import checkpoint
from transduce.importers import ForeignCheckpointError
from transduce.model import DecoderOnly, empty_model

# Hugging Face module names of a causal LM's vocabulary matrices -> ours.
VOCABULARY_MODULES = {"lm_head": "output_proj.weight",
                      "model.embed_tokens": "decoder.embed.embedding.weight",
                      "transformer.wte": "decoder.embed.embedding.weight"}


def vocabulary_updates(model, deltas: dict[str, Tensor], saved: dict[str, Tensor],
                       file: Path):
    """`model` (a DecoderOnly) with the adapter's vocabulary matrices: `saved` (module ->
    a weight (V, d) that replaces the base's: the one PEFT trained beside, or one trained
    whole) in place, then `deltas` (module -> the scaled update (V, d)) added; untied
    where the two sides then differ -> the model."""
    if not deltas and not saved:
        return model
    if not isinstance(model, DecoderOnly):
        module = next(iter({**deltas, **saved}))
        raise ForeignCheckpointError(f"{file}: an adapter on {module}; a vocabulary matrix "
                                     f"is merged into a language model (arch 'decoder')")
    ours = dict(model.named_parameters(remove_duplicate=False))
    for module, tensor in saved.items():
        _check_shape(file, f"{module}'s saved weight", tensor, ours[VOCABULARY_MODULES[module]])
    for module, tensor in deltas.items():
        _check_shape(file, f"{module}'s update", tensor, ours[VOCABULARY_MODULES[module]])
    shared = model.output_proj.weight is model.decoder.embed.embedding.weight
    if shared and (deltas or any(not torch.equal(tensor.to(model.output_proj.weight.dtype),
                                                 model.output_proj.weight)
                                 for tensor in saved.values())):
        model = _untied(model)
        ours = dict(model.named_parameters())
    with torch.no_grad():
        for module, weight in saved.items():
            ours[VOCABULARY_MODULES[module]].copy_(weight)
        for module, delta in deltas.items():
            target = ours[VOCABULARY_MODULES[module]]
            target += delta.to(target.dtype)
    return model


def _check_shape(file: Path, what: str, tensor: Tensor, target: Tensor) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise ForeignCheckpointError(
            f"{file}: {what} has shape {tuple(tensor.shape)}, the base's {tuple(target.shape)} "
            f"(a vocabulary of {tensor.shape[0]} tokens where the base has "
            f"{target.shape[0]}: import the base the adapter was trained on)")


def _untied(model: DecoderOnly) -> DecoderOnly:
    """A copy of the tied model whose output projection is a matrix of its own."""
    untied = empty_model(model.config.replace(tie_embeddings="none"))
    state = model.state_dict()
    state["output_proj.weight"] = state["decoder.embed.embedding.weight"].clone()
    untied.load_state_dict(state)
    for name in checkpoint.DESCRIBED:
        if hasattr(model, name):
            setattr(untied, name, getattr(model, name))
    return untied.eval()
