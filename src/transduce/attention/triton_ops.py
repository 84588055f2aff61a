"""impl="triton"'s forward and backward passes as PyTorch operators (torch.library.triton_op).

Why operators, and not an autograd.Function around the launches: torch.compile traces a
Function's backward ahead of time, before it knows the strides of the gradient that
will arrive, and when the backward reads them (a kernel launch needs them) it traces
again with the gradient made contiguous: a copy of every attention output's gradient,
each step, from the layout the output projection's backward writes (token-major) into
(B, H, T, D). An operator's backward is traced where the gradient is made, strides
known, and the kernels read it as it is. Being triton_ops, the compiler still sees the
three kernels themselves and lets them write into buffers of its own.

Loaded on first use by triton_flash.kernels_for (it imports triton).
"""

from __future__ import annotations

import collections

import torch
import triton
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

from transduce.attention import triton_kernels
from transduce.attention.triton_flash import LOG2E, block_width, is_interpreted, unpack_heads

FORWARD = "transduce::triton_attention"
BACKWARD = "transduce::triton_attention_backward"
PACKED_FORWARD = "transduce::triton_packed_attention"
PACKED_BACKWARD = "transduce::triton_packed_attention_backward"
KV_PACKED_FORWARD = "transduce::triton_kv_packed_attention"


@triton_op(FORWARD, mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                      query_numbers: Tensor | None, key_numbers: Tensor | None,
                      bias: Tensor | None, seed: Tensor | None, causal: bool, scale: float,
                      dropout_p: float, tiles: list[int]) -> tuple[Tensor, Tensor]:
    """q (B, H, T, D), k/v (B, Hkv, S, D), mask bool broadcastable to (B, H, T, S),
    query/key_numbers (B, T), (B, S) int32 sentence numbers, bias (H, T + S - 1), seed
    (1,) int64 on q's device (with dropout), tiles [block_m, block_n, num_warps,
    num_stages] -> out (B, H, T, D) in q's dtype, stored token-major (_token_major), and
    lse2 (B, H, T) float32 (kept for the backward)."""
    return _Call(q, k, mask, query_numbers, key_numbers, bias, seed, causal, scale, dropout_p,
                 tiles).forward(q, k, v)


@triton_op(BACKWARD, mutates_args=())
def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse2: Tensor, mask: Tensor | None, query_numbers: Tensor | None,
                       key_numbers: Tensor | None, bias: Tensor | None,
                       seed: Tensor | None, causal: bool, scale: float, dropout_p: float,
                       tiles: list[int], bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """grad_out (B, H, T, D), any strides -> dq (B, H, T, D) in q's dtype, stored
    token-major, dkv (B, S, 2 Hkv, D): dk's heads then dv's, and dbias (H, T + S - 1) in
    the bias's dtype when bias_grad (else an empty tensor: an operator returns tensors,
    and none that share memory, hence dk and dv in one)."""
    call = _Call(q, k, mask, query_numbers, key_numbers, bias, seed, causal, scale,
                 dropout_p, tiles)
    dq = _token_major(q)
    dkv = k.new_empty((call.batch, call.num_keys, 2 * call.kv_heads, call.dim))
    dbias = call.backward(q, k, v, out, lse2, grad_out, dq, dkv, (0, call.kv_heads), bias_grad)
    return dq.transpose(1, 2), dkv, dbias


def _backward(ctx, grad_out: Tensor, grad_lse2: None) -> tuple:
    (q, k, v), common, bias_grad = _saved(ctx)
    dq, dkv, dbias = attention_backward(grad_out, q, k, v, *common, bias_grad)
    dk, dv = dkv.transpose(1, 2).split(k.shape[1], dim=1)
    return _input_grads(ctx, (dq, dk, dv), dbias)


@triton_op(PACKED_FORWARD, mutates_args=())
def packed_forward(qkv: Tensor, heads: int, kv_heads: int, mask: Tensor | None,
                   query_numbers: Tensor | None, key_numbers: Tensor | None,
                   bias: Tensor | None, seed: Tensor | None, causal: bool, scale: float,
                   dropout_p: float, tiles: list[int]) -> tuple[Tensor, Tensor]:
    """Self-attention over a stacked projection's output: qkv (B, T, (H + 2 Hkv) D),
    queries', keys' and values' heads in that order -> as attention_forward. Its
    backward writes the three gradients into one tensor like qkv, which is the stacked
    projection's output gradient: no concatenation after it."""
    return attention_forward(*unpack_heads(qkv, heads, kv_heads, kv_heads), mask,
                             query_numbers, key_numbers, bias, seed, causal, scale, dropout_p,
                             tiles)


