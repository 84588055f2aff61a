"""The whole model: sizes, tying, cached decoding, batching, and learning a copy task."""

import pytest
import torch
import torch.nn.functional as F

from transduce.attention import masks
from transduce.config import ConfigError, ModelConfig, preset
from transduce.decode.search import greedy_search
from transduce.model import Transformer
from transduce.model.packed import bfloat16_copy

PAD, BOS, EOS = 0, 1, 2


def tiny(**changes):
    return preset("tiny", src_vocab_size=20, tgt_vocab_size=20, **changes)


def padded(lengths, vocab=20, first=3):
    """Random right-padded ids (B, max(lengths)) drawn from [first, vocab)."""
    ids = torch.randint(first, vocab, (len(lengths), max(lengths)))
    return ids.masked_fill(~masks.padding_mask(torch.tensor(lengths))[:, 0, 0], PAD)


@pytest.mark.parametrize("name,low,high", [("base", 63e6, 65e6), ("big", 210e6, 216e6)])
def test_paper_presets_have_the_papers_size(name, low, high):
    model = Transformer(preset(name, src_vocab_size=37000, tgt_vocab_size=37000))
    assert low <= model.num_parameters() <= high


def test_three_way_tying_shares_one_matrix():
    model = Transformer(tiny())
    shared = model.output_proj.weight
    assert model.encoder.embed.embedding.weight is shared
    assert model.decoder.embed.embedding.weight is shared
    untied = Transformer(tiny(tie_embeddings="none"))
    assert untied.num_parameters() == model.num_parameters() + 2 * 20 * 64


def test_decoder_tying_with_separate_vocabularies():
    model = Transformer(preset("tiny", src_vocab_size=30, tgt_vocab_size=20,
                               tie_embeddings="decoder"))
    assert model.decoder.embed.embedding.weight is model.output_proj.weight
    assert model.encoder.embed.embedding.weight.shape == (30, 64)
    logits = model(padded([4, 2], vocab=30), padded([3, 3]))
    assert logits.shape == (2, 3, 20)


def test_tying_all_with_unequal_vocabularies_is_refused():
    with pytest.raises(ConfigError, match="tie_embeddings='all'"):
        preset("tiny", src_vocab_size=30, tgt_vocab_size=20)


@pytest.mark.parametrize("changes,field", [
    ({"d_model": 30}, "d_model=30"), ({"num_kv_heads": 3}, "num_kv_heads=3"),
    ({"dropout": 1.0}, "dropout"), ({"positional": "xpos"}, "positional"),
    ({"num_encoder_layers": 0}, "num_encoder_layers"),
])
def test_bad_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        tiny(**changes)


def test_embeddings_are_scaled_by_sqrt_d_model():
    model = Transformer(tiny(positional="rotary")).eval()
    ids = torch.tensor([[5, 6]])
    expected = model.encoder.embed.embedding.weight[ids] * 8.0  # sqrt(64)
    torch.testing.assert_close(model.encoder.embed(ids), expected)


def test_an_embedding_norm_normalizes_embeddings_and_positions_before_dropout():
    """mBART's layernorm_embedding: LayerNorm(scaled embedding + position), per stack."""
    torch.manual_seed(0)
    model = Transformer(tiny(positional="learned", embedding_norm=True)).eval()
    with torch.no_grad():
        for embed in (model.encoder.embed, model.decoder.embed):
            embed.norm.weight.normal_()
            embed.norm.bias.normal_()
    ids = torch.tensor([[5, 6, 7]])
    for embed in (model.encoder.embed, model.decoder.embed):
        summed = embed.embedding.weight[ids] * 8.0 + embed.positions.embedding.weight[1:4]
        expected = F.layer_norm(summed, (64,), embed.norm.weight, embed.norm.bias, 1e-5)
        torch.testing.assert_close(embed(ids, start=1), expected)
    assert Transformer(tiny()).encoder.embed.norm is None
    with pytest.raises(ConfigError, match="embedding_norm=True applies to"):
        tiny(arch="encoder", embedding_norm=True)


def test_pre_norm_stacks_end_with_a_layer_norm():
    assert Transformer(tiny()).encoder.final_norm is None
    model = Transformer(tiny(norm_first=True))
    assert model.encoder.final_norm is not None and model.decoder.final_norm is not None


