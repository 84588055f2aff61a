"""Tiled attention with an online softmax (FlashAttention's algorithm, in PyTorch ops).

Forward: for each block of queries, walk the key/value tiles keeping, per query row, the
running max m, the running denominator l and the unnormalised output acc:

    m_new = max(m, rowmax(s))          p = exp(s - m_new)
    l     = l * exp(m - m_new) + rowsum(p)
    acc   = acc * exp(m - m_new) + p v

so the (T, S) score matrix never exists; the output is acc / l. Only the row statistic
lse = m + log(l) is saved. Backward recomputes each score tile from q, k and lse:
p = exp(s - lse), and with Delta = rowsum(dO * O),

    dV += p^T dO    dS = p * (dO V^T - Delta)    dQ += dS K    dK += dS^T Q

Memory is O(T + S) beyond one (block_q x block_k) tile per head. Works on any device that
runs the PyTorch ops used here (CPU, CUDA). Grouped-query attention is handled by
stacking the G query heads that share a key/value head along the row dimension, so keys
and values are never repeated and dK, dV sum over the group for free.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transduce.attention import masks
from transduce.attention.checks import check_dropout, check_mask, check_position_bias, \
    check_qkv
from transduce.attention.tiles import tiles

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256


def flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                    causal: bool = False, dropout_p: float = 0.0, scale: float,
                    block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                    seed: int | None = None, position_bias: Tensor | None = None) -> Tensor:
    """q (B, H, T, D), k/v (B, Hkv, S, D), mask (B|1, H|1, T|1, S) bool,
    position_bias (H, T + S - 1) (position_bias.py) -> (B, H, T, D).

    seed fixes the dropout pattern (drawn from torch's generator when None); the backward
    regenerates the same pattern tile by tile instead of storing it.
    """
    if not torch.jit.is_tracing():
        mask = _checked_mask(q, k, v, mask, position_bias, dropout_p, block_q, block_k)
    return tiled_attention(q, k, v, mask, causal=causal, dropout_p=dropout_p, scale=scale,
                           block_q=block_q, block_k=block_k, seed=seed,
                           position_bias=position_bias)


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool,
                    dropout_p: float, scale: float, block_q: int = DEFAULT_BLOCK_Q,
                    block_k: int = DEFAULT_BLOCK_K, seed: int | None = None,
                    position_bias: Tensor | None = None) -> Tensor:
    """flash_attention without its argument checks, for attention(), which has made
    them already (mask 4-D); the same shapes."""
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return _FlashAttention.apply(q, k, v, mask, position_bias, causal, scale, dropout_p,
                                 seed or 0, block_q, block_k)


def _checked_mask(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None,
                  dropout_p: float, block_q: int, block_k: int) -> Tensor | None:
    """Clear errors for misuse (as attention() gives); returns the mask made 4-D."""
    check_qkv(q, k, v)
    if isinstance(mask, masks.Segments):
        raise ValueError("flash_attention takes a boolean mask; give Segments to "
                         "attention(), which turns them into one")
    check_position_bias(q, k, bias)
    check_dropout(dropout_p)
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"{name}={block!r} must be a positive number of rows")
    return check_mask(q, k, mask)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, causal, scale, dropout_p, seed, block_q, block_k):
        tiles = _Tiling(q, k, mask, bias, causal, scale, dropout_p, seed, block_q, block_k)
        out, lse = tiles.forward(q, k, v)
        ctx.save_for_backward(q, k, v, mask, bias, out, lse)
        ctx.settings = (causal, scale, dropout_p, seed, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, bias, out, lse = ctx.saved_tensors
        tiles = _Tiling(q, k, mask, bias, *ctx.settings)
        dq, dk, dv, dbias = tiles.backward(q, k, v, out, lse, grad_out,
                                           bias is not None and ctx.needs_input_grad[4])
        return dq, dk, dv, None, dbias, None, None, None, None, None, None


class _Tiling:
    """The tile walk shared by forward and backward: block bounds, masks and dropout.

    Rows of a query block are laid out as (G * block) so that one matmul serves the G
    query heads of a key/value head: q (B, H, T, D) -> (B, Hkv, G, T, D).
    """

    def __init__(self, q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor | None,
                 causal: bool, scale: float, dropout_p: float, seed: int, block_q: int,
                 block_k: int):
        self.batch, heads, self.num_queries, self.dim = q.shape
        self.kv_heads, self.num_keys = k.shape[1], k.shape[2]
        self.group = heads // self.kv_heads
        self.causal, self.scale = causal, scale
        # Softmax statistics and sums in float32 at least (float64 stays float64).
        self.acc_dtype = torch.promote_types(q.dtype, torch.float32)
        self.dropout_p, self.seed = dropout_p, seed
        self.block_q, self.block_k = block_q, block_k
        # Queries sit at the end of the keys: query i sees key j when j <= i + offset.
        self.offset = self.num_keys - self.num_queries
        # Kept as given (possibly an expanded view): only tile slices are ever inverted.
        self.allowed = None if mask is None else masks.group_heads(mask, self.kv_heads, self.group)
        self.bias = None if bias is None else bias.to(self.acc_dtype)            # (H, T + S - 1)
        self.bias_dtype = None if bias is None else bias.dtype
        self.generator = None
        if dropout_p > 0:
            self.generator = torch.Generator(device=q.device)

    def query_blocks(self):
        return tiles(self.num_queries, self.block_q)

    def key_blocks(self, q_start: int, q_end: int):
        for start, end in tiles(self.num_keys, self.block_k):
            if self.causal and start > q_end - 1 + self.offset:
                return  # this tile and all after it lie above the diagonal
            yield start, end

    def rows(self, x: Tensor, start: int, end: int) -> Tensor:
        """(B, H, T, X) -> (B, Hkv, G * block, X): a query block's rows, grouped."""
        x5 = x.unflatten(1, (self.kv_heads, self.group))[:, :, :, start:end]
        return x5.reshape(self.batch, self.kv_heads, self.group * (end - start), x.shape[-1])

    def unrows(self, x: Tensor, start: int, end: int) -> Tensor:
        """(B, Hkv, G * block, X) -> (B, H, block, X)."""
        return x.view(self.batch, self.kv_heads * self.group, end - start, x.shape[-1])

    def scores(self, q_rows: Tensor, k_tile: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        """Scaled, masked scores of one tile in acc_dtype: (B, Hkv, G * tq, tk)."""
        s = (q_rows @ k_tile.transpose(-1, -2)).to(self.acc_dtype)
        s5 = s.view(self.batch, self.kv_heads, self.group, qe - qs, ke - ks)
        if self.allowed is not None:
            rows = slice(None) if self.allowed.shape[3] == 1 else slice(qs, qe)
            s5.masked_fill_(~self.allowed[:, :, :, rows, ks:ke], float("-inf"))
        if self.bias is not None:
            s5 += self.bias[:, self.bias_index(qs, qe, ks, ke)].view(
                self.kv_heads, self.group, qe - qs, ke - ks)
        if self.causal and ke - 1 > qs + self.offset:  # the tile crosses the diagonal
            allowed = masks.causal_mask(qe - qs, ke - ks, offset=qs + self.offset - ks,
                                        device=s.device)
            s5.masked_fill_(~allowed, float("-inf"))
        return s

    def bias_index(self, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        """Where each score of a tile reads the bias vector: query t, key s -> t - s + S - 1."""
        device = self.bias.device
        return (torch.arange(qs, qe, device=device)[:, None]
                - torch.arange(ks, ke, device=device)[None, :] + self.num_keys - 1)

    def keep(self, like: Tensor, q_block: int, k_block: int) -> Tensor | None:
        """Dropout's keep-and-rescale factors for one tile, regenerated from the seed."""
        if self.generator is None:
            return None
        num_k_blocks = -(-self.num_keys // self.block_k)
        self.generator.manual_seed(self.seed + q_block * num_k_blocks + k_block)
        uniform = torch.rand(like.shape, generator=self.generator, device=like.device)
        return (uniform >= self.dropout_p).to(self.acc_dtype).div_(1.0 - self.dropout_p)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """-> out (B, H, T, D) in q's dtype, lse (B, H, T, 1) in acc_dtype."""
        acc_dtype = self.acc_dtype
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1] + (1,), dtype=acc_dtype, device=q.device)
        for qs, qe in self.query_blocks():
            q_rows = self.rows(q, qs, qe) * self.scale                     # (B, Hkv, R, D)
            stats_shape = q_rows.shape[:-1] + (1,)
            row_max = torch.full(stats_shape, float("-inf"), dtype=acc_dtype, device=q.device)
            denom = torch.zeros(stats_shape, dtype=acc_dtype, device=q.device)
            acc = torch.zeros(q_rows.shape, dtype=acc_dtype, device=q.device)
            for ks, ke in self.key_blocks(qs, qe):
                s = self.scores(q_rows, k[:, :, ks:ke], qs, qe, ks, ke)      # (B, Hkv, R, tk)
                new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
                # Rows that have seen no key yet keep max -inf; shift them by 0 instead.
                shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
                p = s.sub_(shift).exp_()
                rescale = (row_max - shift).exp_()
                denom.mul_(rescale).add_(p.sum(dim=-1, keepdim=True))
                keep = self.keep(p, qs // self.block_q, ks // self.block_k)
                if keep is not None:
                    p.mul_(keep)
                acc.mul_(rescale).add_(p.to(v.dtype) @ v[:, :, ks:ke])
                row_max = new_max
            empty = denom == 0  # rows with no key to attend to: output 0, lse +inf
            acc.div_(denom.masked_fill(empty, 1.0))
            row_lse = (row_max + denom.log()).masked_fill_(empty, float("inf"))
            out[:, :, qs:qe] = self.unrows(acc, qs, qe).to(q.dtype)
            lse[:, :, qs:qe] = self.unrows(row_lse, qs, qe)
        return out, lse

    def backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 grad_out: Tensor, bias_grad: bool = False) -> tuple[Tensor, ...]:
        """-> dq (B, H, T, D), dk, dv (B, Hkv, S, D), dbias (H, T + S - 1) or None."""
        acc_dtype = self.acc_dtype
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        dbias = torch.zeros_like(self.bias) if bias_grad else None
        dq = torch.empty_like(q)
        delta = (grad_out.to(acc_dtype) * out.to(acc_dtype)).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
        for qs, qe in self.query_blocks():
            q_rows = self.rows(q, qs, qe) * self.scale                     # (B, Hkv, R, D)
            do_rows = self.rows(grad_out, qs, qe)
            lse_rows, delta_rows = self.rows(lse, qs, qe), self.rows(delta, qs, qe)
            dq_rows = torch.zeros(q_rows.shape, dtype=acc_dtype, device=q.device)
            for ks, ke in self.key_blocks(qs, qe):
                k_tile, v_tile = k[:, :, ks:ke], v[:, :, ks:ke]
                p = self.scores(q_rows, k_tile, qs, qe, ks, ke).sub_(lse_rows).exp_()
                dp = (do_rows @ v_tile.transpose(-1, -2)).to(acc_dtype)      # (B, Hkv, R, tk)
                keep = self.keep(p, qs // self.block_q, ks // self.block_k)
                dropped = p if keep is None else p * keep
                if keep is not None:
                    dp.mul_(keep)
                dv[:, :, ks:ke] += dropped.transpose(-1, -2).to(v.dtype) @ do_rows
                ds = p.mul_(dp.sub_(delta_rows))                            # (B, Hkv, R, tk)
                if dbias is not None:   # the bias adds to each score: its gradient is dS
                    per_head = ds.sum(0).view(-1, ke - ks)                   # (H * tq, tk)
                    dbias.index_add_(1, self.bias_index(qs, qe, ks, ke).flatten(),
                                     per_head.view(-1, (qe - qs) * (ke - ks)))
                ds = ds.to(q.dtype)
                dq_rows += ds @ k_tile
                dk[:, :, ks:ke] += ds.transpose(-1, -2) @ q_rows
            dq[:, :, qs:qe] = self.unrows(dq_rows * self.scale, qs, qe).to(q.dtype)
        dbias = None if dbias is None else dbias.to(self.bias_dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dbias

