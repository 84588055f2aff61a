"""The decoder-only model: the decoder's layers without cross-attention; cached decoding
equals the full causal pass for every cache kind, and left-padded rows equal rows alone."""

import math

import pytest
import torch

from transduce.config import ConfigError, preset
from transduce.decode.search import beam_search, greedy_search
from transduce.model import DecoderOnly, build_model

VOCAB = 40
KINDS = [  # (positional, attention_type, cache dtype, tolerance)
    ("learned", "softmax", torch.float32, 1e-5),
    ("rotary", "softmax", torch.float32, 1e-5),
    ("sinusoidal", "softmax", torch.float32, 1e-5),
    ("t5", "softmax", torch.float32, 1e-5),
    ("alibi", "softmax", torch.float32, 1e-5),
    ("alibi", "softmax", torch.int8, 0.1),
    ("learned", "softmax", torch.int4, 0.5),
    ("learned", "softmax", torch.bfloat16, 0.1),
    ("learned", "softmax", torch.int8, 0.1),
    ("rotary", "sliding", torch.float32, 1e-5),
    ("learned", "linear", torch.float32, 1e-5),
]


def tiny(**changes) -> DecoderOnly:
    config = preset("gpt-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                    attention_window=3, **changes)
    return build_model(config).eval()


def test_layers_have_no_cross_attention_and_the_preset_is_gpt_like():
    model = tiny()
    layer = model.decoder.layers[0]
    assert layer.cross_attn is None and layer.norm2 is None
    assert model.decoder.final_norm is not None            # pre-norm: a final LayerNorm
    assert model.output_proj.weight is model.decoder.embed.embedding.weight
    assert model.decoder.embed.scale == 1.0
    assert model.attention_modules().keys() == {"decoder"}


def test_gpt2_presets_have_the_published_sizes():
    assert build_model(preset("gpt2")).num_parameters() == 124_439_808
    with torch.device("meta"):
        assert round(build_model(preset("gpt2-medium")).num_parameters() / 1e6) == 355


@pytest.mark.parametrize("attention_type", ["global", "strided"])
def test_position_anchored_sparse_patterns_are_refused_for_left_padded_models(attention_type):
    with pytest.raises(ConfigError, match=f"attention_type='{attention_type}'.*left-padded"):
        tiny(attention_type=attention_type)


def test_decoder_arch_needs_one_vocabulary():
    with pytest.raises(ConfigError, match="one vocabulary"):
        preset("gpt-tiny", src_vocab_size=10, tgt_vocab_size=12)


def test_full_pass_is_causal():
    model = tiny()
    tokens = torch.randint(3, VOCAB, (2, 9))
    changed = tokens.clone()
    changed[:, 6:] = 5
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :6], model(changed)[:, :6])


@pytest.mark.parametrize("positional,attention,cache_dtype,tolerance", KINDS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cached_steps_equal_the_full_pass(positional, attention, cache_dtype, tolerance,
                                          kv_heads):
    model = tiny(positional=positional, attention_type=attention, num_kv_heads=kv_heads)
    assert_cached_steps_equal_the_full_pass(model, cache_dtype, tolerance)


def test_a_norm_of_the_embeddings_is_cached_as_the_full_pass_computes_it():
    model = tiny(positional="learned", embedding_norm=True)
    with torch.no_grad():
        model.decoder.embed.norm.weight.uniform_(0.5, 1.5)
    assert_cached_steps_equal_the_full_pass(model, torch.float32, 1e-5)


def assert_cached_steps_equal_the_full_pass(model, cache_dtype, tolerance):
    tokens = torch.randint(3, VOCAB, (3, 11))
    with torch.no_grad():
        full = model(tokens)
        state = model.prefill(tokens[:, :5], 10, cache_dtype=cache_dtype)
        # The prompt's last token, one at a time, then three at once.
        steps = [model.decode_step(tokens[:, i:i + 1], state) for i in range(4, 8)]
        steps.append(model.decode_step(tokens[:, 8:11], state))
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], atol=tolerance, rtol=0)


@pytest.mark.parametrize("positional,attention,cache_dtype,tolerance", KINDS)
def test_left_padded_rows_generate_what_they_would_alone(positional, attention, cache_dtype,
                                                         tolerance):
    model = tiny(positional=positional, attention_type=attention, num_kv_heads=2)
    assert_left_padded_rows_generate_what_they_would_alone(model, cache_dtype)


