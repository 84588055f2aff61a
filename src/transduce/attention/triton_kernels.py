"""FlashAttention forward and backward as Triton kernels (loaded by triton_flash.py).

One program instance owns one tile of rows and walks the other axis tile by tile, so the
(T, S) score matrix never leaves on-chip memory:

    forward   one query block of one head; online softmax over the key tiles (as in
              flash.py), writes O and the row statistic lse2 = m + log2(l).
    dkdv      one key/value block of one key/value head; walks the query tiles of every
              query head in its group (GQA without copying heads, and without atomics),
              recomputing p = exp2(s - lse2):  dV += p^T dO,  dK += dS^T Q.
    dq        one query block of one head; walks the key tiles:  dQ += dS K,
              with dS = p * (dO V^T - Delta) and Delta = rowsum(dO * O); a position
              bias's gradient is dS summed by distance (atomic adds).

Scores are kept in base 2 (the scale is multiplied by log2(e)) so the exponentials are
exp2. Masks: keys past S, the boolean mask (broadcast dimensions have stride 0) or a
packed batch's sentence numbers (SEGMENTS, below), and the causal rule "key j is visible
to query i when j <= i + S - T". A row that sees no key gets output 0 and lse2 = +inf, so
its gradients are 0 too. Dropout draws a keep mask from Philox at offset
((b * H + h) * T + i) * S + j, the same in all three kernels.

SEGMENTS: a packed row holds many sentences, and a query sees only its own sentence's
keys. Given as a dense mask, every tile of the (T, S) square would be read and computed,
though most are wholly masked; given as each token's sentence number (QNum (B, T), KNum
(B, S) int32, contiguous; "query i sees key j" is QNum[i] == KNum[j]), a kernel finds
where its block's sentences lie along the other axis (numbers never decrease along a
row) and walks only those tiles: other sentences' keys and values are never loaded.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_scores(q, k_ptrs, mask_ptrs, q_nums, k_nums, bias_row, offs_m, offs_n, T, S,
                 offset, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, SEGMENTS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled (base-2) scores of one tile, -inf where a key may not be attended: (M, N).
    q_nums, k_nums: pointers to the sentence numbers of the tile's queries (M,) and keys (N,).
    bias_row: this head's position-bias vector (T + S - 1,), read at t - s + S - 1."""
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(k_ptrs, mask=(offs_n[:, None] < S) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if HAS_BIAS:
        inside = (offs_m[:, None] < T) & (offs_n[None, :] < S)
        bias = tl.load(bias_row + offs_m[:, None] - offs_n[None, :] + S - 1, mask=inside, other=0.0)
        s += bias.to(tl.float32) * 1.4426950408889634   # log2(e): scores are in base 2
    visible = offs_n[None, :] < S
    if HAS_MASK:
        allowed = tl.load(mask_ptrs, mask=(offs_m[:, None] < T) & visible, other=0)
        visible = visible & (allowed != 0)
    if SEGMENTS:
        query_sentence = tl.load(q_nums, mask=offs_m < T, other=-1)
        key_sentence = tl.load(k_nums, mask=offs_n < S, other=-2)
        visible = visible & (query_sentence[:, None] == key_sentence[None, :])
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + offset)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _float32(x):
    """A float argument as float32. Triton types a Python float as float32 when it
    launches a kernel itself, but torch.compile's launcher passes it as float64, which
    would turn every score computed from it into float64 (and the forward kernel's loop
    state with it, which Triton refuses)."""
    return tl.cast(x, tl.float32)


@triton.jit
def _seed(Seed, DROPOUT: tl.constexpr):
    """The dropout's seed, read from the device (an int64 drawn there: the host never
    waits for it, and a CUDA graph replays the draw); 0 and no load without dropout."""
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    return seed


@triton.jit
def _dropout_keep(seed, bh, offs_m, offs_n, T, S, dropout_p):
    """Keep mask of one tile, drawn from the seed at a position-dependent offset: (M, N)."""
    rows = (bh * T + offs_m).to(tl.int64)
    return tl.rand(seed, rows[:, None] * S + offs_n[None, :]) >= dropout_p


