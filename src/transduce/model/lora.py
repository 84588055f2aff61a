"""Low-rank adaptation (LoRA, Hu et al. 2021): fine-tune a model by training, beside each
chosen linear layer's frozen weight W (out, in), two small matrices A (r, in) and B
(out, r) whose product is added to it:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T      ==   x (W + (alpha / r) B A)^T + b

B starts at zero, so training starts from the model as it was; only A and B (and the
heads a fine-tuning adds) have gradients and Adam moments, and the weight gradients of
W, a third of a layer's matmuls in a step, are never computed. Once trained, the
product is merged into W: the model runs as fast as before and is a plain checkpoint.

    adapters = add_adapters(model, LoRASettings(rank=8, alpha=16.0))
    merged = merged_weights(model)       # name -> tensor, as the model without adapters
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from transduce.config import LORA_TARGETS, ConfigError
from transduce.model.quantized_weight import FORMATS, QuantizedWeight

# The linear layers of a block each name of --lora-targets stands for: the attention's
# projections (self and cross) and the feed-forward's (linear3: a gated unit's second
# input, Llama's up_proj).
TARGET_LAYERS: dict[str, tuple[str, ...]] = {
    "q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("out_proj",),
    "ffn": ("linear1", "linear2", "linear3")}
assert tuple(TARGET_LAYERS) == LORA_TARGETS


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ("q", "k", "v", "o", "ffn")
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    """A linear layer whose weight and bias are the frozen ones of `base` (the same
    Parameter objects, not copies: the state dict names them as before) with a trainable
    low-rank update beside them. keep_frozen_in() may keep the weight in fewer bits."""

    def __init__(self, base: nn.Linear, settings: LoRASettings):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.quantized: QuantizedWeight | None = None
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scale = settings.scale
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(settings.rank, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, settings.rank, **factory))
        # A as nn.Linear initialises its weight (and as PEFT does); B = 0: no change yet.
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.dropout = nn.Dropout(settings.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., out)."""
        frozen = not (self.quantized is None and self.weight.requires_grad) and \
            not (self.bias is not None and self.bias.requires_grad)
        if frozen and not (self.training and self.dropout.p):
            return _MergedLoRA.apply(x, self.frozen_weight, self.bias, self.lora_a,
                                     self.lora_b, self.scale)
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        if frozen:     # not in place: the Function's output is a view (of a 2-D product)
            return _FrozenLinear.apply(x, self.frozen_weight, self.bias).add(update,
                                                                             alpha=self.scale)
        return F.linear(x, self.weight, self.bias).add_(update, alpha=self.scale)

    def frozen_weight(self, dtype: torch.dtype) -> Tensor:
        """W (out, in) in `dtype`: the frozen weight cast, or dequantized."""
        if self.quantized is not None:
            return self.quantized.dequantized(dtype)
        return self.weight.to(dtype)

    @property
    def frozen_format(self) -> str:
        """How the frozen weight is kept: "float32", "bfloat16", ... or "int8", "nf4",
        "nf4-dq"."""
        if self.quantized is not None:
            return self.quantized.format
        return str(self.weight.dtype).removeprefix("torch.")

    @torch.no_grad()
    def merged_weight(self, weight: Tensor | None = None) -> Tensor:
        """W + (alpha / r) B A: (out, in), summed in float32 at least, in the dtype of W:
        the layer's own (dequantized to its scales' dtype if kept in fewer bits), or
        `weight`, the same matrix kept elsewhere in more precision (a frozen weight kept
        in bfloat16 or quantized is merged into its float32 original)."""
        if weight is None:
            weight = self.frozen_weight(self.quantized.dtype if self.quantized is not None
                                        else self.weight.dtype)
        weight = weight.to(self.lora_a.device)
        dtype = torch.promote_types(weight.dtype, torch.float32)
        delta = self.lora_b.to(dtype) @ self.lora_a.to(dtype)
        return (weight.to(dtype) + self.scale * delta).to(weight.dtype)

    def keep_frozen_in(self, kind: str) -> None:
        """Keep the frozen weight in `kind`: "bfloat16" (half the memory; under autocast
        in that dtype every product reads it as it did before, and so the bias), or
        "int8", "nf4" or "nf4-dq" (a quarter, 14%, 12.9%: model/quantized_weight.py),
        dequantized for each product (the bias stays as it is)."""
        if kind in FORMATS:
            self.quantized = QuantizedWeight(self.weight.detach(), kind)
            self.register_parameter("weight", None)
            return
        dtype = getattr(torch, kind)
        self.weight = nn.Parameter(self.weight.detach().to(dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.lora_a.shape[0]}, scale={self.scale:g}")


def _product_dtype(x: Tensor) -> torch.dtype:
    """The dtype autocast would multiply x in, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _MergedLoRA(torch.autograd.Function):
    """y = x (W + s B A)^T + b in one product, for a frozen W (and b) and no dropout
    between x and the adapters. The two-product form writes and adds a second (N, out)
    product and reads it back in the backward pass: forward and backward took a quarter
    more time than the frozen layer alone (float32, 2,048 x 768 -> 2,048 on 2 cores),
    this form 15% more. Its backward pass multiplies the gradient by the merged weight
    (merged again: keeping it would hold a second copy of the weights until then) for
    x's gradient, and reads the gradient and x once more each through rank-r products
    for A's and B's:
        dx = g W',   dB = s g^T (x A^T),   dA = s (g B)^T x."""

    @staticmethod
    def forward(ctx, x: Tensor, frozen: Callable[[torch.dtype], Tensor], bias: Tensor | None,
                lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(x, lora_a, lora_b)
        ctx.frozen, ctx.scale = frozen, scale
        # Every operand cast to the product's dtype here, whatever the frozen weight is
        # kept in.
        dtype = _product_dtype(x)
        merged = _merged(frozen, lora_a, lora_b, scale, dtype)               # (out, in)
        return F.linear(x.to(dtype), merged, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, lora_a, lora_b = ctx.saved_tensors
        dtype = grad.dtype                   # the forward product's
        rows = grad.reshape(-1, grad.shape[-1])                            # (N, out)
        inputs = x.reshape(-1, x.shape[-1]).to(dtype)                      # (N, in)
        grad_x = None
        if ctx.needs_input_grad[0]:          # the forward's merged weight, bit for bit
            grad_x = (grad @ _merged(ctx.frozen, lora_a, lora_b, ctx.scale, dtype)).to(x.dtype)
        grad_b = (rows.T @ (inputs @ lora_a.to(dtype).T)).mul_(ctx.scale)   # (out, r)
        grad_a = ((rows @ lora_b.to(dtype)).T @ inputs).mul_(ctx.scale)     # (r, in)
        return grad_x, None, None, grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype), None


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b for a frozen W and b, W materialized (cast or dequantized) for the
    forward product and again for the backward one, never kept in between: autograd's
    F.linear would hold every layer's dequantized weight until the backward pass."""

    @staticmethod
    def forward(ctx, x: Tensor, frozen: Callable[[torch.dtype], Tensor],
                bias: Tensor | None) -> Tensor:
        ctx.frozen, ctx.x_dtype = frozen, x.dtype
        dtype = _product_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), frozen(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        with torch.autocast(grad.device.type, enabled=False):
            grad_x = grad @ ctx.frozen(grad.dtype)
        return grad_x.to(ctx.x_dtype), None, None


def _merged(frozen: Callable[[torch.dtype], Tensor], lora_a: Tensor, lora_b: Tensor,
            scale: float, dtype: torch.dtype) -> Tensor:
    """W + s B A in `dtype`, each operand cast to it first (as autocast casts them)."""
    with torch.autocast(lora_a.device.type, enabled=False):
        return torch.addmm(frozen(dtype), lora_b.to(dtype), lora_a.to(dtype), alpha=scale)


def add_adapters(model: nn.Module, settings: LoRASettings) -> list[str]:
    """Put a LoRALinear in place of every linear layer `settings.targets` names, freeze
    every other parameter, and return the adapted layers' names. A model with no such
    layer (an RNN encoder-decoder) is a ConfigError."""
    if settings.rank < 1:
        raise ConfigError(f"lora_rank={settings.rank}: must be at least 1")
    wanted = {layer for name in settings.targets for layer in TARGET_LAYERS[name]}
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in wanted and type(child) is nn.Linear:
                setattr(module, child_name, LoRALinear(child, settings))
                adapted.append(f"{name}.{child_name}" if name else child_name)
    if not adapted:
        raise ConfigError(f"lora: the model ({type(model).__name__}) has no linear layer "
                          f"that --lora-targets {','.join(settings.targets)} names")
    return adapted


def adapter_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's adapted layers by name (none for a model without adapters)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, LoRALinear)}


def has_adapters(model: nn.Module) -> bool:
    return bool(adapter_layers(model))


def adapter_weights(model: nn.Module) -> dict[str, Tensor]:
    """The trained matrices alone: "<layer>.lora_a" (r, in) and "<layer>.lora_b" (out, r)."""
    return {f"{name}.{part}": getattr(layer, part).detach()
            for name, layer in adapter_layers(model).items() for part in ("lora_a", "lora_b")}


def merged_weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict as the model without adapters has it, each adapted weight
    merged (W + (alpha / r) B A) and the adapters' own matrices left out. A weight kept
    in less precision is merged as kept (LoRALinear.keep_frozen_in); a quantized one,
    which is not in the model's state dict, is added."""
    merged = {f"{name}.weight": layer.merged_weight()
              for name, layer in adapter_layers(model).items()}
    return {**unadapted_state(model), **merged}


def unadapted_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict without the adapters' own matrices."""
    adapter_names = {f"{name}.{part}" for name in adapter_layers(model)
                     for part in ("lora_a", "lora_b")}
    return {name: tensor for name, tensor in model.state_dict().items()
            if name not in adapter_names}


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Merge every adapter into its weight, in place, leaving plain nn.Linear layers
    (whose parameters train again): the model as a checkpoint without adapters holds it."""
    layers = adapter_layers(model)
    if not layers:
        return model
    for name, layer in layers.items():
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device="meta")
        plain.weight = nn.Parameter(layer.merged_weight())
        if layer.bias is not None:
            plain.bias = nn.Parameter(layer.bias.detach())
        setattr(parent, child_name, plain)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model
