"""The end of a post-norm sub-layer, out = LayerNorm(x + dropout(y)), as Triton kernels
(loaded by add_norm.py):

    add_norm_forward_kernel    one row per program: x + dropout(y) in float32, its mean
                               and 1 / std, the normalized row scaled and shifted;
                               writes out, mean, rstd.
    add_norm_backward_kernel   a run of rows per program: the sum s = x + dropout(y)
                               made again from x, y and the seed (nothing of it was
                               stored), then
                                   xhat = (s - mean) * rstd,  g = dout * w,
                                   ds = rstd * (g - mean(g) - xhat * mean(g * xhat)),
                                   dx = ds,  dy = ds * keep / (1 - p);
                               each program sums dw = dout * xhat and db = dout over its
                               rows in registers and writes one row of partial sums,
                               which the caller adds up.

Why by hand: on an H200, torch.compile's kernels for this (the paper's base model, 25,000
tokens) took about 145 us each backward and 57-84 us forward, 30 of each a step, some
three times what their bytes need at the GPU's bandwidth: the weight and bias gradients
are a reduction down 25,000 rows, and one program a row cannot hold partial sums. Here
one program holds them for its whole run of rows.

Dropout keeps element (row, col) where Philox at offset row * N + col, from the seed,
draws at least p, the same in both kernels and in add_norm_keep_mask_kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Float arguments as float32: torch.compile's launcher passes them as float64.
from transduce.attention.triton_kernels import _float32


@triton.jit
def _keep(seed, row, cols, N, dropout_p):
    return tl.rand(seed, tl.cast(row, tl.int64) * N + cols) >= dropout_p


@triton.jit
def _sum_row(X, Y, row, sx, sy, cols, inside, N, dropout_p, seed, DROPOUT: tl.constexpr):
    """x + dropout(y) of one row in float32 (0 past N), and its keep mask."""
    x = tl.load(X + row * sx + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(Y + row * sy + cols, mask=inside, other=0.0).to(tl.float32)
    keep = inside
    if DROPOUT:
        keep = inside & _keep(seed, row, cols, N, dropout_p)
        y = tl.where(keep, y / (1.0 - dropout_p), 0.0)
    return x + y, keep


@triton.jit
def add_norm_forward_kernel(X, Y, W, B, Out, Mean, Rstd, Seed, sx, sy, so, N, eps, dropout_p,
                   BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """grid (M,): row `row` of out (M, N), its mean and rstd (M,) float32."""
    eps, dropout_p = _float32(eps), _float32(dropout_p)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    seed = tl.load(Seed)
    s, _ = _sum_row(X, Y, row, sx, sy, cols, inside, N, dropout_p, seed, DROPOUT)
    mean = tl.sum(s, 0) / N
    centered = tl.where(inside, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / N + eps)
    out = centered * rstd * tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Out + row * so + cols, out.to(Out.dtype.element_ty), mask=inside)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def add_norm_backward_kernel(X, Y, W, DOut, Mean, Rstd, Seed, DX, DY, DW, DB,
                    sx, sy, sdo, sdx, sdy, M, N, rows_per_program, dropout_p,
                    BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """grid (programs,): dx, dy of rows [pid * rows_per_program, ...) and this program's
    partial sums of dw, db (a row of DW, DB (programs, N) float32)."""
    dropout_p = _float32(dropout_p)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    seed = tl.load(Seed)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, M)):
        s, keep = _sum_row(X, Y, row, sx, sy, cols, inside, N, dropout_p, seed, DROPOUT)
        xhat = tl.where(inside, (s - tl.load(Mean + row)) * tl.load(Rstd + row), 0.0)
        dout = tl.load(DOut + row * sdo + cols, mask=inside, other=0.0).to(tl.float32)
        g = dout * w
        dw += dout * xhat
        db += dout
        ds = (g - (xhat * (tl.sum(xhat * g, 0) / N) + tl.sum(g, 0) / N)) * tl.load(Rstd + row)
        tl.store(DX + row * sdx + cols, ds.to(DX.dtype.element_ty), mask=inside)
        if DROPOUT:
            ds = tl.where(keep, ds / (1.0 - dropout_p), 0.0)
        tl.store(DY + row * sdy + cols, ds.to(DY.dtype.element_ty), mask=inside)
    tl.store(DW + pid * N + cols, dw, mask=inside)
    if HAS_BIAS:
        tl.store(DB + pid * N + cols, db, mask=inside)


@triton.jit
def add_norm_keep_mask_kernel(Keep, Seed, N, dropout_p, BLOCK_N: tl.constexpr):
    """grid (M,): the keep mask (M, N) int8 the other kernels draw for this seed."""
    dropout_p = _float32(dropout_p)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    keep = _keep(tl.load(Seed), row, cols, N, dropout_p)
    tl.store(Keep + row * N + cols, keep.to(tl.int8), mask=cols < N)
