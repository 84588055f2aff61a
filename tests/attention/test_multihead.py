"""MultiHeadAttention against torch.nn.MultiheadAttention, GQA/MQA against repeated heads,
and cached step-by-step self-attention against the full causal pass."""

import pytest
import torch
from torch import nn

from transduce.attention import KVCache, MultiHeadAttention, masks
from transduce.config import AttentionImpl, choices
from transduce.model.positional import RotaryEmbedding
from transduce.model.lora import LoRALinear, LoRASettings
from transduce.train.products import StepRecorder
from tests.attention.reference import reference_attention

# impl='triton' needs a GPU or the interpreter: tests/attention/test_triton.py.
IMPLS = [impl for impl in choices(AttentionImpl) if impl != "triton"]


def copy_from_torch(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    c = theirs.embed_dim
    with torch.no_grad():
        for i, proj in enumerate([ours.q_proj, ours.k_proj, ours.v_proj]):
            proj.weight.copy_(theirs.in_proj_weight[i * c:(i + 1) * c])
            proj.bias.copy_(theirs.in_proj_bias[i * c:(i + 1) * c])
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)


def paired_attention(d_model, heads, impl):
    """torch.nn.MultiheadAttention and ours with the same weights, in eval mode."""
    theirs = nn.MultiheadAttention(d_model, heads, batch_first=True).eval()
    ours = MultiHeadAttention(d_model, heads, impl=impl).eval()
    copy_from_torch(ours, theirs)
    return theirs, ours


