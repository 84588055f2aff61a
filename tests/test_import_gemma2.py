"""Hugging Face Gemma 2 -> our checkpoint: the imported model computes what
transformers.Gemma2ForCausalLM computes (logits with its scores and logits soft-capped,
left-padded batches, greedy generation through the caches of its sliding and full
layers, perplexity), exports back to Gemma2ForCausalLM and to ONNX, and what it cannot
reproduce is refused by name with nothing written."""

import pytest
import torch

from transduce.cli import main
from transduce.importers import import_gemma
from transduce.model import load_model
from tests.foreign_checkpoints import assert_peft_adapter_merges, assert_refused, \
    assert_same_greedy_tokens, assert_same_logits, assert_same_onnx_logits, \
    assert_same_perplexity, damaged
from tests.test_import_gemma import ATOL, gemma_tokenizer, hf_checkpoint  # noqa: F401

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CONFIGS = [
    # gemma-2-2b's layout in small: one layer in two sliding (the first), heads wider than
    # hidden_size / heads scored over sqrt(24) (9B's query_pre_attn_scalar is not its
    # head_dim either: folded into q_proj), caps low enough that they count, tied output
    dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
         num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
         max_position_embeddings=96, attn_logit_softcapping=0.8,
         final_logit_softcapping=3.0),
    # no caps, every layer full, linear rotary scaling, multi-query, an untied output
    dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
         max_position_embeddings=64, attn_logit_softcapping=None,
         final_logit_softcapping=None, tie_word_embeddings=False,
         layer_types=["full_attention"] * 2,
         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
         seed=1),
]


def gemma2_checkpoint(directory, tokenizer_dir, seed=0, **config):
    """A random Gemma2ForCausalLM saved as tests/test_import_gemma.py saves Gemma 3's."""
    return hf_checkpoint(directory, tokenizer_dir, seed, generation="Gemma2", **config)


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=lambda i: f"config{i}")
def imported(request, gemma_tokenizer, tmp_path_factory):  # noqa: F811 (the fixture)
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("gemma2")
    hf = gemma2_checkpoint(root / "hf", gemma_tokenizer, **dict(CONFIGS[request.param]))
    out = import_gemma(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    c, theirs = ours.config, hf.config
    assert (c.sandwich_norm, c.qk_norm, c.local_rope_base) == (True, False, None)
    assert (c.attention_softcap, c.logit_softcap) == (theirs.attn_logit_softcapping,
                                                      theirs.final_logit_softcapping)
    full = [i for i, kind in enumerate(theirs.layer_types) if kind == "full_attention"]
    assert list(c.full_attention_layers) == (full if len(full) < c.num_decoder_layers else [])
    assert_same_logits(hf, ours, atol=ATOL)


def test_each_cap_and_the_query_scale_count(imported):
    """Without the scores' cap, the logits' cap or the queries' factor (24 for heads of
    16), the logits are others: the check above sees each."""
    hf, ours, _ = imported
    c = ours.config
    if c.attention_softcap is None:
        pytest.skip("the second layout has no caps and its queries' usual scale")
    tokens = torch.randint(0, hf.config.vocab_size, (2, 20))
    projection = ours.decoder.layers[0].self_attn.q_proj
    with torch.no_grad():
        expected = hf(tokens).logits
        for change in (dict(attention_softcap=None), dict(logit_softcap=None)):
            changed = type(ours)(c.replace(**change)).eval()
            changed.load_state_dict(ours.state_dict())
            assert not torch.allclose(changed(tokens), expected, atol=1e-2), change
        projection.weight /= (16 / 24) ** 0.5
        assert not torch.allclose(ours(tokens), expected, atol=1e-2)
        projection.weight *= (16 / 24) ** 0.5
        torch.testing.assert_close(ours(tokens), expected, atol=ATOL, rtol=1e-5)


def test_greedy_generation_through_the_cache_matches_transformers(imported, monkeypatch):
    """40 tokens after left-padded prompts: the sliding layers' window (6 keys) rolls
    while the full layers' caches grow, every score capped."""
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 40, monkeypatch)


def test_perplexity_uses_the_capped_logits(imported, tmp_path):
    hf, _, out = imported
    assert_same_perplexity(hf, out, tmp_path)


def test_an_import_exports_back_to_gemma2(imported, tmp_path):
    """export hf writes Gemma2ForCausalLM (each layer's kind, one rotary base, both caps,
    the norms' 1 + w), computing transformers' logits over more tokens than the window;
    the folded query scale leaves query_pre_attn_scalar at head_dim."""
    from transduce.export import export_hf

    hf, ours, out = imported
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        export_hf(out, tmp_path / "hf")).eval()
    assert type(theirs).__name__ == "Gemma2ForCausalLM"
    assert theirs.config.layer_types == hf.config.layer_types
    assert theirs.config.query_pre_attn_scalar == ours.config.head_dim
    tokens = torch.randint(0, hf.config.vocab_size, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, hf(tokens).logits, atol=ATOL,
                                   rtol=1e-5)