# Linear and sliding-window self-attention, with grouped heads and rotary positions; a
# window of 2 is shorter than the test sequences, so it really cuts.
ATTENTION_TYPES = [
    {"attention_type": "linear"}, {"attention_type": "linear", "num_kv_heads": 2},
    {"attention_type": "sliding", "attention_window": 2},
    {"attention_type": "sliding", "attention_window": 3, "positional": "rotary",
     "num_kv_heads": 1, "attention_impl": "flash"},
    {"attention_type": "global", "attention_window": 2, "global_tokens": 2},
    {"attention_type": "strided", "attention_window": 2, "num_kv_heads": 2},
]


# Relative positions as score biases, through each kernel that takes them.
RELATIVE_POSITIONS = [
    {"positional": "t5"}, {"positional": "t5", "attention_impl": "flash", "num_kv_heads": 2},
    {"positional": "alibi"}, {"positional": "alibi", "attention_impl": "naive", "num_kv_heads": 1},
]


@pytest.mark.parametrize("changes", [
    {}, {"num_kv_heads": 2}, {"num_kv_heads": 1}, {"positional": "learned"},
    {"positional": "rotary", "num_kv_heads": 2}, {"norm_first": True},
    {"attention_impl": "naive"}, {"attention_impl": "flash", "num_kv_heads": 1},
    {"positional": "learned", "norm_first": True, "embedding_norm": True},
    *ATTENTION_TYPES, *RELATIVE_POSITIONS,
])
def test_cached_decoding_equals_the_full_causal_pass(changes):
    model = Transformer(tiny(**changes)).eval()
    src, tgt = padded([7, 3, 5]), padded([6, 6, 6])
    with torch.no_grad():
        full = model(src, tgt)                                            # (B, T, V)
        state = model.prefill(src, max_len=8)
        steps = [model.decode_step(tgt[:, :2], state)]                   # a 2-token prefix
        steps += [model.decode_step(tgt[:, t:t + 1], state) for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert state.length == 6


def test_cache_bytes_are_measured_and_match_the_formula():
    config = tiny(num_kv_heads=1)
    model = Transformer(config)
    state = model.prefill(padded([5, 5, 2]), max_len=11)
    formula = 2 * config.num_decoder_layers * config.kv_heads * config.head_dim * 4 * 11 * 3
    assert state.nbytes == formula
    mha_state = Transformer(tiny()).prefill(padded([5, 5, 2]), max_len=11)
    assert mha_state.nbytes == 4 * state.nbytes  # 4 heads -> 1 kv head


@pytest.mark.parametrize("changes", [{}, *ATTENTION_TYPES, *RELATIVE_POSITIONS])
def test_batched_equals_one_sentence_at_a_time(changes):
    model = Transformer(tiny(**changes)).eval()
    src, tgt = padded([7, 2, 5]), padded([4, 6, 3])
    with torch.no_grad():
        batched = model(src, tgt)
        for b, (s_len, t_len) in enumerate([(7, 4), (2, 6), (5, 3)]):
            alone = model(src[b:b + 1, :s_len], tgt[b:b + 1, :t_len])
            torch.testing.assert_close(batched[b:b + 1, :t_len], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes", [{}, *ATTENTION_TYPES])
def test_decoder_state_reorder_follows_the_index(changes):
    assert_reorder_follows_the_index(Transformer(tiny(**changes)).eval())


def assert_reorder_follows_the_index(model):
    """Decode two steps; give each sentence two target rows (beams: the sources stay one
    per sentence) that go on with different tokens; then keep sentences [2, 0] with their
    beams swapped. Every step equals the full pass over the same rows (any model with
    prefill / decode_step / state.reorder)."""
    src, shared = padded([6, 3, 4]), padded([4, 4, 4])
    tgt = shared.repeat_interleave(2, dim=0)                   # (6, 4): rows 2b, 2b+1 read b
    tgt[:, 2:] = padded([2] * 6)
    rows, sentences = torch.tensor([5, 4, 1, 0]), torch.tensor([2, 0])
    with torch.no_grad():
        full = model(src.repeat_interleave(2, dim=0), tgt)
        state = model.prefill(src, max_len=5)
        model.decode_step(shared[:, :2], state)
        state.reorder(torch.arange(3).repeat_interleave(2))
        beams = model.decode_step(tgt[:, 2:3], state)
        state.reorder(rows, sentences)
        kept = model.decode_step(tgt[rows, 3:4], state)
    torch.testing.assert_close(beams, full[:, 2:3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept, full[rows, 3:4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_dtype,cache_dtype,tolerance", [
    (torch.float32, torch.bfloat16, 5e-3),    # a bfloat16 cache in a float32 model
    (torch.bfloat16, None, 3e-2),             # Translator(dtype="bfloat16")
    (torch.bfloat16, torch.float32, 3e-2),    # a float32 cache in a bfloat16 model
])
def test_decoding_in_bfloat16_stays_close_to_float32(model_dtype, cache_dtype, tolerance):
    """Attention runs in the cache's type whatever the model's: cached steps stay within
    bfloat16 rounding of the float32 pass."""
    model = Transformer(tiny(num_kv_heads=2)).eval()
    src, tgt = padded([7, 3, 5]), padded([6, 6, 6])
    with torch.no_grad():
        full = model(src, tgt)
        other = model if model_dtype == torch.float32 else bfloat16_copy(model)
        state = other.prefill(src, max_len=6, cache_dtype=cache_dtype)
        steps = torch.cat([other.decode_step(tgt[:, t:t + 1], state) for t in range(6)], dim=1)
    assert state.caches[0].k.dtype == (cache_dtype or model_dtype)
    assert steps.dtype == model_dtype
    error = (steps.float() - full).abs().max()
    assert 0 < error < tolerance * full.abs().max()


def test_int8_cache_is_smaller_and_close_to_float():
    model = Transformer(tiny(num_kv_heads=2)).eval()
    src, tgt = padded([7, 3, 5]), padded([6, 6, 6])
    with torch.no_grad():
        full = model(src, tgt)
        state = model.prefill(src, max_len=6, cache_dtype=torch.int8)
        steps = torch.cat([model.decode_step(tgt[:, t:t + 1], state) for t in range(6)], dim=1)
    float_state = model.prefill(src, max_len=6)
    # Per token and head: 2 x 16 int8 values + 2 float32 scales, against 2 x 16 floats.
    assert state.nbytes * (2 * 16 * 4) == float_state.nbytes * (2 * 16 + 2 * 4)
    error = (steps - full).abs().max()
    assert 0 < error < 2e-2 * full.abs().max()


@pytest.mark.parametrize("changes,cache_kind", [
    ({"attention_type": "linear"}, "LinearStateCache"),
    ({"attention_type": "sliding", "attention_window": 3}, "SlidingKVCache"),
])
def test_linear_and_sliding_caches_do_not_grow_with_the_output(changes, cache_kind):
    model = Transformer(tiny(**changes)).eval()
    src, tgt = padded([4, 4]), padded([9, 9])
    state = model.prefill(src, max_len=9)
    assert type(state.caches[0]).__name__ == cache_kind
    sizes = []
    with torch.no_grad():
        for t in range(9):
            model.decode_step(tgt[:, t:t + 1], state)
            sizes.append(state.nbytes)
    assert len(set(sizes)) == 1
    if cache_kind == "LinearStateCache":
        with pytest.raises(ValueError, match="int8"):
            model.prefill(src, max_len=9, cache_dtype=torch.int8)


def test_positions_past_the_limit_are_a_clear_error():
    model = Transformer(tiny(max_positions=8))
    with pytest.raises(ValueError, match="max_positions=8"):
        model(padded([9]), padded([2]))


def copy_batch(batch_size, vocab, generator):
    lengths = torch.randint(3, 9, (batch_size,), generator=generator)
    body = torch.randint(3, vocab, (batch_size, 8), generator=generator)
    src = body.masked_fill(~masks.padding_mask(lengths, 8)[:, 0, 0], PAD)
    tgt = torch.full((batch_size, 10), PAD)
    for b, n in enumerate(lengths.tolist()):
        tgt[b, 0], tgt[b, 1:n + 1], tgt[b, n + 1] = BOS, src[b, :n], EOS
    return src, tgt[:, :-1], tgt[:, 1:]


def test_tiny_transformer_learns_to_copy():
    """A 2+2 layer model overfits a fixed set of 64 sequences: every greedy output exact."""
    torch.manual_seed(0)
    config = preset("tiny", src_vocab_size=13, tgt_vocab_size=13)
    model = Transformer(config)
    src, tgt_in, tgt_out = copy_batch(64, 13, torch.Generator().manual_seed(1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    for step in range(400):
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    model.eval()
    output = greedy_search(model, src, bos_id=BOS, eos_id=EOS, max_len=tgt_out.shape[1])
    assert torch.equal(output, tgt_out[:, :output.shape[1]]), f"loss {loss.item():.4f}"


def test_unprojected_forward_is_what_the_output_projection_maps_to_logits():
    model = Transformer(tiny()).eval()
    src, tgt = padded([5, 3]), padded([4, 2])
    with torch.no_grad():
        hidden = model(src, tgt, project=False)
        assert hidden.shape == (2, 4, model.config.d_model)
        torch.testing.assert_close(model.output_proj(hidden), model(src, tgt))
