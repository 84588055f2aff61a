"""Hugging Face StableLM -> our checkpoint: the imported model computes what
transformers.StableLmForCausalLM computes (logits, left-padded batches, greedy
generation through the cache) with query, key and value biases or none, grouped-query
attention, rotary positions on a quarter of each head or all of it, and StableLM 2 12B's
parallel layers over one norm with norms of each head's queries and keys; the exports to
transformers, CTranslate2 (but the 12B's norms, refused) and ONNX compute it again, and
PEFT's adapters go both ways;
what we cannot reproduce is refused by name with nothing written. (The tokenizer's
reading is GPT-NeoX's: test_import_gpt_neox.py.)"""

import pytest
import torch

from tests.foreign_checkpoints import assert_a_lora_run_goes_to_peft, \
    assert_peft_adapter_merges, assert_refused, assert_same_ctranslate2_tokens, \
    assert_same_greedy_tokens, assert_same_logits, assert_same_onnx_logits, damaged, \
    saved_with_drawn_norms, tokenizer_size
from tests.train.test_lm import counting  # noqa: F401 - a fixture
from transduce.cli import main
from transduce.importers import import_stablelm
from transduce.model import DecoderOnly, load_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def hf_checkpoint(directory, tokenizer_dir, seed=0, **config):
    """A random StableLmForCausalLM, its LayerNorms and biases drawn so that each counts,
    saved with the tokenizer's files."""
    torch.manual_seed(seed)
    hf_config = transformers.StableLmConfig(vocab_size=tokenizer_size(tokenizer_dir),
                                            bos_token_id=0, eos_token_id=0,
                                            max_position_embeddings=64,
                                            initializer_range=0.2, **config)
    return saved_with_drawn_norms(transformers.StableLmForCausalLM(hf_config).eval(),
                                  directory, tokenizer_dir, norms=("norm",))


# StableLM 2's layout (q, k, v biases, two key/value heads, a quarter of each head turned,
# untied), stablelm-3b's (no biases, full heads, every feature turned here, tied) and
# StableLM 2 12B's (parallel over one norm, each head's queries and keys normalized with
# a gain of its own; no biases, two key/value heads, a quarter turned).
CONFIGS = [dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, use_qkv_bias=True,
                partial_rotary_factor=0.25, seed=3),
           dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=64, partial_rotary_factor=1.0,
                tie_word_embeddings=True, rope_theta=500.0, seed=1),
           dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, partial_rotary_factor=0.25,
                use_parallel_residual=True, qk_layernorm=True, seed=5)]


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=lambda i: f"config{i}")
def imported(request, neox_tokenizer, tmp_path_factory):
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", neox_tokenizer, **dict(CONFIGS[request.param]))
    out = import_stablelm(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    assert isinstance(ours, DecoderOnly)
    c, biased, twelve = ours.config, hf.config.use_qkv_bias, hf.config.qk_layernorm
    assert (c.norm, c.gated_ffn, c.qkv_bias, c.rotary_dims, c.kv_heads) == \
        ("layer", True, biased, None if hf.config.tie_word_embeddings else 4,
         4 if hf.config.tie_word_embeddings else 2)
    assert (c.parallel_residual, c.shared_norm, c.qk_norm, c.qk_norm_per_head) == \
        (twelve,) * 4
    if twelve:
        assert ours.decoder.layers[0].self_attn.k_norm.weight.shape == (2, 16)
    assert_same_logits(hf, ours, atol=2e-5)


def test_greedy_generation_through_the_cache_matches_transformers(imported, monkeypatch):
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 30, monkeypatch)


def test_the_hf_export_is_stablelm_again(imported, tmp_path):
    """export hf writes StableLmForCausalLM, each head's query and key rows back in its
    order: the same weights, exactly."""
    hf, _, out = imported
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "StableLmForCausalLM"
    originals = hf.state_dict()
    assert set(theirs.state_dict()) == set(originals)
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(tensor, originals[name], rtol=0, atol=0, msg=name)


def test_the_ctranslate2_export_generates_what_transformers_generates(imported, tmp_path):
    """(CTranslate2 has no gain per head for its norms of the queries and keys: the 12B's
    are refused by name.)"""
    hf, _, out = imported
    if not hf.config.qk_layernorm:
        assert_same_ctranslate2_tokens(hf, out, tmp_path, pad_id=0)
        return
    from transduce.export import ExportError, export_ctranslate2

    with pytest.raises(ExportError, match="qk_norm_per_head=True"):
        export_ctranslate2(out, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()


def test_the_onnx_export_computes_transformers_logits(imported, tmp_path):
    hf, _, out = imported
    assert_same_onnx_logits(hf, out, tmp_path, atol=2e-5)


@pytest.fixture(scope="module")
def small_hf(neox_tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, neox_tokenizer, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, intermediate_size=32)
    return directory


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama"}, "model_type='llama'; only 'stablelm'"),
    ({"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000}},
     "rope_parameters.rope_type='yarn' is not supported"),
])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, change, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(change))
    assert_refused(import_stablelm, directory, tmp_path, message)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_peft_adapter_merges_into_the_import(imported, tmp_path):
    """PEFT's LoRA on Llama's names, the query and key rows in StableLM's rotary order."""
    _, ours, out = imported
    assert_peft_adapter_merges(ours, out, tmp_path, atol=1e-4)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_lora_run_goes_to_peft(small_hf, counting, tmp_path):  # noqa: F811
    """`export peft` of a LoRA run on the import: B's query and key rows in StableLM's
    rotary order."""
    assert_a_lora_run_goes_to_peft(small_hf, import_stablelm, counting, tmp_path)


def test_qk_norm_per_head_is_a_decoder_s_norm_of_each_head():
    from transduce.config import ConfigError, ModelConfig

    for fields in ({"arch": "decoder"}, {"arch": "decoder", "qk_norm": True,
                                         "qk_norm_across_heads": True},
                   {"arch": "transformer", "qk_norm": True}):
        with pytest.raises(ConfigError, match="qk_norm_per_head=True"):
            ModelConfig(qk_norm_per_head=True, **fields)