def test_an_import_exports_to_onnx(imported, tmp_path):
    hf, _, out = imported
    assert_same_onnx_logits(hf, out, tmp_path, atol=ATOL)


def test_ctranslate2_which_caps_no_scores_is_refused_by_name(imported, tmp_path):
    from transduce.export import export_ctranslate2
    from transduce.export.common import ExportError

    _, ours, out = imported
    if ours.config.attention_softcap is None:
        pytest.skip("the second layout has no caps")
    with pytest.raises(ExportError, match="attention_softcap=0.8 \\(the format does not "
                                          "soft-cap them\\); logit_softcap=3.0"):
        export_ctranslate2(out, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()


@pytest.fixture(scope="module")
def small_hf(gemma_tokenizer, tmp_path_factory):  # noqa: F811 (the fixture)
    directory = tmp_path_factory.mktemp("small2") / "hf"
    gemma2_checkpoint(directory, gemma_tokenizer, hidden_size=16, intermediate_size=24,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                      max_position_embeddings=32, attn_logit_softcapping=0.5,
                      final_logit_softcapping=2.0)
    return directory


def test_a_transformers_4_config_imports_as_the_same_model(small_hf, tmp_path):
    """Before transformers 5: no layer_types (the even layers slide), rope_theta, and
    use_bidirectional_attention null."""
    def older(values):
        values.pop("layer_types")
        values.pop("rope_parameters")
        values.update(rope_theta=20000.0, use_bidirectional_attention=None)
    directory = damaged(small_hf, tmp_path, config=older)
    ours = load_model(import_gemma(directory, tmp_path / "out"))
    assert (ours.config.full_attention_layers, ours.config.rope_base) == ((1,), 20000.0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("change,message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"attn_logit_softcapping": 0}, "attention_softcap=0: must be a positive number"),
    ({"final_logit_softcapping": "30"}, "logit_softcap='30': must be a positive number"),
    ({"query_pre_attn_scalar": -8}, "query_pre_attn_scalar=-8: must be a positive number"),
    ({"sliding_window": 1}, "sliding_window=1: must be an integer of at least 2"),
])
def test_refuses_what_it_cannot_reproduce(small_hf, tmp_path, change, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(change))
    assert_refused(import_gemma, directory, tmp_path, "config.json", message)


def test_command_line_import(small_hf, tmp_path, capsys):
    assert main(["import", "hf-gemma", str(small_hf), "--out", str(tmp_path / "out")]) == 0
    assert "2 layers, d_model 16, 2 heads, 1 key/value heads" in capsys.readouterr().out


def test_generator_continues_a_prompt_as_transformers_does(imported):
    """Generator (its decoding copy, whose written-out step leaves capped scores to the
    modules) gives generate's greedy tokens."""
    from transduce.decode.generate import Generator, PromptIds

    hf, _, out = imported
    generator = Generator.load(out)
    ids = [generator.tokenizer.bos_id, 11, 25, 40, 7, 9, 30]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    row, = generator.generate_rows([PromptIds(ids)], max_new_tokens=20)
    assert row.tokens == expected[:len(row.tokens)]
    assert len(row.tokens) == 20 or expected[len(row.tokens)] in generator.end_ids


def test_cached_steps_follow_the_full_pass(imported):
    """Each step's logits through the caches are the full pass's: float32's to rounding,
    int8's to its quantization (a mean error of 0.01-0.03 here, where leaving the caps
    out of its steps gives 0.47): its steps attend through the dequantized keys then,
    capping their scores."""
    _, ours, _ = imported
    tokens = torch.randint(3, ours.config.tgt_vocab_size, (2, 16))

    def steps(cache_dtype):
        state = ours.prefill(tokens[:, :4], 16, cache_dtype=cache_dtype)
        return torch.cat([ours.decode_step(tokens[:, i:i + 1], state)
                          for i in range(3, 16)], dim=1)
    with torch.no_grad():
        full = ours(tokens)[:, 3:]
        torch.testing.assert_close(steps(torch.float32), full, atol=1e-4, rtol=1e-5)
        error = (steps(torch.int8) - full).abs()
    assert error.mean() < 0.05 and error.max() < 0.5


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_peft_adapter_of_the_directory_merges_into_the_import(imported, tmp_path):
    """The query scale folded into q_proj's rows at the import (noted in its origin)
    scales the update of q_proj too."""
    _, ours, out = imported
    assert_peft_adapter_merges(ours, out, tmp_path, atol=ATOL)