@triton.jit
def _same_sentences(own_row, own_first, own_last, other_row, length, BLOCK: tl.constexpr):
    """The stretch of the other side's row that holds a block's sentences: -> (first, end),
    first rounded down to a BLOCK tile. own_row, other_row: the sentence numbers of one
    batch row on the block's side and on the other (length long); own_first, own_last: the
    block's first and last positions. Numbers never decrease along a row, so before first
    they are lower than the block's and from end on higher: other sentences only. One pass
    over the other side's numbers, 4 bytes a position against the keys and values skipped."""
    low = tl.load(own_row + own_first)
    high = tl.load(own_row + own_last)
    first = 0
    end = 0
    for start in range(0, length, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < length
        nums = tl.load(other_row + offs, mask=inside, other=0)
        first += tl.sum((inside & (nums < low)).to(tl.int32), 0)
        end += tl.sum((inside & (nums <= high)).to(tl.int32), 0)
    return first // BLOCK * BLOCK, end


@triton.jit
def _forward_tile(acc, denom, row_max, q, k_base, v_base, mask_base, q_nums, k_num_row,
                  bias_row, start, offs_m, offs_n, svs, sks, sms, T, S, offset, qk_scale,
                  dropout_p, seed, bh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, SEGMENTS: tl.constexpr,
                  DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the online softmax: -> (acc, denom, row_max) updated."""
    cols = start + offs_n
    offs_d = tl.arange(0, BLOCK_D)
    s = _tile_scores(q, k_base + cols[:, None] * sks, mask_base + cols[None, :] * sms, q_nums,
                     k_num_row + cols, bias_row, offs_m, cols, T, S, offset, qk_scale,
                     HEAD_DIM, BLOCK_D, CAUSAL, HAS_MASK, SEGMENTS, HAS_BIAS, PRECISION)
    new_max = tl.maximum(row_max, tl.max(s, 1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that saw no key yet
    p = tl.math.exp2(s - shift[:, None])
    rescale = tl.math.exp2(row_max - shift)
    denom = denom * rescale + tl.sum(p, 1)
    if DROPOUT:
        keep = _dropout_keep(seed, bh, offs_m, cols, T, S, dropout_p)
        p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
    v = tl.load(v_base + cols[:, None] * svs,
                mask=(cols[:, None] < S) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, denom, new_max


@triton.jit
def forward_kernel(Q, K, V, Mask, QNum, KNum, Bias, Out, Lse,
                   sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                   smb, smh, smt, sms, sob, soh, sot, sod,
                   H, GROUP, T, S, offset, qk_scale, dropout_p, Seed,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                   SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PRECISION: tl.constexpr):
    """grid (cdiv(T, BLOCK_M), B * H): O (B, H, T, D) and lse2 (B, H, T) of one query block.
    Bias: the position bias (H, T + S - 1), contiguous. Causal blocks run last rows first
    (they have the most keys), so the short ones fill the tail of the launch. SEGMENTS:
    only the key tiles of the block's own sentences are walked."""
    qk_scale, dropout_p = _float32(qk_scale), _float32(dropout_p)
    seed = _seed(Seed, DROPOUT)
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    b, h = bh // H, bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b * skb + hk * skh + offs_d[None, :] * skd
    v_base = V + b * svb + hk * svh + offs_d[None, :] * svd
    mask_base = Mask + b * smb + h * smh + offs_m[:, None] * smt
    q_num_row, k_num_row = QNum + b * T, KNum + b * S

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first = 0
    end = S
    if SEGMENTS:
        first, end = _same_sentences(q_num_row, pid_m * BLOCK_M,
                                     tl.minimum(T, (pid_m + 1) * BLOCK_M) - 1, k_num_row, S,
                                     BLOCK_N)
    below = first   # key tiles every row of the block sees whole: no causal test needed
    if CAUSAL:
        end = tl.minimum(end, (pid_m + 1) * BLOCK_M + offset)
        below = tl.maximum(pid_m * BLOCK_M + offset + 1, 0) // BLOCK_N * BLOCK_N
        below = tl.maximum(tl.minimum(below, end), first)
    for start in range(first, below, BLOCK_N):
        acc, denom, row_max = _forward_tile(
            acc, denom, row_max, q, k_base, v_base, mask_base, q_num_row + offs_m, k_num_row,
            Bias + h * (T + S - 1), start, offs_m, offs_n, svs, sks, sms, T, S, offset,
            qk_scale, dropout_p, seed, bh,
            HEAD_DIM, BLOCK_D, False, HAS_MASK, SEGMENTS, DROPOUT, HAS_BIAS, PRECISION)
    for start in range(below, end, BLOCK_N):
        acc, denom, row_max = _forward_tile(
            acc, denom, row_max, q, k_base, v_base, mask_base, q_num_row + offs_m, k_num_row,
            Bias + h * (T + S - 1), start, offs_m, offs_n, svs, sks, sms, T, S, offset,
            qk_scale, dropout_p, seed, bh,
            HEAD_DIM, BLOCK_D, CAUSAL, HAS_MASK, SEGMENTS, DROPOUT, HAS_BIAS, PRECISION)

    empty = denom == 0.0
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    lse2 = tl.where(empty, float("inf"), row_max + tl.math.log2(tl.where(empty, 1.0, denom)))
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(Lse + bh * T + offs_m, lse2, mask=row_ok)


@triton.jit
def dkdv_kernel(Q, K, V, Mask, QNum, KNum, Bias, DO, Lse, Delta, DKV,
                sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                smb, smh, smt, sms, sdob, sdoh, sdot, sdod, sgb, sgh, sgt, sgd,
                H, GROUP, T, S, offset, qk_scale, scale, dropout_p, Seed, k_head, v_head,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr,
                PRECISION: tl.constexpr):
    """grid (cdiv(S, BLOCK_N), B * Hkv): dK, dV (B, Hkv, S, D) of one key block, summed
    over the GROUP query heads that share it, stored into one buffer DKV, strides sg*,
    from head k_head and v_head on (one pointer: torch.compile lets a kernel write a
    fresh buffer in place, but copies one it is handed twice). SEGMENTS: only the query
    tiles of the block's own sentences are walked."""
    qk_scale, scale, dropout_p = _float32(qk_scale), _float32(scale), _float32(dropout_p)
    seed = _seed(Seed, DROPOUT)
    pid_n, bhk = tl.program_id(0), tl.program_id(1)
    kv_heads = H // GROUP
    b, hk = bhk // kv_heads, bhk % kv_heads
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = (offs_n[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    k_ptrs = K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :] * skd
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :] * svd,
                mask=col_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    q_num_row, k_num_row = QNum + b * T, KNum + b * S
    first = 0
    end = T
    if SEGMENTS:
        first, end = _same_sentences(k_num_row, start_n, tl.minimum(S, start_n + BLOCK_N) - 1,
                                     q_num_row, T, BLOCK_M)
    if CAUSAL:  # queries before start_n - offset see none of these keys
        first = tl.maximum(first, tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        for start_m in range(first, end, BLOCK_M):
            offs_m = start_m + offs_m0
            row_ok = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                        mask=row_ok, other=0.0)
            do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdot + offs_d[None, :] * sdod,
                         mask=row_ok, other=0.0)
            lse2 = tl.load(Lse + bh * T + offs_m, mask=offs_m < T, other=float("inf"))
            delta = tl.load(Delta + bh * T + offs_m, mask=offs_m < T, other=0.0)
            s = _tile_scores(q, k_ptrs, Mask + b * smb + h * smh + offs_m[:, None] * smt
                             + offs_n[None, :] * sms, q_num_row + offs_m, k_num_row + offs_n,
                             Bias + h * (T + S - 1), offs_m, offs_n, T, S, offset, qk_scale,
                             HEAD_DIM, BLOCK_D, CAUSAL, HAS_MASK, SEGMENTS, HAS_BIAS, PRECISION)
            p = tl.math.exp2(s - lse2[:, None])                              # (M, N)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)          # (M, N)
            dropped = p
            if DROPOUT:
                keep = _dropout_keep(seed, bh, offs_m, offs_n, T, S, dropout_p)
                dropped = tl.where(keep, p / (1.0 - dropout_p), 0.0)
                dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
            dv += tl.dot(tl.trans(dropped.to(do.dtype)), do, input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out_ptrs = DKV + b * sgb + hk * sgh + offs_n[:, None] * sgt + offs_d[None, :] * sgd
    tl.store(out_ptrs + k_head * sgh, (dk * scale).to(DKV.dtype.element_ty), mask=col_ok)
    tl.store(out_ptrs + v_head * sgh, dv.to(DKV.dtype.element_ty), mask=col_ok)


@triton.jit
def dq_kernel(Q, K, V, Mask, QNum, KNum, Bias, DO, Lse, Delta, DQ, DBias,
              sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
              smb, smh, smt, sms, sdob, sdoh, sdot, sdod, sgb, sgh, sgt, sgd,
              H, GROUP, T, S, offset, qk_scale, scale, dropout_p, Seed,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
              SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr,
              PRECISION: tl.constexpr, BIAS_GRAD: tl.constexpr):
    """grid (cdiv(T, BLOCK_M), B * H): dQ (B, H, T, D) of one query block; DQ's strides sg*.
    BIAS_GRAD: also adds each score's dS into DBias (H, T + S - 1, float32) at its distance.
    SEGMENTS: only the key tiles of the block's own sentences are walked."""
    qk_scale, scale, dropout_p = _float32(qk_scale), _float32(scale), _float32(dropout_p)
    seed = _seed(Seed, DROPOUT)
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdot + offs_d[None, :] * sdod,
                 mask=row_ok, other=0.0)
    lse2 = tl.load(Lse + bh * T + offs_m, mask=offs_m < T, other=float("inf"))
    delta = tl.load(Delta + bh * T + offs_m, mask=offs_m < T, other=0.0)
    k_base = K + b * skb + hk * skh + offs_d[None, :] * skd
    v_base = V + b * svb + hk * svh + offs_d[None, :] * svd
    mask_base = Mask + b * smb + h * smh + offs_m[:, None] * smt
    q_num_row, k_num_row = QNum + b * T, KNum + b * S
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first = 0
    end = S
    if SEGMENTS:
        first, end = _same_sentences(q_num_row, pid_m * BLOCK_M,
                                     tl.minimum(T, (pid_m + 1) * BLOCK_M) - 1, k_num_row, S,
                                     BLOCK_N)
    if CAUSAL:
        end = tl.minimum(end, (pid_m + 1) * BLOCK_M + offset)
    for start in range(first, end, BLOCK_N):
        cols = start + offs_n0
        k_ptrs = k_base + cols[:, None] * sks
        s = _tile_scores(q, k_ptrs, mask_base + cols[None, :] * sms, q_num_row + offs_m,
                         k_num_row + cols, Bias + h * (T + S - 1), offs_m, cols, T, S, offset,
                         qk_scale, HEAD_DIM, BLOCK_D, CAUSAL, HAS_MASK, SEGMENTS, HAS_BIAS,
                         PRECISION)
        p = tl.math.exp2(s - lse2[:, None])
        v = tl.load(v_base + cols[:, None] * svs,
                    mask=(cols[:, None] < S) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m, cols, T, S, dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        if BIAS_GRAD:
            inside = (offs_m[:, None] < T) & (cols[None, :] < S)
            tl.atomic_add(DBias + h * (T + S - 1) + offs_m[:, None] - cols[None, :] + S - 1,
                          ds, mask=inside)
        k = tl.load(k_ptrs, mask=(cols[:, None] < S) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + b * sgb + h * sgh + offs_m[:, None] * sgt + offs_d[None, :] * sgd,
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok)


@triton.jit
def keep_mask_kernel(Keep, H, T, S, dropout_p, Seed,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """grid (cdiv(T, BLOCK_M), cdiv(S, BLOCK_N), B * H): the dropout keep mask the attention
    kernels draw, written out (B, H, T, S) int8, so tests can build the reference."""
    dropout_p = _float32(dropout_p)
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(tl.load(Seed), bh, offs_m, offs_n, T, S, dropout_p)
    tl.store(Keep + (bh * T + offs_m[:, None]).to(tl.int64) * S + offs_n[None, :],
             keep.to(tl.int8), mask=(offs_m[:, None] < T) & (offs_n[None, :] < S))
