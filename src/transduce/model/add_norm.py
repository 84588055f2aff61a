"""The end of a post-norm sub-layer, LayerNorm(x + dropout(y)), in one pass over its rows.

PyTorch's ops, or torch.compile's kernels for them, read and write the sum, the dropout
mask and the normalized rows in several passes, and reduce the weight and bias
gradients down every row in a pass of their own. With attention_impl "triton", a
training step runs this as two Triton kernels (add_norm_kernels.py): a forward pass
that keeps only each row's mean and 1 / std, and a backward pass that makes the sum
and the mask again from x, y and a seed, and sums the weight and bias gradients as it
goes. The seed is drawn on the device (no pause for the host, nothing that stops a
CUDA graph) and kept for the backward pass.

Elsewhere (evaluation, other impls, RMSNorm, pre-norm layers, and wherever the
kernels cannot run: no triton package, or a CPU outside Triton's interpreter, as a
linear-attention model with impl "triton" may train) it is PyTorch's ops.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch
from torch import Tensor, nn

from transduce.attention.triton_flash import block_width, kernels_for
from transduce.model.dropout import Dropout

# Rows wider than this fall back to PyTorch's ops (a row is held in registers).
MAX_WIDTH = 8192
HAS_TRITON = importlib.util.find_spec("triton") is not None


def add_dropout_norm(x: Tensor, y: Tensor, norm: nn.Module, dropout: Dropout,
                     fused: bool) -> Tensor:
    """x (..., C) a sub-layer's input, y (..., C) its output -> norm(x + dropout(y)).
    fused (the layer's attention_impl is "triton"): the Triton kernels while training,
    where norm is a LayerNorm with weights over C features."""
    if fused and dropout.training and isinstance(norm, nn.LayerNorm) \
            and norm.elementwise_affine and len(norm.normalized_shape) == 1 \
            and x.shape == y.shape and x.shape[-1] <= MAX_WIDTH and _kernels_run_on(x.device):
        return fused_add_dropout_norm(x, y, norm.weight, norm.bias, norm.eps, dropout.p)
    return norm(x + dropout(y))


def fused_add_dropout_norm(x: Tensor, y: Tensor, weight: Tensor, bias: Tensor | None,
                           eps: float, dropout_p: float) -> Tensor:
    """layer_norm(x + dropout(y, dropout_p), (C,), weight, bias, eps) by the Triton
    kernels: x, y (..., C), weight, bias (C,) -> (..., C) in float32 under autocast (as
    autocast's layer_norm), else in x's and y's promoted dtype."""
    kernels = _kernels(x.device)
    width = x.shape[-1]
    out_dtype = torch.float32 if torch.is_autocast_enabled(x.device.type) \
        else torch.promote_types(x.dtype, y.dtype)
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device)
    out = _AddNorm.apply(_rows(x, width), _rows(y, width), weight, bias, seed, eps, dropout_p,
                         out_dtype, kernels)
    return out.view(x.shape)


def keep_mask(rows: int, width: int, dropout_p: float, seed: Tensor) -> Tensor:
    """The keep mask (rows, width) bool the kernels draw for this seed (a (1,) int64 on
    their device): what tests build their reference with."""
    kernels = _kernels(seed.device)
    keep = torch.empty((rows, width), dtype=torch.int8, device=seed.device)
    kernels.add_norm_keep_mask_kernel[(rows,)](keep, seed, width, dropout_p,
                                               BLOCK_N=block_width(width))
    return keep.bool()


def _kernels_run_on(device: torch.device) -> bool:
    """Whether the kernels run here: triton installed, and a CUDA device or Triton's
    interpreter (kernels_for says why not, for a caller that asked for them)."""
    return HAS_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def _kernels(device: torch.device) -> ModuleType:
    kernels_for(device)   # CUDA or Triton's interpreter, or a TritonUnavailable saying why
    from transduce.model import add_norm_kernels
    return add_norm_kernels


def _rows(t: Tensor, width: int) -> Tensor:
    """(..., C) -> (M, C) with unit stride along C (a view where it can be)."""
    return t.reshape(-1, width) if t.stride(-1) == 1 else t.contiguous().view(-1, width)


def _launch(width: int, device: torch.device) -> dict:
    """Launch settings on a GPU: a warp per 256 elements of a row, 1 to 8."""
    if device.type != "cuda":
        return {}
    return dict(num_warps=min(8, max(1, block_width(width) // 256)))


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, weight, bias, seed, eps, dropout_p, out_dtype, kernels):
        rows, width = x.shape
        out = torch.empty((rows, width), dtype=out_dtype, device=x.device)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        kernels.add_norm_forward_kernel[(rows,)](
            x, y, weight, weight if bias is None else bias, out, mean, rstd, seed,
            x.stride(0), y.stride(0), out.stride(0), width, eps, dropout_p,
            BLOCK_N=block_width(width), DROPOUT=dropout_p > 0, HAS_BIAS=bias is not None,
            **_launch(width, x.device))
        ctx.save_for_backward(x, y, weight, mean, rstd, seed)
        ctx.dropout_p, ctx.kernels = dropout_p, kernels
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, y, weight, mean, rstd, seed = ctx.saved_tensors
        rows, width = x.shape
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        programs = _programs(rows, x.device)
        per_program = -(-rows // programs)
        programs = -(-rows // per_program)
        dx, dy = torch.empty_like(x), torch.empty_like(y)
        dw = torch.empty((programs, width), dtype=torch.float32, device=x.device)
        db = torch.empty_like(dw) if ctx.bias_dtype is not None else dw
        ctx.kernels.add_norm_backward_kernel[(programs,)](
            x, y, weight, grad_out, mean, rstd, seed, dx, dy, dw, db,
            x.stride(0), y.stride(0), grad_out.stride(0), dx.stride(0), dy.stride(0),
            rows, width, per_program, ctx.dropout_p, BLOCK_N=block_width(width),
            DROPOUT=ctx.dropout_p > 0, HAS_BIAS=ctx.bias_dtype is not None,
            **_launch(width, x.device))
        grad_bias = None if ctx.bias_dtype is None else db.sum(0).to(ctx.bias_dtype)
        return dx, dy, dw.sum(0).to(weight.dtype), grad_bias, None, None, None, None, None


def _programs(rows: int, device: torch.device) -> int:
    """How many programs share the rows: eight per streaming multiprocessor on a GPU, so
    that while some wait for their rows others compute (each program's partial sums are
    a row the caller adds up: 2 MiB at 1,056 programs of 512 floats); four in the
    interpreter, so that tests cover programs with several rows and a short last one."""
    if device.type != "cuda":
        return min(rows, 4)
    return min(rows, 8 * torch.cuda.get_device_properties(device).multi_processor_count)
