"""DeBERTa's disentangled attention: the buckets are DeBERTa's, the attention of a layer
equals the formula written in float64 with each score's three terms looked up directly
(forward and gradients, padding, length 1, distances past the table), the naive and SDPA
kernels agree, per-token positions equal the default ones, and the kernels' dense score
bias is added as written and refused where it cannot be."""

import math

import numpy as np
import pytest
import torch

from tests.attention.test_kernels import make_inputs
from transduce.attention import attention
from transduce.attention.disentangled import DisentangledPositions, log_buckets, \
    rows_reached
from transduce.attention.multihead import MultiHeadAttention

transformers_deberta = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")


@pytest.mark.parametrize("buckets, max_distance", [(256, 512), (8, 20), (16, 64), (4, 6)])
def test_the_buckets_are_debertas(buckets, max_distance):
    distance = torch.arange(-1200, 1201)[:, None]
    expected = transformers_deberta.make_log_bucket_position(distance, buckets, max_distance)
    found = log_buckets(distance, buckets, max_distance)
    assert found.dtype == torch.long
    assert torch.equal(found, expected.long())


def deberta_index(length, buckets, max_distance):
    """Each score's row of the whole table, as DeBERTa computes it: (T, T)."""
    where = torch.arange(length)
    distance = transformers_deberta.make_log_bucket_position(
        where[:, None] - where[None, :], buckets, max_distance).long()
    return (distance + buckets).clamp(0, 2 * buckets - 1)


def reference(x, attn, positions, mask):
    """The layer's attention in float64 over the whole table and DeBERTa's index: each
    score's content-to-position and position-to-content terms looked up directly, no
    gather: x (B, T, C) -> (B, T, C), weights (B, H, T, T)."""
    def project(linear, inputs):
        return inputs @ linear.weight.double().T + linear.bias.double()

    H, D = attn.num_heads, attn.head_dim
    table = positions.norm(positions.embedding.weight).double()
    x = x.double()
    B, T, _ = x.shape
    index = deberta_index(T, positions.buckets, positions.max_distance)
    q, k, v = (project(p, x).view(B, T, H, D).transpose(1, 2)
               for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    query_table = project(attn.q_proj, table).view(-1, H, D).transpose(0, 1)   # (H, 2k, D)
    key_table = project(attn.k_proj, table).view(-1, H, D).transpose(0, 1)
    rows = key_table[:, index]                                                  # (H, T, S, D)
    scores = (q @ k.transpose(-1, -2)
              + torch.einsum("bhid,hijd->bhij", q, rows)
              + torch.einsum("bhjd,hijd->bhij", k, query_table[:, index])) / math.sqrt(3 * D)
    allowed = mask.expand(B, H, T, T)
    has_key = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, -math.inf).masked_fill(~has_key, 0.0)
    weights = torch.softmax(scores, -1).masked_fill(~has_key, 0.0)
    out = (weights @ v).transpose(1, 2).reshape(B, T, H * D)
    return project(attn.out_proj, out), weights


def layer_and_positions(buckets=8, max_distance=12, dtype=torch.float64):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, impl="naive").to(dtype)
    positions = DisentangledPositions(16, buckets, max_distance,
                                      torch.nn.LayerNorm(16)).to(dtype)
    with torch.no_grad():
        for parameter in list(attn.parameters()) + list(positions.parameters()):
            parameter.normal_(0, 0.5)
    return attn, positions


@pytest.mark.parametrize("impl", ["naive", "sdpa"])
@pytest.mark.parametrize("lengths", [(30, 17, 9), (1,), (5, 1)])
def test_a_layer_is_the_float64_formula_forward_and_backward(impl, lengths):
    """Rows longer than the table's reach (buckets 8, up to 12: distances to 29 share the
    last bucket), padded, and of one token (whose pass reads one row of the table); the
    weights as the attention recorder reads them (return_weights)."""
    attn, positions = layer_and_positions()
    attn.impl = impl
    T = max(lengths)
    x = torch.randn(len(lengths), T, 16, dtype=torch.float64, requires_grad=True)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None])[:, None, None, :]
    out, weights = attn(x, mask, relative=positions(T), return_weights=True)
    expected, expected_weights = reference(x, attn, positions, mask)
    real = mask[:, 0, 0]
    torch.testing.assert_close(out[real], expected[real], rtol=0, atol=1e-10)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-12)
    parameters = [x, attn.q_proj.weight, attn.k_proj.bias, positions.embedding.weight]
    got = torch.autograd.grad(out[real].sum(), parameters, retain_graph=True)
    want = torch.autograd.grad(expected[real].sum(), parameters)
    for found, reference_grad in zip(got, want):
        torch.testing.assert_close(found, reference_grad, rtol=0, atol=1e-9)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
