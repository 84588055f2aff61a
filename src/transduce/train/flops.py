"""Model FLOPs per training step and the machine's matmul peak, for MFU.

MFU = achieved model FLOP/s / peak matmul FLOP/s of the dtype used. Model FLOPs count
the matrix products of a forward pass (2 per multiply-add) three times for forward +
backward, attention scores included; element-wise work is not counted, as is usual.
"""

from __future__ import annotations

import functools
import statistics
import time

import numpy
import torch

from transduce.attention.disentangled import rows_reached
from transduce.config import ModelConfig


def ffn_weights(config: ModelConfig) -> int:
    """Weights of one feed-forward network: 2 * d_model * d_ff, 3 * when gated (W1, W3,
    W2). Each is a multiply-add per token."""
    return (3 if config.gated_ffn else 2) * config.d_model * config.d_ff


def attention_widths(config: ModelConfig) -> tuple[int, int]:
    """The widths of the queries (all heads: d_model unless head_size says otherwise)
    and of the decoder's keys and values (its key/value heads)."""
    return config.num_heads * config.head_dim, config.kv_heads * config.head_dim


def forward_flops(config: ModelConfig, batch_size: int, src_len: int, tgt_len: int) -> float:
    """Matmul FLOPs of one forward pass over a padded (B, S) / (B, T) batch (a
    decoder-only model has no source: src_len is ignored)."""
    if config.arch == "decoder":
        return _decoder_only_forward_flops(config, batch_size, tgt_len)
    if config.arch == "encoder":
        return _encoder_only_forward_flops(config, batch_size, src_len)
    if config.arch != "transformer":
        return _rnn_forward_flops(config, batch_size, src_len, tgt_len)
    d, q, kv, ffn = config.d_model, *attention_widths(config), ffn_weights(config)
    src_tokens, tgt_tokens = batch_size * src_len, batch_size * tgt_len
    encoder = config.num_encoder_layers * (
        src_tokens * (4 * d * q + ffn)                 # projections, FFN
        + 2 * batch_size * src_len * src_len * q)               # QK^T and AV
    decoder = config.num_decoder_layers * (
        tgt_tokens * (2 * d * q + 2 * d * kv + ffn)     # self q, o, k, v; FFN
        + tgt_tokens * 2 * d * q + src_tokens * 2 * d * kv     # cross q, o; k, v per source
        + 2 * batch_size * tgt_len * tgt_len * q               # causal self-attention
        + 2 * batch_size * tgt_len * src_len * q)              # cross-attention
    output = tgt_tokens * d * config.tgt_vocab_size
    return 2.0 * (encoder + decoder + output)


def _decoder_only_forward_flops(config: ModelConfig, batch_size: int, tgt_len: int) -> float:
    """GPT: the decoder's layers without cross-attention (self-attention projections,
    causal QK^T and AV over the full T x T square, as above, or a sliding layer's band;
    FFN), and the output."""
    d, q, kv, ffn = config.d_model, *attention_widths(config), ffn_weights(config)
    tokens = batch_size * tgt_len
    keys = sum(_keys_per_query(config, layer, tgt_len)
               for layer in range(config.num_decoder_layers))
    layers = config.num_decoder_layers * tokens * (2 * d * q + 2 * d * kv + ffn) \
        + 2 * tokens * keys * q                                 # QK^T and AV
    output = tokens * d * config.tgt_vocab_size
    return 2.0 * (layers + output)


def _keys_per_query(config: ModelConfig, layer: int, length, *, causal: bool = True):
    """The keys whose scores count for each query of layer `layer`: the whole length
    (the causal square, as counted above), or for a sliding layer the window before the
    query and itself (and after it, bidirectional: an encoder's), where the length is
    longer: a sliding model's scores grow as T, not T^2, and counting the square would
    raise its MFU above what it does. length: an int or an array of them."""
    if config.layer_attention_type(layer) != "sliding":
        return length
    return numpy.minimum(length, (1 if causal else 2) * config.attention_window + 1)


def _encoder_only_forward_flops(config: ModelConfig, batch_size: int, src_len: int) -> float:
    """BERT: the embeddings' projection where they are narrower (ELECTRA-small's), the
    encoder's layers over (B, S) (projections, FFN, QK^T and AV over every key, or a
    sliding layer's band: ModernBERT's; DeBERTa's position terms), the pooler; the MLM
    head runs on the masked positions only and is not counted."""
    d, q, ffn = config.d_model, attention_widths(config)[0], ffn_weights(config)
    tokens = batch_size * src_len
    keys = sum(_keys_per_query(config, layer, src_len, causal=False)
               for layer in range(config.num_encoder_layers))
    layers = config.num_encoder_layers * tokens * (4 * d * q + ffn) + 2 * tokens * keys * q
    projection = tokens * config.embedding_width * d if config.embedding_size else 0
    return 2.0 * (projection + layers + _disentangled(config, batch_size, src_len)
                  + batch_size * d * d)


def _disentangled(config: ModelConfig, batch_size: int, src_len):
    """DeBERTa's position terms in every layer: the rows of its table a pass reaches
    (attention/disentangled.py; a compiled step reads all 2k) through the query and key
    projections, and each token's query and key against them."""
    if config.positional != "disentangled":
        return 0
    rows = rows_reached(src_len, config.position_buckets, config.relative_reach)
    q = attention_widths(config)[0]
    return config.num_encoder_layers * 2 * rows * q * (config.d_model + batch_size * src_len)