@triton_op(PACKED_BACKWARD, mutates_args=())
def packed_backward(grad_out: Tensor, qkv: Tensor, heads: int, kv_heads: int, out: Tensor,
                    lse2: Tensor, mask: Tensor | None, query_numbers: Tensor | None,
                    key_numbers: Tensor | None, bias: Tensor | None, seed: Tensor | None,
                    causal: bool, scale: float, dropout_p: float, tiles: list[int],
                    bias_grad: bool) -> tuple[Tensor, Tensor]:
    """-> dqkv (B, T, (H + 2 Hkv) D) in qkv's dtype, and dbias as attention_backward's."""
    q, k, v = unpack_heads(qkv, heads, kv_heads, kv_heads)
    call = _Call(q, k, mask, query_numbers, key_numbers, bias, seed, causal, scale,
                 dropout_p, tiles)
    dqkv = qkv.new_empty((call.batch, call.num_queries, heads + 2 * kv_heads, call.dim))
    dbias = call.backward(q, k, v, out, lse2, grad_out, dqkv, dqkv, (heads, heads + kv_heads),
                          bias_grad)
    return dqkv.flatten(2), dbias


def _packed_backward(ctx, grad_out: Tensor, grad_lse2: None) -> tuple:
    (qkv,), common, bias_grad = _saved(ctx)
    out, lse2, *rest = common
    dqkv, dbias = packed_backward(grad_out, qkv, *ctx.heads, out, lse2, *rest, bias_grad)
    return _input_grads(ctx, (dqkv,), dbias)


@triton_op(KV_PACKED_FORWARD, mutates_args=())
def kv_packed_forward(q: Tensor, kv: Tensor, kv_heads: int, mask: Tensor | None,
                      query_numbers: Tensor | None, key_numbers: Tensor | None,
                      bias: Tensor | None, seed: Tensor | None, causal: bool, scale: float,
                      dropout_p: float, tiles: list[int]) -> tuple[Tensor, Tensor]:
    """q (B, H, T, D) over a stacked key and value projection's output, kv (B, S, 2 Hkv D)
    (cross-attention's), keys' heads then values' -> as attention_forward. Its backward
    gives kv's gradient as one tensor like kv: attention_backward's dkv as it is."""
    return attention_forward(q, *unpack_heads(kv, kv_heads, kv_heads), mask, query_numbers,
                             key_numbers, bias, seed, causal, scale, dropout_p, tiles)


def _kv_packed_backward(ctx, grad_out: Tensor, grad_lse2: None) -> tuple:
    (q, kv), common, bias_grad = _saved(ctx)
    k, v = unpack_heads(kv, *ctx.heads, *ctx.heads)
    dq, dkv, dbias = attention_backward(grad_out, q, k, v, *common, bias_grad)
    return _input_grads(ctx, (dq, dkv.flatten(2)), dbias)


# Every operator's inputs end in the same nine: mask, query_numbers, key_numbers, bias,
# seed (tensors or None), causal, scale, dropout_p, tiles; before them its own tensors
# and head counts.
COMMON = 9


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    own, common = inputs[:-COMMON], inputs[-COMMON:]
    tensors = [x for x in own if isinstance(x, Tensor)]
    ctx.save_for_backward(*tensors, *output, *common[:5])
    ctx.own_tensors, ctx.heads = len(tensors), [x for x in own if isinstance(x, int)]
    ctx.settings, ctx.bias_input = common[5:], len(own) + 3
    ctx.mark_non_differentiable(output[1])   # lse2
    ctx.set_materialize_grads(False)         # its gradient stays None, never zeros


def _saved(ctx) -> tuple[tuple, tuple, bool]:
    """-> the operator's own tensors; out, lse2, mask, query_numbers, key_numbers, bias,
    seed, causal, scale, dropout_p, tiles; and whether the bias needs a gradient."""
    saved = ctx.saved_tensors
    own, common = saved[:ctx.own_tensors], saved[ctx.own_tensors:]
    bias_grad = common[5] is not None and ctx.needs_input_grad[ctx.bias_input]
    return own, (*common, *ctx.settings), bias_grad


def _input_grads(ctx, tensor_grads: tuple, dbias: Tensor) -> tuple:
    """The gradient of each of the operator's inputs: its own tensors', the bias's."""
    bias_grad = dbias if ctx.needs_input_grad[ctx.bias_input] else None
    return (*tensor_grads, *[None] * len(ctx.heads), None, None, None, bias_grad,
            *[None] * (1 + len(ctx.settings)))


for _operator, _its_backward in ((attention_forward, _backward),
                                 (packed_forward, _packed_backward),
                                 (kv_packed_forward, _kv_packed_backward)):
    _operator.register_autograd(_its_backward, setup_context=_setup_context)


