"""Our layers against torch.nn's with copied weights."""

import pytest
import torch
from torch import nn

from tests.attention.test_multihead import copy_from_torch
from transduce.attention import masks
from transduce.config import ModelConfig
from transduce.model.layers import DecoderLayer, EncoderLayer, FeedForward

D_MODEL, HEADS, D_FF = 32, 4, 64


def config(**changes):
    return ModelConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=D_MODEL, num_heads=HEADS,
                       d_ff=D_FF, dropout=0.0, **changes)


def copy_common(ours, theirs):
    with torch.no_grad():
        ours.ffn.linear1.load_state_dict(theirs.linear1.state_dict())
        ours.ffn.linear2.load_state_dict(theirs.linear2.state_dict())
        for name in ("norm1", "norm2", "norm3"):
            if hasattr(theirs, name):
                getattr(ours, name).load_state_dict(getattr(theirs, name).state_dict())
                # Non-trivial norms, so that a swapped norm would show.
                getattr(ours, name).weight.uniform_(0.5, 1.5)
                getattr(theirs, name).weight.copy_(getattr(ours, name).weight)
    copy_from_torch(ours.self_attn, theirs.self_attn)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("impl", ["naive", "sdpa", "flash"])
def test_encoder_layer_equals_torch(norm_first, activation, impl):
    theirs = nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, dropout=0.0, activation=activation,
                                        batch_first=True, norm_first=norm_first).eval()
    ours = EncoderLayer(config(norm_first=norm_first, activation=activation,
                               attention_impl=impl)).eval()
    copy_common(ours, theirs)
    x = torch.randn(3, 8, D_MODEL)
    pad = masks.padding_mask(torch.tensor([8, 5, 2]), 8)
    expected = theirs(x, src_key_padding_mask=~pad[:, 0, 0])
    got = ours(x, pad)
    # torch's fast path returns zeros at padded positions in eval mode; compare real ones.
    real = pad[:, 0, 0]
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("impl", ["naive", "sdpa", "flash"])
def test_decoder_layer_equals_torch(norm_first, impl):
    theirs = nn.TransformerDecoderLayer(D_MODEL, HEADS, D_FF, dropout=0.0, batch_first=True,
                                        norm_first=norm_first).eval()
    ours = DecoderLayer(config(norm_first=norm_first, attention_impl=impl)).eval()
    copy_common(ours, theirs)
    copy_from_torch(ours.cross_attn, theirs.multihead_attn)
    x, memory = torch.randn(2, 6, D_MODEL), torch.randn(2, 9, D_MODEL)
    memory_pad = masks.padding_mask(torch.tensor([9, 4]), 9)
    future = nn.Transformer.generate_square_subsequent_mask(6)
    expected = theirs(x, memory, tgt_mask=future, tgt_is_causal=True,
                      memory_key_padding_mask=~memory_pad[:, 0, 0])
    got = ours(x, ours.cross_attn.project_kv(memory), memory_pad)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_feed_forward_is_relu_mlp():
    ffn = FeedForward(4, 8)
    x = torch.randn(2, 3, 4)
    expected = torch.relu(x @ ffn.linear1.weight.T + ffn.linear1.bias) @ ffn.linear2.weight.T \
        + ffn.linear2.bias
    torch.testing.assert_close(ffn(x), expected)


def test_residual_dropout_is_active_in_training_only():
    layer = EncoderLayer(config().replace(dropout=0.5))
    x = torch.randn(2, 5, D_MODEL)
    layer.train()
    assert not torch.allclose(layer(x, None), layer(x, None))
    layer.eval()
    torch.testing.assert_close(layer(x, None), layer(x, None))


@pytest.mark.parametrize("shared_norm", [False, True])
def test_a_parallel_residual_adds_attention_and_ffn_of_one_input(shared_norm):
    """x + Attn(Norm1(x)) + FFN(Norm3(x)) (GPT-NeoX's layer), or with one norm
    x + Attn(Norm1(x)) + FFN(Norm1(x)) (Phi's, no Norm3 weights), from the layer's own
    modules in float64, with norms of different gains and biases."""
    torch.manual_seed(0)
    layer = DecoderLayer(config(arch="decoder", norm_first=True, parallel_residual=True,
                                shared_norm=shared_norm),
                         cross_attention=False).double().eval()
    norms = (layer.norm1,) if shared_norm else (layer.norm1, layer.norm3)
    assert shared_norm == (not any(name.startswith("norm3") for name in layer.state_dict()))
    with torch.no_grad():
        for norm in norms:
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        expected = x + layer.self_attn(layer.norm1(x), None, causal=True) + \
            layer.ffn(norms[-1](x))
        torch.testing.assert_close(layer(x, None, None), expected, rtol=1e-12, atol=1e-12)