def test_a_pass_reads_the_rows_of_the_table_it_reaches():
    """2T - 1 rows for T tokens within the exact buckets (4 each side of 8), all 16 past
    the table's reach; traced (an ONNX export), as many as the input's length reaches."""
    _, positions = layer_and_positions()
    assert [positions(n).table.shape[0] for n in (1, 3, 5, 30)] == [1, 5, 9, 16]
    assert [rows_reached(n, 8, 12) for n in (1, 3, 5, 30)] == [1, 5, 9, 16]
    assert rows_reached(np.array([1, 30]), 8, 12).tolist() == [1, 16]
    sliced = positions(3)
    assert torch.equal(sliced.table, positions.norm(positions.embedding.weight)[6:11])
    assert torch.equal(sliced.index, deberta_index(3, 8, 12) - 6)
    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.positions = positions

        def forward(self, x):
            return self.positions(x.shape[0]).table

    traced = torch.jit.trace(Table(), torch.zeros(3), check_trace=False)
    assert [traced(torch.zeros(n)).shape[0] for n in (1, 3, 5, 30)] == [1, 5, 9, 16]
    torch.testing.assert_close(traced(torch.zeros(5)), positions(5).table)


def test_each_token_s_own_positions_equal_the_default_ones():
    """Packed rows pass each token's position (B, T); consecutive ones from 0 give the
    default pass, and a row restarted at 0 equals that row alone."""
    attn, positions = layer_and_positions(dtype=torch.float32)
    x = torch.randn(2, 11, 16)
    consecutive = torch.arange(11).expand(2, 11)
    torch.testing.assert_close(attn(x, None, relative=positions(11, consecutive)),
                               attn(x, None, relative=positions(11)))
    restarted = torch.cat([torch.arange(6), torch.arange(5)])[None]        # two segments
    segments = (torch.arange(11) >= 6).long()
    same = (segments[:, None] == segments[None, :])[None, None]
    packed = attn(x[:1], same, relative=positions(11, restarted))
    alone = attn(x[:1, 6:], None, relative=positions(5))
    torch.testing.assert_close(packed[:, 6:], alone, rtol=1e-5, atol=1e-6)


def test_a_cache_is_refused_by_name():
    attn, positions = layer_and_positions(dtype=torch.float32)
    cache = attn.kind.new_cache(1, 4, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="no cached form"):
        attn(torch.randn(1, 3, 16), None, relative=positions(3), cache=cache)


@pytest.mark.parametrize("impl", ["naive", "sdpa"])
def test_the_kernels_add_a_dense_score_bias_as_written(impl):
    """(B or 1, H, T, S), after the scale, with padding and a causal mask; GQA."""
    q, k, v = make_inputs(2, 4, 2, 5, 7, 8)
    for rows in (2, 1):
        bias = torch.randn(rows, 4, 5, 7, dtype=torch.float64)
        mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
        mask[1, ..., 5:] = False
        out = attention(q, k, v, mask, causal=True, impl=impl, score_bias=bias)
        allowed = mask & (torch.arange(7)[None, :] <= torch.arange(5)[:, None] + 2)
        scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8) + bias
        weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1)
        torch.testing.assert_close(out, weights @ v.repeat_interleave(2, 1), rtol=0,
                                   atol=1e-10)


@pytest.mark.parametrize("impl", ["flash", "triton"])
def test_kernels_without_written_scores_refuse_a_score_bias(impl):
    q, k, v = make_inputs(1, 2, 2, 3, 3, 8)
    with pytest.raises(ValueError, match="score_bias needs the scores written out"):
        attention(q, k, v, impl=impl, score_bias=torch.zeros(1, 2, 3, 3, dtype=q.dtype))


def test_a_score_bias_of_the_wrong_shape_is_named():
    q, k, v = make_inputs(2, 2, 2, 3, 4, 8)
    with pytest.raises(ValueError, match=r"score_bias must be a float \(B or 1, H, T, S\) = "
                                         r"\(2, 2, 3, 4\) tensor, got .* \(2, 2, 4, 3\)"):
        attention(q, k, v, score_bias=torch.zeros(2, 2, 4, 3, dtype=q.dtype))