def assert_left_padded_rows_generate_what_they_would_alone(model, cache_dtype):
    prompts = [torch.randint(3, VOCAB, (n,)) for n in (7, 1, 4)]
    width = 7
    batch = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        batch[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt, True
    with torch.no_grad():
        together = greedy_search(model, batch, bos_id=batch[:, -1], eos_id=2, max_len=12,
                                 src_mask=mask[:, None, None, :], cache_dtype=cache_dtype)
        full = model(batch, key_mask=mask)
        for i, prompt in enumerate(prompts):
            alone = greedy_search(model, prompt[None], bos_id=prompt[-1:], eos_id=2,
                                  max_len=12, cache_dtype=cache_dtype)
            assert torch.equal(together[i, :alone.shape[1]], alone[0])
            torch.testing.assert_close(full[i, width - len(prompt):], model(prompt[None])[0],
                                       atol=1e-5, rtol=0)


def local_and_full(**changes) -> DecoderOnly:
    """Gemma 3's arrangement in small: sliding layers (3 keys before each token) around
    one full layer, two rotary bases, sandwich norms with non-unit gains."""
    torch.manual_seed(0)
    model = tiny(**{"positional": "rotary", "attention_type": "sliding", "num_kv_heads": 2,
                    "num_decoder_layers": 3, "full_attention_layers": (1,),
                    "local_rope_base": 50.0, "sandwich_norm": True, **changes})
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("cache_dtype,tolerance", [(torch.float32, 1e-5), (torch.int8, 0.1)])
def test_local_and_full_layers_cache_and_pad_as_one_kind_does(cache_dtype, tolerance):
    model = local_and_full()
    assert [type(cache).__name__ for cache in model.new_caches(1, 20, cache_dtype, "meta")] \
        == (["SlidingKVCache", "KVCache", "SlidingKVCache"] if cache_dtype == torch.float32
            else ["QuantizedSlidingKVCache", "QuantizedKVCache", "QuantizedSlidingKVCache"])
    assert_cached_steps_equal_the_full_pass(model, cache_dtype, tolerance)
    assert_left_padded_rows_generate_what_they_would_alone(model, cache_dtype)


def test_each_layer_attends_and_rotates_as_its_kind():
    """The full layer reaches a token that three sliding layers (3 keys each) cannot;
    every layer full is the softmax model; local_rope_base rotates the sliding layers
    alone."""
    model = local_and_full()
    tokens = torch.randint(3, VOCAB, (2, 12))
    changed = tokens.clone()
    changed[:, 0] = (tokens[:, 0] + 1 - 3) % (VOCAB - 3) + 3      # 11 tokens before the last
    sliding = local_and_full(full_attention_layers=(), local_rope_base=None)
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[:, -1], model(changed)[:, -1])
        torch.testing.assert_close(sliding(tokens)[:, -1], sliding(changed)[:, -1])
    every_full = local_and_full(full_attention_layers=(0, 1, 2), local_rope_base=None)
    softmax = local_and_full(full_attention_layers=(), attention_type="softmax",
                             local_rope_base=None)
    softmax.load_state_dict(every_full.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(every_full(tokens), softmax(tokens), rtol=0, atol=0)
    first, full = model.decoder.layers[0].self_attn.rotary, model.decoder.layers[1].self_attn.rotary
    assert first is model.decoder.layers[2].self_attn.rotary and first is not full
    # Position 1's angle on the second rate pair: base^(-2/D), D = 16.
    assert first.cos[1, 1].item() == pytest.approx(math.cos(50 ** -0.125))
    assert full.cos[1, 1].item() == pytest.approx(math.cos(10000 ** -0.125))


def test_beam_search_over_left_padded_prompts_equals_one_at_a_time():
    model = tiny(num_kv_heads=2)
    prompts = [torch.randint(3, VOCAB, (n,)) for n in (5, 2)]
    batch = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        batch[i, 5 - len(prompt):], mask[i, 5 - len(prompt):] = prompt, True
    with torch.no_grad():
        together = beam_search(model, batch, bos_id=batch[:, -1], eos_id=2, beam=3, nbest=3,
                               max_len=8, src_mask=mask[:, None, None, :])
        for i, prompt in enumerate(prompts):
            alone = beam_search(model, prompt[None], bos_id=prompt[-1:], eos_id=2, beam=3,
                                nbest=3, max_len=8)[0]
            assert [h.tokens for h in together[i]] == [h.tokens for h in alone]
            for a, b in zip(together[i], alone):
                assert a.score == pytest.approx(b.score, abs=1e-4)


def test_prefill_refuses_right_padding_and_empty_prompts():
    model = tiny()
    with pytest.raises(ValueError, match="left-padded"):
        model.prefill(torch.ones(1, 3, dtype=torch.long), 4,
                      src_mask=torch.tensor([[True, True, False]])[:, None, None, :])
    with pytest.raises(ValueError, match="at least one token"):
        model.prefill(torch.ones(1, 0, dtype=torch.long), 4)


def test_positions_beyond_the_context_are_refused():
    model = tiny()
    state = model.prefill(torch.ones(1, 250, dtype=torch.long), 10)    # caches 249 tokens
    with torch.no_grad():
        model.decode_step(torch.ones(1, 7, dtype=torch.long), state)   # 256 = max_positions
        with pytest.raises(ValueError, match="max_positions"):
            model.decode_step(torch.ones(1, 1, dtype=torch.long), state)


@pytest.mark.parametrize("cache_dtype,tolerance", [(torch.float32, 1e-5), (torch.int8, 0.1)])
def test_the_llama_preset_caches_and_pads_as_the_gpt_preset(cache_dtype, tolerance):
    """RMSNorm, SwiGLU, rotary positions, grouped-query attention and an untied output."""
    model = build_model(preset("llama-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                               tie_embeddings="none")).eval()
    layer = model.decoder.layers[0]
    assert isinstance(model.decoder.final_norm, torch.nn.RMSNorm)
    assert layer.ffn.linear3 is not None and layer.self_attn.num_kv_heads == 2
    assert model.output_proj.weight is not model.decoder.embed.embedding.weight
    assert_cached_steps_equal_the_full_pass(model, cache_dtype, tolerance)
    assert_left_padded_rows_generate_what_they_would_alone(model, cache_dtype)