class _Call:
    """One attention call's launch arguments, shared by the forward and backward launches."""

    def __init__(self, q: Tensor, k: Tensor, mask: Tensor | None, query_numbers: Tensor | None,
                 key_numbers: Tensor | None, bias: Tensor | None, seed: Tensor | None,
                 causal: bool, scale: float, dropout_p: float, tiles: list[int]):
        self.batch, self.heads, self.num_queries, self.dim = q.shape
        self.kv_heads, self.num_keys = k.shape[1], k.shape[2]
        self.block_m, self.block_n, num_warps, num_stages = tiles
        target = (self.batch, self.heads, self.num_queries, self.num_keys)
        # Sentence numbers (B, T), (B, S) int32, contiguous, in place of a dense mask.
        self.numbers = None if query_numbers is None else (query_numbers, key_numbers)
        # A bool mask read as bytes; broadcast dimensions get stride 0 and cost no memory.
        self.mask = None if mask is None else mask.expand(target).view(torch.uint8)
        self.bias = None if bias is None else bias.contiguous()             # (H, T + S - 1)
        self.scalars = (self.heads, self.heads // self.kv_heads, self.num_queries,
                        self.num_keys, self.num_keys - self.num_queries)
        self.scale, self.dropout_p, self.seed = scale, dropout_p, seed
        self.constants = dict(
            HEAD_DIM=self.dim, BLOCK_D=block_width(self.dim),
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, CAUSAL=causal,
            HAS_MASK=mask is not None, SEGMENTS=self.numbers is not None,
            DROPOUT=dropout_p > 0, HAS_BIAS=bias is not None,
            # float32 inputs get float32 products (tf32 would miss the reference by 1e-3).
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
        if q.device.type == "cuda":
            self.constants.update(num_warps=num_warps, num_stages=num_stages)

    def _pointers(self, like: Tensor) -> tuple[Tensor, ...]:
        """Mask, QNum, KNum, Bias, Seed as the kernels take them, `like` in place of each
        this call has not (HAS_MASK, SEGMENTS, HAS_BIAS, DROPOUT off: never read)."""
        numbers = self.numbers or (None, None)
        return tuple(like if t is None else t
                     for t in (self.mask, *numbers, self.bias, self.seed))

    def _mask_strides(self) -> tuple[int, ...]:
        return (0, 0, 0, 0) if self.mask is None else self.mask.stride()

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out = _token_major(q)
        lse2 = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        mask, query_numbers, key_numbers, bias, seed = self._pointers(q)
        grid = (triton.cdiv(self.num_queries, self.block_m), self.batch * self.heads)
        _launcher(triton_kernels.forward_kernel, q)[grid](
            q, k, v, mask, query_numbers, key_numbers, bias, out, lse2,
            *q.stride(), *k.stride(), *v.stride(), *self._mask_strides(), *_head_strides(out),
            *self.scalars, self.scale * LOG2E, self.dropout_p, seed, **self.constants)
        return out.transpose(1, 2), lse2

    def backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor,
                 grad_out: Tensor, dq: Tensor, dkv: Tensor, kv_head: tuple[int, int],
                 bias_grad: bool) -> Tensor:
        """Writes dq into heads [0, H) of dq (B, T, *, D), dk and dv into heads from
        kv_head[0] and kv_head[1] of dkv (B, S, *, D) (dq itself for a packed qkv) ->
        dbias (H, T + S - 1) in the bias's dtype when bias_grad, else an empty tensor."""
        delta = (grad_out.float() * out.float()).sum(dim=-1)                  # (B, H, T)
        *pointers, seed = self._pointers(q)                 # mask, numbers, bias; seed
        strides = (*q.stride(), *k.stride(), *v.stride(), *self._mask_strides(),
                   *grad_out.stride())
        scalars = (*self.scalars, self.scale * LOG2E, self.scale, self.dropout_p, seed)
        grid_kv = (triton.cdiv(self.num_keys, self.block_n), self.batch * self.kv_heads)
        _launcher(triton_kernels.dkdv_kernel, q)[grid_kv](
            q, k, v, *pointers, grad_out, lse2, delta, dkv, *strides,
            *_head_strides(dkv), *scalars, *kv_head, **self.constants)
        dbias = torch.zeros(self.bias.shape, dtype=torch.float32, device=q.device) \
            if bias_grad else None
        grid_q = (triton.cdiv(self.num_queries, self.block_m), self.batch * self.heads)
        _launcher(triton_kernels.dq_kernel, q)[grid_q](
            q, k, v, *pointers, grad_out, lse2, delta, dq,
            q if dbias is None else dbias, *strides, *_head_strides(dq), *scalars,
            BIAS_GRAD=bias_grad, **self.constants)
        return q.new_empty(0) if dbias is None else dbias.to(self.bias.dtype)


def _launcher(kernel, like: Tensor):
    """kernel[grid](...) as torch.compile traces it (wrap_triton). In Triton's interpreter
    with fake tensors (shapes only: torch.library.opcheck's tests), nothing to launch."""
    if is_interpreted(kernel) and is_fake(like):
        return collections.defaultdict(lambda: lambda *args, **kwargs: None)
    return wrap_triton(kernel)


def _token_major(like: Tensor) -> Tensor:
    """An empty (B, T, H, D) buffer for a (B, H, T, D) result like `like`: the layout the
    projections write and read, so that merging an output's heads for the output
    projection, or a gradient's on its way back to the q, k, v projections, is a view
    and not a copy. The kernels store through _head_strides and are handed the buffer
    itself, not a view of it: a fresh tensor, which torch.compile can let them write in
    place."""
    batch, heads, tokens, dim = like.shape
    return torch.empty((batch, tokens, heads, dim), dtype=like.dtype, device=like.device)


def _head_strides(buffer: Tensor) -> tuple[int, ...]:
    """A (B, T, H, D) buffer's strides in (B, H, T, D) order."""
    return buffer.transpose(1, 2).stride()
