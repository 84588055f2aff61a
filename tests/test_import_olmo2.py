"""Hugging Face OLMo 2 -> our checkpoint: the imported model computes what
transformers.Olmo2ForCausalLM computes (logits, left-padded batches, greedy generation
through the cache) with its norms on the sub-layers' outputs alone and of the queries
and keys over all heads, grouped-query attention or not; the exports to transformers
and ONNX compute it again, CTranslate2's refuses it by name, PEFT's adapters go both
ways; what we cannot reproduce is refused by name with nothing written."""

import pytest
import torch

from tests.foreign_checkpoints import assert_a_lora_run_goes_to_peft, \
    assert_peft_adapter_merges, assert_refused, assert_same_greedy_tokens, \
    assert_same_logits, assert_same_onnx_logits, damaged, saved_with_drawn_norms
from transduce.cli import main
from transduce.export.common import ExportError
from transduce.importers import import_olmo2
from transduce.model import DecoderOnly, load_model
from tests.train.test_lm import counting  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def hf_checkpoint(directory, tokenizer_dir, seed=0, **config):
    """A random Olmo2ForCausalLM saved with save_pretrained, its norms' gains drawn
    around 1 so that each counts, with the tokenizer."""
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    torch.manual_seed(seed)
    hf_config = transformers.Olmo2Config(vocab_size=vocab.get_vocab_size(), bos_token_id=0,
                                         eos_token_id=0, pad_token_id=1,
                                         max_position_embeddings=64, initializer_range=0.2,
                                         **config)
    return saved_with_drawn_norms(transformers.Olmo2ForCausalLM(hf_config).eval(),
                                  directory, tokenizer_dir, norms=("norm",))   # no biases


CONFIGS = [dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, seed=3),
           dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, tie_word_embeddings=True, rope_theta=500.0, seed=1)]


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=lambda i: f"config{i}")
def imported(request, neox_tokenizer, tmp_path_factory):
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", neox_tokenizer, **dict(CONFIGS[request.param]))
    out = import_olmo2(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    assert isinstance(ours, DecoderOnly)
    c = ours.config
    assert (c.sandwich_norm, c.input_norms, c.qk_norm, c.qk_norm_across_heads) == \
        (True, False, True, True)
    assert c.kv_heads == hf.config.num_key_value_heads
    assert_same_logits(hf, ours, atol=2e-5)


def test_greedy_generation_through_the_cache_matches_transformers(imported, monkeypatch):
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 30, monkeypatch)


def test_the_hf_export_is_olmo2_again(imported, tmp_path):
    """export hf writes Olmo2ForCausalLM: the same weights, exactly."""
    hf, _, out = imported
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "Olmo2ForCausalLM"
    originals = hf.state_dict()
    assert set(theirs.state_dict()) == set(originals)
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(tensor, originals[name], rtol=0, atol=0, msg=name)


def test_the_onnx_export_computes_transformers_logits(imported, tmp_path):
    hf, _, out = imported
    assert_same_onnx_logits(hf, out, tmp_path, atol=2e-5)


def test_the_ctranslate2_export_refuses_its_norms_by_name(imported, tmp_path):
    pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2

    with pytest.raises(ExportError, match="input_norms=False .*; qk_norm_across_heads=True"):
        export_ctranslate2(imported[2], tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_peft_adapter_merges_into_the_import(imported, tmp_path):
    """PEFT's LoRA on OLMo 2's Llama names; its norms of the whole query and key
    projections stay as imported, after the adapted projections."""
    _, ours, out = imported
    assert_peft_adapter_merges(ours, out, tmp_path, atol=1e-4)


@pytest.fixture(scope="module")
def small_hf(neox_tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, neox_tokenizer, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=32)
    return directory


@pytest.mark.parametrize("change,message", [
    ({"model_type": "olmo"}, "model_type='olmo'; only 'olmo2'"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000}},
     "rope_parameters.rope_type='yarn' is not supported"),
])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, change, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(change))
    assert_refused(import_olmo2, directory, tmp_path, message)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_lora_run_goes_to_peft(small_hf, counting, tmp_path):  # noqa: F811
    """`export peft` of a LoRA run on the import: PEFT puts it on Olmo2ForCausalLM."""
    assert_a_lora_run_goes_to_peft(small_hf, import_olmo2, counting, tmp_path)