@pytest.mark.parametrize("impl", IMPLS)
def test_self_attention_equals_torch_with_key_padding(impl):
    torch_mha, ours = paired_attention(32, 4, impl)
    x = torch.randn(3, 7, 32)
    lengths = torch.tensor([7, 3, 5])
    pad = masks.padding_mask(lengths, 7)                                   # (B, 1, 1, S)
    expected, expected_weights = torch_mha(x, x, x, key_padding_mask=~pad[:, 0, 0],
                                           average_attn_weights=False)
    torch.testing.assert_close(ours(x, pad), expected, rtol=1e-5, atol=1e-5)
    if impl == "naive":
        _, weights = ours(x, pad, return_weights=True)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_self_attention_equals_torch(impl):
    torch_mha, ours = paired_attention(32, 8, impl)
    x = torch.randn(2, 9, 32)
    future = nn.Transformer.generate_square_subsequent_mask(9)
    expected, _ = torch_mha(x, x, x, attn_mask=future)
    torch.testing.assert_close(ours(x, causal=True), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_attention_equals_torch(impl):
    torch_mha, ours = paired_attention(24, 3, impl)
    x, memory = torch.randn(2, 5, 24), torch.randn(2, 11, 24)
    pad = masks.padding_mask(torch.tensor([11, 6]), 11)
    expected, _ = torch_mha(x, memory, memory, key_padding_mask=~pad[:, 0, 0])
    got = ours(x, pad, kv=ours.project_kv(memory))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("steps", [1, 3])
def test_rows_sharing_a_source_equal_rows_with_copies_of_it(kv_heads, impl, steps):
    """Beam search keeps one copy of each source's keys and values for its K beams: target
    rows 3b..3b+2 reading source b equal each row reading its own copy (float64), with
    padding, and the weights come back per row."""
    mha = MultiHeadAttention(32, 4, kv_heads, impl=impl).double().eval()
    x, memory = torch.randn(6, steps, 32).double(), torch.randn(2, 9, 32).double()
    pad = masks.padding_mask(torch.tensor([9, 4]), 9)                     # (2, 1, 1, 9)
    shared = mha(x, pad, kv=mha.project_kv(memory))
    copies = mha.project_kv(memory.repeat_interleave(3, dim=0))
    expected = mha(x, pad.repeat_interleave(3, dim=0), kv=copies)
    torch.testing.assert_close(shared, expected, rtol=1e-10, atol=1e-10)
    _, weights = mha(x, pad, kv=mha.project_kv(memory), return_weights=True)
    _, expected_weights = mha(x, pad.repeat_interleave(3, dim=0), kv=copies, return_weights=True)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-10)
    assert weights[3:, :, :, 4:].abs().max() == 0  # source 1's padding, in rows 3..5
    with pytest.raises(ValueError, match="multiple of sources"):
        mha(x[:5], pad, kv=mha.project_kv(memory))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_query_equals_mha_with_repeated_kv_heads(kv_heads, impl):
    """GQA is MHA whose key/value projections repeat each of the H_kv heads G times."""
    d_model, heads = 32, 8
    group = heads // kv_heads
    gqa = MultiHeadAttention(d_model, heads, kv_heads, impl=impl).eval()
    mha = MultiHeadAttention(d_model, heads, impl=impl).eval()
    head_dim = d_model // heads
    with torch.no_grad():
        for name in ("q_proj", "out_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(src.weight.view(kv_heads, head_dim, d_model)
                             .repeat_interleave(group, 0).reshape(d_model, d_model))
            dst.bias.copy_(src.bias.view(kv_heads, head_dim).repeat_interleave(group, 0).flatten())
    x = torch.randn(2, 6, d_model)
    assert gqa.k_proj.out_features == kv_heads * head_dim
    torch.testing.assert_close(gqa(x, causal=True), mha(x, causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rotary", [False, True])
def test_cached_steps_equal_the_full_causal_pass(kv_heads, impl, rotary):
    rope = RotaryEmbedding(8, max_positions=64) if rotary else None
    mha = MultiHeadAttention(32, 4, kv_heads, impl=impl, rotary=rope).eval()
    x = torch.randn(3, 10, 32)
    full = mha(x, causal=True)
    cache = KVCache(3, kv_heads, max_len=12, head_dim=8)
    # A prefix of 4 tokens at once, then one token at a time.
    steps = [mha(x[:, :4], causal=True, cache=cache)]
    steps += [mha(x[:, t:t + 1], causal=True, cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 10


def test_rotary_is_not_applied_to_cross_attention():
    rope = RotaryEmbedding(8, max_positions=64)
    with_rope = MultiHeadAttention(16, 2, rotary=rope).eval()
    without = MultiHeadAttention(16, 2).eval()
    without.load_state_dict(with_rope.state_dict())
    x, memory = torch.randn(1, 3, 16), torch.randn(1, 5, 16)
    torch.testing.assert_close(with_rope(x, kv=with_rope.project_kv(memory)),
                               without(x, kv=without.project_kv(memory)))


def test_cache_with_cross_attention_is_refused():
    mha = MultiHeadAttention(16, 2)
    memory = torch.randn(1, 5, 16)
    with pytest.raises(ValueError, match="self-attention only"):
        mha(torch.randn(1, 1, 16), kv=mha.project_kv(memory), cache=KVCache(1, 2, 4, 8))


def test_bad_head_counts_are_named():
    with pytest.raises(ValueError, match="num_heads=3"):
        MultiHeadAttention(16, 3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        MultiHeadAttention(24, 4, 3)
    with pytest.raises(ValueError, match="d_model=0 and num_heads=4 must be positive"):
        MultiHeadAttention(0, 4)
    with pytest.raises(ValueError, match="num_heads=0 must be positive"):
        MultiHeadAttention(16, 0)
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        MultiHeadAttention(16, 4, 0)
    with pytest.raises(ValueError, match="dropout=1.5"):
        MultiHeadAttention(16, 4, dropout=1.5)


def test_projection_sizes_shrink_with_kv_heads():
    mqa = MultiHeadAttention(64, 8, 1)
    assert mqa.q_proj.weight.shape == (64, 64)
    assert mqa.k_proj.weight.shape == (8, 64) and mqa.v_proj.weight.shape == (8, 64)


def test_unscaled_scores_are_q_dot_k_without_the_square_root():
    torch.manual_seed(3)
    layer = MultiHeadAttention(32, 4, scale_scores=False).eval()
    x = torch.randn(2, 5, 32)
    q = layer._split(layer.q_proj(x), 4)
    k, v = layer.project_kv(x)
    weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)            # no 1/sqrt(8)
    expected = layer.out_proj(layer._merge(weights @ v))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    scaled = MultiHeadAttention(32, 4).eval()
    scaled.load_state_dict(layer.state_dict())
    assert not torch.allclose(scaled(x), expected, atol=1e-3)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale_scores", [True, False])
@pytest.mark.parametrize("qk_norm", [None, nn.RMSNorm])
def test_fused_projections_give_the_separate_ones_result(kv_heads, rotary, bias, scale_scores,
                                                         qk_norm):
    """One stacked product computes exactly the three rows' dot products: the full pass,
    the cached steps and the returned weights all match the unfused module."""
    rope = RotaryEmbedding(8, max_positions=64) if rotary else None
    separate = MultiHeadAttention(32, 4, kv_heads, rotary=rope, bias=bias,
                                  scale_scores=scale_scores, qk_norm=qk_norm).eval()
    fused = MultiHeadAttention(32, 4, kv_heads, rotary=rope, bias=bias,
                               scale_scores=scale_scores, qk_norm=qk_norm).eval()
    if qk_norm is not None:
        _randomize_norms(separate)
    fused.load_state_dict(separate.state_dict())
    fused.fuse_self_projections()
    assert fused.q_proj is None and fused.qkv_proj.out_features == 32 + 2 * kv_heads * 8
    x = torch.randn(3, 6, 32)
    mask = masks.padding_mask(torch.tensor([6, 4, 1]), 6)
    torch.testing.assert_close(fused(x, mask, causal=True), separate(x, mask, causal=True),
                               rtol=1e-6, atol=1e-6)
    got, expected = (m(x, mask, return_weights=True) for m in (fused, separate))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    caches = [KVCache(3, kv_heads, max_len=6, head_dim=8) for _ in range(2)]
    for t in range(6):
        torch.testing.assert_close(fused(x[:, t:t + 1], causal=True, cache=caches[0]),
                                   separate(x[:, t:t + 1], causal=True, cache=caches[1]),
                                   rtol=1e-6, atol=1e-6)


def _product_widths(mha, *inputs, **options) -> list[int]:
    """The output widths (N) of the matrix products a forward call makes."""
    with torch.no_grad(), StepRecorder() as recorder:
        mha(*inputs, **options)
    return sorted(call.args[-1].size[-1] for call, n in recorder.of_kind("product").items()
                  for _ in range(n))


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_training_stacks_the_projections_and_computes_what_separate_ones_do(kv_heads, bias):
    """In training, q, k and v (cross-attention's k and v) are one product of stacked
    weights: outputs and every parameter's gradient as with one product each, in float64."""
    torch.manual_seed(0)
    modules = [MultiHeadAttention(32, 4, kv_heads, bias=bias).double().train()
               for _ in range(2)]
    with torch.no_grad():   # biases start at zero: make each its own
        for parameter in modules[0].parameters():
            parameter.normal_(0.0, 0.3)
    modules[1].load_state_dict(modules[0].state_dict())
    modules[1].stack_in_training = False
    x, source = torch.randn(3, 6, 32, dtype=torch.float64), torch.randn(3, 5, 32).double()
    mask = masks.padding_mask(torch.tensor([6, 4, 1]), 6)

    def step(mha):
        out = mha(x, mask, causal=True) + mha(x, kv=mha.project_kv(source)).sin()
        out.pow(2).sum().backward()
        return out

    torch.testing.assert_close(step(modules[0]), step(modules[1]), rtol=1e-12, atol=1e-12)
    for (name, stacked), separate in zip(modules[0].named_parameters(),
                                         modules[1].parameters()):
        torch.testing.assert_close(stacked.grad, separate.grad, rtol=1e-12, atol=1e-12,
                                   msg=name)
    kv = kv_heads * 8
    assert _product_widths(modules[0], x) == sorted([32 + 2 * kv, 32])           # qkv, out
    assert _product_widths(modules[0].project_kv, source) == [2 * kv]
    assert _product_widths(modules[1], x) == sorted([32, kv, kv, 32])


def test_eval_and_adapted_projections_keep_one_product_each():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4)
    x = torch.randn(2, 3, 32)
    assert _product_widths(mha.eval(), x) == [32] * 4
    # A LoRA layer's update is not in its weight: stacking that would lose it.
    mha.k_proj = LoRALinear(mha.k_proj, LoRASettings(rank=2, alpha=4.0))
    with torch.no_grad():
        mha.k_proj.lora_b.normal_()
    torch.testing.assert_close(mha.train()(x), mha.eval()(x), rtol=1e-6, atol=1e-6)


def test_fused_projections_refuse_cross_attention():
    mha = MultiHeadAttention(16, 2)
    mha.fuse_self_projections()
    with pytest.raises(ValueError, match="fused for self-attention"):
        mha.project_kv(torch.randn(1, 5, 16))
    with pytest.raises(ValueError, match="fused for self-attention"):
        mha(torch.randn(1, 1, 16), kv=(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)))


def _randomize_norms(attn: MultiHeadAttention) -> None:
    """Norm weights (and LayerNorm's biases) far from their initial ones and zeros."""
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.uniform_(0.5, 2.0)
            if getattr(norm, "bias", None) is not None:
                norm.bias.uniform_(-0.5, 0.5)


def _normed_heads(x, weight, bias, heads, kind):
    """float64 reference of qk_norm: x (B, T, heads * D) -> (B, heads, T, D), each head's
    vector normalized as RMSNorm or LayerNorm over D."""
    x = x.double().unflatten(-1, (heads, -1)).transpose(1, 2)
    if kind == "layer":
        x = x - x.mean(-1, keepdim=True)
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return x * weight.double() + bias.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_qk_norm_normalizes_each_heads_queries_and_keys_before_rotary(kind, kv_heads):
    """Qwen3's order, against a float64 reference: project, normalize each head over D with
    the one weight all heads share, rotate, attend (padding and causal masks)."""
    torch.manual_seed(5)
    factory = (lambda size: nn.RMSNorm(size, eps=1e-6)) if kind == "rms" else nn.LayerNorm
    rope = RotaryEmbedding(8, max_positions=64)
    attn = MultiHeadAttention(32, 4, kv_heads, rotary=rope, qk_norm=factory).eval()
    _randomize_norms(attn)
    x = torch.randn(3, 7, 32)
    mask = masks.padding_mask(torch.tensor([7, 5, 1]), 7)
    bias = {name: getattr(attn, name).bias if kind == "layer" else None
            for name in ("q_norm", "k_norm")}
    q = _normed_heads(attn.q_proj(x), attn.q_norm.weight, bias["q_norm"], 4, kind)
    k = _normed_heads(attn.k_proj(x), attn.k_norm.weight, bias["k_norm"], kv_heads, kind)
    v = attn.v_proj(x).double().unflatten(-1, (kv_heads, 8)).transpose(1, 2)
    rope64 = RotaryEmbedding(8, max_positions=64).double()
    out, _ = reference_attention(rope64(q, 0), rope64(k, 0), v, mask, causal=True)
    expected = out.transpose(1, 2).flatten(2) @ attn.out_proj.weight.double().T \
        + attn.out_proj.bias.double()
    torch.testing.assert_close(attn(x, mask, causal=True).double(), expected,
                               rtol=1e-5, atol=1e-5)
    plain = MultiHeadAttention(32, 4, kv_heads, rotary=rope).eval()
    plain.load_state_dict(attn.state_dict(), strict=False)
    assert not torch.allclose(plain(x, mask, causal=True).double(), expected, atol=1e-2)


def test_qk_norm_cross_attention_normalizes_the_sources_keys_once():
    torch.manual_seed(6)
    attn = MultiHeadAttention(32, 4, 2, qk_norm=nn.RMSNorm).eval()
    _randomize_norms(attn)
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 5, 32)
    k, v = attn.project_kv(memory)
    torch.testing.assert_close(k, attn.k_norm(attn.k_proj(memory).unflatten(-1, (2, 8))
                                              .transpose(1, 2)))
    q = attn.q_norm(attn.q_proj(x).unflatten(-1, (4, 8)).transpose(1, 2))
    out, _ = reference_attention(q, k, v)
    expected = attn.out_proj(out.float().transpose(1, 2).flatten(2))
    torch.testing.assert_close(attn(x, kv=(k, v)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_qk_norm_cached_steps_equal_the_full_causal_pass(kv_heads):
    """The cache holds normalized keys: a prefix, then one token at a time."""
    torch.manual_seed(7)
    attn = MultiHeadAttention(32, 4, kv_heads, rotary=RotaryEmbedding(8, max_positions=64),
                              qk_norm=nn.RMSNorm).eval()
    _randomize_norms(attn)
    x = torch.randn(2, 9, 32)
    cache = KVCache(2, kv_heads, max_len=9, head_dim=8)
    steps = [attn(x[:, :3], causal=True, cache=cache)]
    steps += [attn(x[:, t:t + 1], causal=True, cache=cache) for t in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), attn(x, causal=True), rtol=1e-5, atol=1e-5)