def test_olmo2_layers_normalize_outputs_alone_and_queries_over_all_heads():
    """input_norms=False: x + PostNorm(Attn(x)), then + PostNorm(FFN(.)), in float64
    from the layer's own modules; qk_norm_across_heads: the queries' and keys' norms are
    an RMSNorm of the whole projection (all heads' features together), split after."""
    torch.manual_seed(0)
    c = config(arch="decoder", norm="rms", norm_first=True, sandwich_norm=True,
               input_norms=False, qk_norm=True, qk_norm_across_heads=True, num_kv_heads=2,
               positional="rotary")
    layer = DecoderLayer(c, cross_attention=False).double().eval()
    attn = layer.self_attn
    with torch.no_grad():
        for norm in (layer.post_norm1, layer.post_norm3, attn.q_norm.norm, attn.k_norm.norm):
            norm.weight.uniform_(0.5, 1.5)
    assert isinstance(layer.norm1, nn.Identity) and isinstance(layer.norm3, nn.Identity)
    assert attn.q_norm.norm.weight.shape == (HEADS * 8,) and \
        attn.k_norm.norm.weight.shape == (2 * 8,)
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        h = x + layer.post_norm1(layer.self_attn(x, None, causal=True))
        expected = h + layer.post_norm3(layer.ffn(h))
        torch.testing.assert_close(layer(x, None, None), expected, rtol=1e-12, atol=1e-12)
        whole = nn.RMSNorm(HEADS * 8, eps=c.layer_norm_eps).double()
        whole.weight.copy_(attn.q_norm.norm.weight)
        q = attn.q_proj(x)                                                   # (B, T, H * D)
        split = whole(q).reshape(2, 6, HEADS, 8).transpose(1, 2)
        torch.testing.assert_close(attn.q_norm(q.reshape(2, 6, HEADS, 8).transpose(1, 2)),
                                   split, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cross_attention", [True, False])
def test_sandwich_norms_normalize_each_sub_layers_output_before_the_residual_sum(
        cross_attention):
    """x + PostNorm(Sublayer(Norm(x))) for each sub-layer, with gains that differ
    (Gemma's post-attention and post-feedforward norms), computed here from the layer's
    own modules in float64."""
    torch.manual_seed(0)
    layer = DecoderLayer(config(norm_first=True, sandwich_norm=True, norm="rms"),
                         cross_attention=cross_attention).double().eval()
    norms = ["norm1", "post_norm1", "norm3", "post_norm3"] + \
        (["norm2", "post_norm2"] if cross_attention else [])
    with torch.no_grad():
        for name in norms:
            getattr(layer, name).weight.uniform_(0.5, 1.5)
    assert (layer.post_norm2 is None) != cross_attention
    x, memory = torch.randn(2, 6, D_MODEL, dtype=torch.float64), \
        torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    kv = layer.cross_attn.project_kv(memory) if cross_attention else None
    with torch.no_grad():
        expected = x + layer.post_norm1(layer.self_attn(layer.norm1(x), None, causal=True))
        if cross_attention:
            expected = expected + layer.post_norm2(layer.cross_attn(layer.norm2(expected),
                                                                    None, kv=kv))
        expected = expected + layer.post_norm3(layer.ffn(layer.norm3(expected)))
        torch.testing.assert_close(layer(x, kv, None), expected,
                                   rtol=1e-12, atol=1e-12)
    encoder = EncoderLayer(config(norm_first=True, sandwich_norm=True)).double().eval()
    with torch.no_grad():
        for norm in (encoder.post_norm1, encoder.post_norm2):
            norm.weight.uniform_(0.5, 1.5)
        h = x + encoder.post_norm1(encoder.self_attn(encoder.norm1(x), None))
        torch.testing.assert_close(encoder(x, None),
                                   h + encoder.post_norm2(encoder.ffn(encoder.norm2(h))))