def _rnn_forward_flops(config: ModelConfig, batch_size: int, src_len: int, tgt_len: int) -> float:
    """The RNN encoder-decoders of model/rnn.py: gate matmuls of every layer and
    direction, attention (key and query projections, scores, context), readout, output.
    Luong's dot score projects nothing; input feeding widens the decoder's input."""
    d, gates = config.d_model, 3 if config.rnn_cell == "gru" else 4
    src_tokens, tgt_tokens = batch_size * src_len, batch_size * tgt_len
    additive = config.arch == "rnn-bahdanau"
    half = d // 2
    encoder = src_tokens * 2 * gates * (d * half + half * half) * config.num_encoder_layers
    first_input = 2 * d if additive or config.input_feeding else d
    decoder = tgt_tokens * gates * ((first_input * d + d * d)
                                    + (config.num_decoder_layers - 1) * 2 * d * d)
    key_projection = 0 if config.luong_score == "dot" and not additive else src_tokens * d * d
    attention = key_projection + 2 * batch_size * tgt_len * src_len * d \
        + (tgt_tokens * d * d if additive else 0)
    readout = tgt_tokens * (3 if additive else 2) * d * d
    output = tgt_tokens * d * config.tgt_vocab_size
    return 2.0 * (encoder + decoder + attention + readout + output)


def training_flops(config: ModelConfig, batch_size: int, src_len: int, tgt_len: int, *,
                   weight_gradients: bool = True) -> float:
    """The forward pass, and a backward pass of twice its products; without
    weight_gradients (LoRA: frozen weights, adapters of negligible size) of as many."""
    return (3.0 if weight_gradients else 2.0) * forward_flops(config, batch_size, src_len,
                                                              tgt_len)


def batch_training_flops(config: ModelConfig, batch, *, weight_gradients: bool = True) -> float:
    """A data/batching.py Batch's training FLOPs: its padded shape's, or for packed rows
    the sum over its pairs, each counted alone (its attention stays inside the pair)."""
    if batch.segments is None:
        return training_flops(config, *batch.src.shape, batch.tgt_in.shape[1],
                              weight_gradients=weight_gradients)
    src, tgt = batch.src_lengths.cpu().numpy(), batch.tgt_lengths.cpu().numpy()
    flops = training_flops(config, 1, src, tgt, weight_gradients=weight_gradients)
    return float(flops.sum())   # polynomial: one pass over arrays


def matmul_peak(dtype: torch.dtype, device: torch.device | str = "cpu", size: int | None = None,
                seconds: float = 0.5) -> float:
    """Measured FLOP/s of a square matmul in `dtype`: the median of a short run. The
    default size is 2048 on a CPU and 8192 on a GPU, where 2048 leaves an H100 at 60% of
    what it reaches (397 against 660 TFLOP/s in bfloat16), so MFU would read high. A CPU
    that multiplies in `dtype` slowly gets a smaller size (_cpu_size)."""
    cuda = torch.device(device).type == "cuda"
    a, b = peak_operands(dtype, device, size, seconds)
    size = a.shape[0]
    a @ b  # warm-up
    rates, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 3:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        rates.append(2 * size ** 3 / (time.perf_counter() - start))
    return statistics.median(rates)


def process_peak(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """matmul_peak at its default size, measured once per process for each dtype, device
    and thread count: a process that trains several models (a sweep, a notebook, a test
    suite) pays the second it takes on a CPU thread once, not once a run."""
    return _process_peak(dtype, str(torch.device(device)), torch.get_num_threads())


@functools.cache
def _process_peak(dtype: torch.dtype, device: str, threads: int) -> float:
    return matmul_peak(dtype, device)


def peak_operands(dtype: torch.dtype, device: torch.device | str, size: int | None = None,
                  seconds: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """The two square matrices matmul_peak multiplies: `size` wide, else 8192 on a GPU
    and on a CPU 2048 or what fits `seconds` (_cpu_size)."""
    if size is None:
        size = 8192 if torch.device(device).type == "cuda" else _cpu_size(dtype, seconds)
    return _operands(size, dtype, device)


def _operands(size: int, dtype: torch.dtype, device: torch.device | str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)  # leaves the training RNG untouched
    return tuple(torch.randn(size, size, generator=generator).to(device, dtype)
                 for _ in range(2))


def _cpu_size(dtype: torch.dtype, seconds: float, largest: int = 2048, probe: int = 256) -> int:
    """2048, unless a product that size would take longer than `seconds`: then the largest
    multiple of 128 (at least 256) whose product takes a quarter of it, by a probe's pace.
    A CPU without bfloat16 units multiplies bfloat16 some 30x slower than float32 (an
    AVX2 EPYC: 26 ms for 256 x 256, so 13 s a product of 2048, and four at the least)."""
    a, b = _operands(probe, dtype, "cpu")
    a @ b
    start = time.perf_counter()
    a @ b
    probe_seconds = max(time.perf_counter() - start, 1e-9)
    if probe_seconds * (largest / probe) ** 3 <= seconds:
        return largest
    fitting = probe * (seconds / 4 / probe_seconds) ** (1 / 3)
    return int(min(largest, max(probe, fitting // 128 * 128)))
