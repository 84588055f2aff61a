"""The argument checks of the attention kernels: each misuse named, with the shapes seen.

Shared by attention() and flash_attention(), which users call directly too; a wrong
shape, dtype or mask would otherwise surface as a raw matmul or broadcasting error from
deep inside a kernel (or, for zero key/value heads, a ZeroDivisionError).
"""

from __future__ import annotations

import torch
from torch import Tensor

from transduce.attention import masks


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q (B, H, T, D), k and v (B, H_kv, S, D), H a multiple of H_kv >= 1; one floating
    dtype and one device for the three."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, T, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    batch, heads, _, dim = q.shape
    if k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch or head size")
    if heads < 1 or k.shape[1] < 1 or heads % k.shape[1]:
        raise ValueError(f"{heads} query heads cannot be grouped over {k.shape[1]} key/value heads")
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one floating-point dtype; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, "
                         f"{v.device}")


def check_mask(q: Tensor, k: Tensor, mask: Tensor | masks.Segments | None
               ) -> Tensor | masks.Segments | None:
    """A boolean mask broadcastable to (B, H, T, S) with the full key dimension, or a
    packed batch's Segments -> the mask made 4-D."""
    if mask is None:
        return None
    if isinstance(mask, masks.Segments):
        return check_segments(q, k, mask)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        kind = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask must be boolean (True = may attend), got {kind}")
    if mask.dim() > 4:
        raise ValueError(f"mask must broadcast to (B, H, T, S), got shape {tuple(mask.shape)}")
    mask = masks.four_d(mask)
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    # Compared, not `m in (1, t)`: under torch.compile two equal symbolic sizes are
    # different objects, and Dynamo's `in` found them unequal (strided attention).
    if any(m != 1 and m != t for m, t in zip(mask.shape, target)) or mask.shape[3] != target[3]:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"(B, H, T, S) = {target} with a full key dimension")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device}, q on {q.device}")
    return mask


def check_segments(q: Tensor, k: Tensor, segments: masks.Segments) -> masks.Segments:
    """Segments' numbers must be (B, T) and (B, S) integers for q (B, H, T, D), k (B, Hkv, S, D)."""
    for name, numbers, length in (("queries", segments.queries, q.shape[2]),
                                  ("keys", segments.keys, k.shape[2])):
        if numbers.dtype not in (torch.int32, torch.int64) or \
                tuple(numbers.shape) != (q.shape[0], length):
            raise ValueError(f"Segments.{name} must be integer sentence numbers of shape "
                             f"{(q.shape[0], length)}, got {numbers.dtype} {tuple(numbers.shape)}")
    return segments


def check_position_bias(q: Tensor, k: Tensor, bias: Tensor | None) -> None:
    if bias is None:
        return
    expected = (q.shape[1], q.shape[2] + k.shape[2] - 1)
    if tuple(bias.shape) != expected or not bias.is_floating_point():
        raise ValueError(f"position_bias must be a float (H, T + S - 1) = {expected} tensor, "
                         f"got {bias.dtype} {tuple(bias.shape)}")


def check_score_bias(q: Tensor, k: Tensor, bias: Tensor | None) -> None:
    if bias is None:
        return
    batch, heads, num_queries = q.shape[:3]
    if bias.dim() != 4 or (bias.shape[0] != 1 and bias.shape[0] != batch) or \
            tuple(bias.shape[1:]) != (heads, num_queries, k.shape[2]) or \
            not bias.is_floating_point():
        raise ValueError(f"score_bias must be a float (B or 1, H, T, S) = "
                         f"({batch}, {heads}, {num_queries}, {k.shape[2]}) tensor, got "
                         f"{bias.dtype} {tuple(bias.shape)}")


def check_dropout(dropout_p: float, name: str = "dropout_p") -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name}={dropout_p} must be in [0, 1)")
