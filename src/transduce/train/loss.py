"""Label-smoothed cross entropy (Szegedy et al. 2016), as the paper trains with (eps 0.1).

The target distribution puts 1 - eps on the reference token and spreads eps uniformly
over the other tokens of the vocabulary except padding, which is never a target.
Padding positions contribute nothing. A model whose output adds a bias (an imported
Marian model's) may give tokens the bias NEVER_OUTPUT (pad, bos): they are never a
target either, so the spread leaves them out too.

Targets not scored are pad_id's, or IGNORE (-100) where pad is a token the model
must predict: an imported GPT-2 or Llama pads with eos, so its batches mark the
targets to skip with IGNORE and pass pad_id None (no token is left out of the
spread but those the bias never lets out).
"""

from __future__ import annotations

import torch
from torch import Tensor

from transduce.data.masking import IGNORE
from transduce.model.transformer import NEVER_OUTPUT


def scored_targets(target: Tensor, pad_id: int | None) -> Tensor:
    """target (...) -> bool (...): the positions the loss scores (neither pad_id's nor
    IGNORE)."""
    keep = target != IGNORE
    return keep if pad_id is None else keep & (target != pad_id)


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float,
                       pad_id: int | None) -> tuple[Tensor, Tensor]:
    """logits (B, T, V), target (B, T) -> (smoothed loss, plain NLL), each summed over
    the scored target tokens, in float32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)                    # (B, T, V)
    keep = scored_targets(target, pad_id)                                     # (B, T)
    reference = torch.where(keep, target, 0).unsqueeze(-1)                   # (B, T, 1)
    nll = -log_probs.gather(-1, reference).squeeze(-1)                       # (B, T)
    # Mass eps over the tokens that are neither the reference nor padding.
    others = -log_probs.sum(dim=-1) - nll
    if pad_id is not None:
        others = others + log_probs[..., pad_id]
    share = logits.shape[-1] - (1 if pad_id is None else 2)
    smoothed = (1.0 - epsilon) * nll + epsilon / share * others
    return smoothed[keep].sum(), nll[keep].sum()


# Logits per chunk in projected_label_smoothed_nll: 8 MiB of float32, so a chunk and its
# gradient stay in cache (262 rows of an 8k vocabulary). On 4,096 target tokens, forward
# + backward on a 2-core Zen 4: 2.5-3.5x faster than the plain loss under bfloat16
# autocast, 1.2-1.8x in float32.
CHUNK_ELEMENTS = 1 << 21
# On a GPU the loop's cost is kernel launches, not cache misses: chunks of 256 MiB logits.
CHUNK_ELEMENTS_CUDA = 1 << 26


def projected_label_smoothed_nll(hidden: Tensor, weight: Tensor, target: Tensor,
                                 epsilon: float, pad_id: int | None,
                                 chunk_rows: int | None = None,
                                 every_row: bool | None = None,
                                 bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """label_smoothed_nll(hidden @ weight^T + bias, ...) without the (B, T, V) logits.

    hidden (B, T, C) the decoder's output, weight (V, C) and bias (V,) or None the output
    projection, target (B, T) -> (smoothed loss, plain NLL) summed over scored tokens,
    float32; only the smoothed loss carries a gradient. Tokens whose bias is
    NEVER_OUTPUT take no share of the smoothing.

    Why: over an 8k vocabulary the logits, their log-softmax and its gradient are
    several (B*T, V) float32 arrays, each written and read once, and that memory
    traffic cost as much as the model's matrix products on a 2-core CPU. Here the rows
    that are not padding are projected a chunk at a time; each chunk's gradient
    (softmax - q, with q the smoothed target distribution) is formed while the chunk is
    in cache and multiplied straight into the gradients of `hidden` and `weight`. The
    products run in the autocast dtype when autocast is on, as nn.Linear's would.

    every_row (default: while torch.compile captures): project every position and weigh
    padding by zero, instead of selecting the rows that are not padding. Selecting
    gives a shape that depends on the data, which a compiled graph cannot hold (and a
    GPU must report to the host before going on); padding rows cost their share of
    the products. While compiling, the rows are also projected in one piece: a loop
    over chunks would fix the number of rows in the graph (a new graph for every batch
    shape), and the compiler fuses the steps over the (B*T, V) logits itself.
    """
    if every_row is None:
        every_row = torch.compiler.is_compiling()
    keep = scored_targets(target, pad_id)                                     # (B, T)
    if every_row:
        rows, scored = hidden.flatten(0, 1), keep.flatten().float()          # (B*T, C), (B*T,)
        targets = torch.where(keep, target, 0).flatten()                      # (B*T,)
    else:
        rows, targets, scored = hidden[keep], target[keep], None             # (N, C), (N,)
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad))
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else rows.dtype
    elements = CHUNK_ELEMENTS_CUDA if device == "cuda" else CHUNK_ELEMENTS
    chunk = None if torch.compiler.is_compiling() else \
        chunk_rows or max(1, elements // weight.shape[0])
    return _ProjectedSmoothedNLL.apply(rows, weight, bias, targets, scored, epsilon, pad_id,
                                       dtype, chunk, wants_grad)


class _ProjectedSmoothedNLL(torch.autograd.Function):
    """Forward computes the loss and, when asked, both gradients; backward scales them."""

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                scored: Tensor | None, epsilon: float, pad_id: int | None,
                dtype: torch.dtype,
                chunk: int | None, wants_grad: bool) -> tuple[Tensor, Tensor]:
        with torch.autocast(rows.device.type, enabled=False):
            smoothed, nll, grad_rows, grad_weight, grad_bias = _chunked_loss_and_grads(
                rows, weight, bias, target, scored, epsilon, pad_id, dtype, chunk, wants_grad)
        ctx.save_for_backward(grad_rows, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(nll)
        return smoothed, nll

    @staticmethod
    def backward(ctx, grad_smoothed: Tensor, _grad_nll: Tensor):
        grad_rows, grad_weight, grad_bias = ctx.saved_tensors
        bias = None if ctx.bias_dtype is None else (grad_bias * grad_smoothed).to(ctx.bias_dtype)
        return (grad_rows * grad_smoothed.to(grad_rows.dtype),
                (grad_weight * grad_smoothed).to(ctx.weight_dtype), bias,
                None, None, None, None, None, None, None)


def _chunked_loss_and_grads(rows: Tensor, weight: Tensor, bias: Tensor | None,
                            target: Tensor, scored: Tensor | None, epsilon: float,
                            pad_id: int | None, dtype: torch.dtype, chunk: int | None,
                            wants_grad: bool):
    """rows (N, C), weight (V, C), bias (V,) or None, target (N,), scored (N,) 1.0 for
    the rows that count and 0.0 for the rest, or None for all; chunk rows at a time
    (None: all at once) -> smoothed and NLL sums (float32), and d smoothed / d rows
    (N, C), d smoothed / d weight (V, C) and d smoothed / d bias (V,) (empty unless
    wants_grad, and for the bias unless there is one)."""
    # q on each token but the reference and those left out (a tensor with a bias: no
    # host sync, nothing that breaks a compiled graph)
    support = None if bias is None else _smoothing_support(bias, pad_id)     # (V,) or None
    if support is None:    # every token but the reference and pad, if there is one
        spread = epsilon / (weight.shape[0] - (1 if pad_id is None else 2))
    else:
        spread = epsilon / (support.sum() - 1)
    w = weight.to(dtype)
    smoothed = nll = torch.zeros((), dtype=torch.float32, device=rows.device)
    grad_rows, grad_weight, grad_bias = [], None, None
    pieces = [slice(None)] if chunk is None or rows.shape[0] <= chunk else \
        [slice(start, start + chunk) for start in range(0, rows.shape[0], chunk)]
    for piece in pieces:
        h = rows[piece].to(dtype)                                             # (n, C)
        y = target[piece].unsqueeze(1)                                        # (n, 1)
        logits = (h @ w.T).float()                                            # (n, V)
        if bias is not None:
            logits += bias
        log_p = torch.log_softmax(logits, dim=1)                              # (n, V)
        reference = log_p.gather(1, y)                                        # (n, 1)
        # -log p summed over the tokens that are neither the reference nor left out
        if support is None:
            others = -(log_p.sum(1, keepdim=True) - reference)
            if pad_id is not None:
                others += log_p[:, pad_id:pad_id + 1]
        else:
            others = -(log_p @ support[:, None] - reference)
        weights = None if scored is None else scored[piece].unsqueeze(1)
        if weights is not None:
            reference, others = reference * weights, others * weights
        nll = nll - reference.sum()
        smoothed = smoothed + (-(1.0 - epsilon) * reference.sum() + spread * others.sum())
        if wants_grad:
            grad = _logit_gradient(logits, y, epsilon, spread, support, pad_id, dtype)
            if weights is not None:
                grad *= weights                  # by 0 or 1: exact in any dtype
            grad_rows.append((grad @ w).to(rows.dtype))
            # a bfloat16 product is summed in float32
            grad_weight = _summed(grad_weight, grad.T @ h)
            if bias is not None:
                grad_bias = _summed(grad_bias, grad.sum(0, dtype=torch.float32))
    nothing = weight.new_empty(0, dtype=torch.float32)
    if not wants_grad:
        return smoothed, nll, rows.new_empty(0), nothing, nothing
    grad_rows = grad_rows[0] if len(grad_rows) == 1 else torch.cat(grad_rows)
    return smoothed, nll, grad_rows, grad_weight, nothing if grad_bias is None else grad_bias


def _summed(total: Tensor | None, piece: Tensor) -> Tensor:
    """total + piece in float32, the first piece taken as it is. The gradients are built
    without writing into tensors made for them beforehand: torch 2.11's compiler
    saved such a tensor for the backward pass as it was before the writes (zeros), and
    a compiled step trained nothing."""
    return piece.float() if total is None else total.add_(piece)


def _logit_gradient(logits: Tensor, y: Tensor, epsilon: float, spread: float | Tensor,
                    support: Tensor | None, pad_id: int | None,
                    dtype: torch.dtype) -> Tensor:
    """d loss / d logits = softmax - q, rounded to `dtype` once: logits (n, V) float32,
    y (n, 1) the references -> (n, V). q is 1 - epsilon on the reference, `spread` on
    the other tokens of `support` (None: every token but pad, if there is one), 0
    elsewhere."""
    p = torch.softmax(logits, dim=1)
    p.scatter_add_(1, y, torch.as_tensor(spread - (1.0 - epsilon), dtype=p.dtype,
                                         device=p.device).expand(y.shape))
    if support is None and pad_id is not None:
        p[:, pad_id] += spread
    q = spread if support is None else spread * support     # all alike, or (V,)
    return torch.sub(p, q, out=torch.empty(p.shape, dtype=dtype, device=p.device))


def _smoothing_support(bias: Tensor, pad_id: int | None) -> Tensor:
    """(V,) float32: 1 for the tokens smoothing spreads over (any but pad and those the
    bias never lets out), 0 for the rest."""
    support = (bias.detach() > NEVER_OUTPUT).float()
    if pad_id is not None:
        support[pad_id] = 0.0
    return support
