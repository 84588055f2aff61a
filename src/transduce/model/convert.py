"""Multi-head -> grouped-query / multi-query attention, as Ainslie et al. (2023) convert
a checkpoint: the key and value projection heads of each group of H / G query heads
are mean-pooled into one head. The converted model then needs a short uptraining (the
paper: 5% of the original steps) to recover.

Only the decoder's attention is converted (its self- and cross-attention, whose keys and
values are what decoding caches); the encoder keeps full heads, as ModelConfig says.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transduce.config import ConfigError
from transduce.model.transformer import Transformer


def pool_heads(weight: Tensor, heads: int, groups: int) -> Tensor:
    """A projection's rows, heads x D of them, -> groups x D rows: the mean of each
    group of heads / groups consecutive heads. Weight (H * D, C) or bias (H * D,)."""
    head_dim = weight.shape[0] // heads
    grouped = weight.unflatten(0, (groups, heads // groups, head_dim))   # (G, H/G, D, ...)
    return grouped.mean(dim=1).flatten(0, 1)


def convert_kv_heads(model: Transformer, kv_heads: int) -> Transformer:
    """A copy of `model` whose decoder attention has kv_heads key/value heads."""
    c = model.config
    if c.arch != "transformer":
        raise ConfigError(f"convert-kv converts Transformer attention heads; this model is "
                          f"arch={c.arch!r}")
    if c.kv_heads != c.num_heads:
        raise ConfigError(f"the model already has num_kv_heads={c.kv_heads}: convert from the "
                          f"multi-head ({c.num_heads} heads) checkpoint")
    config = c.replace(num_kv_heads=kv_heads)  # validates that kv_heads divides num_heads
    converted = Transformer(config)
    converted.languages = model.languages
    converted.language_codes = model.language_codes
    state = model.state_dict()
    pooled = {}
    for name, tensor in state.items():
        parts = name.split(".")
        if parts[0] == "decoder" and parts[-2] in ("k_proj", "v_proj"):
            pooled[name] = pool_heads(tensor, c.num_heads, kv_heads)
    with torch.no_grad():
        converted.load_state_dict({**state, **pooled})
    return converted.eval()
