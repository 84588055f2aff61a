"""Hugging Face Phi (phi-1, 1.5, 2) -> our checkpoint: the imported model computes what
transformers.PhiForCausalLM computes (logits, left-padded batches, greedy generation
through the cache, perplexity) with its parallel layers over one norm, rotary positions
on part of each head and the output's bias, and the other layout its config allows
(norms of the queries and keys, grouped heads, half of each head rotated, tied output); the
exports to transformers, CTranslate2 and ONNX compute it again, and PEFT's adapters go both
ways; what we cannot reproduce is refused by name with nothing written."""

import pytest
import torch

from tests.foreign_checkpoints import assert_a_lora_run_goes_to_peft, \
    assert_peft_adapter_merges, assert_refused, assert_same_ctranslate2_tokens, \
    assert_same_greedy_tokens, assert_same_logits, assert_same_onnx_logits, \
    assert_same_perplexity, assert_the_command_generates_as_transformers, damaged, \
    saved_with_drawn_norms, tokenizer_size
from transduce.cli import main
from transduce.export import ExportError, export_ctranslate2
from transduce.importers import import_phi
from transduce.model import DecoderOnly, load_model
from tests.train.test_lm import counting  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")


def hf_checkpoint(directory, tokenizer_dir, seed=0, **config):
    """A random PhiForCausalLM, its LayerNorms and biases (the output's among them)
    drawn so that each counts, saved with the tokenizer's files."""
    torch.manual_seed(seed)
    hf_config = transformers.PhiConfig(vocab_size=tokenizer_size(tokenizer_dir) + 8,
                                       bos_token_id=0, eos_token_id=0,
                                       max_position_embeddings=64, initializer_range=0.2,
                                       **config)
    return saved_with_drawn_norms(transformers.PhiForCausalLM(hf_config).eval(), directory,
                                  tokenizer_dir, norms=("layernorm",))


# phi-2's layout (0.4 of each head rotated, untied output), and the other one its
# config allows (queries and keys normalized, grouped heads, half of each head turned, tied).
CONFIGS = [dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=80, partial_rotary_factor=0.4, seed=6),
           dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, partial_rotary_factor=0.5,
                rope_theta=500.0, qk_layernorm=True, tie_word_embeddings=True,
                hidden_act="gelu", layer_norm_eps=1e-6, seed=1)]


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=lambda i: f"config{i}")
def imported(request, neox_tokenizer, tmp_path_factory):
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", neox_tokenizer, **dict(CONFIGS[request.param]))
    out = import_phi(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    assert isinstance(ours, DecoderOnly)
    c, phi2 = ours.config, not hf.config.qk_layernorm
    assert (c.parallel_residual, c.shared_norm, c.output_bias, c.qk_norm) == \
        (True, True, True, not phi2)
    assert c.rotary_dims == (8 if phi2 else 6)       # 0.4 of 20-wide heads, 0.5 of 12
    assert c.tie_embeddings == ("none" if phi2 else "all")
    assert not any(".norm3." in name for name in ours.state_dict())
    assert_same_logits(hf, ours, atol=2e-5)


def test_greedy_generation_through_the_cache_matches_transformers(imported, monkeypatch):
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 30, monkeypatch)


def test_perplexity_uses_the_bos_and_eos_of_the_tokenizer(imported, tmp_path):
    hf, _, out = imported
    assert_same_perplexity(hf, out, tmp_path)


def test_the_command_generates_what_transformers_generates(imported, capsys):
    hf, _, out = imported
    assert_the_command_generates_as_transformers(hf, out, "hf-phi", capsys, pad_id=0)


def test_fine_tuning_trains_the_output_bias_and_exports_as_phi(imported, counting,  # noqa: F811
                                                              tmp_path):
    """`train --init` of the import: Phi's lm_head bias is a parameter the fused loss
    reaches (Marian's final_logits_bias stays fixed), and the tuned model exports as
    PhiForCausalLM computing our logits."""
    _, ours, out = imported
    run = tmp_path / "run"
    assert main(["train", "--data", str(counting), "--out", str(run), "--init", str(out),
                 "--max-steps", "4", "--max-tokens", "128", "--dtype", "float32"]) == 0
    tuned = load_model(run)
    assert not torch.equal(tuned.output_proj.bias, ours.output_proj.bias)
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(2, ours.config.tgt_vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(tuned(tokens), theirs(tokens).logits, atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def small_hf(neox_tokenizer, tmp_path_factory):
    """One small Phi directory, copied and damaged by each bad-input test."""
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, neox_tokenizer, hidden_size=40, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=40, partial_rotary_factor=0.4)
    return directory


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt_neox"}, "model_type='gpt_neox'; only 'phi'"),
    ({"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000}},
     "rope_parameters.rope_type='dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25,
                          "rope_theta": 10000}},
     "rotary_dims=5: must be an even number"),
    ({"eos_token_id": 5}, "eos_token_id=5 but the tokenizer's eos token '<|endoftext|>' is 0"),
])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, change, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(change))
    assert_refused(import_phi, directory, tmp_path, message)


@pytest.mark.parametrize("weight", ["lm_head.bias", "model.layers.0.self_attn.dense.bias"])
def test_refuses_a_missing_weight(small_hf, tmp_path, weight):
    def without(tensors):
        del tensors[weight]

    directory = damaged(small_hf, tmp_path, weights=without)
    assert_refused(import_phi, directory, tmp_path,
                   f"missing weight {weight.removeprefix('model.')!r}")


def test_the_hf_export_is_phi_again(imported, tmp_path):
    """export hf writes PhiForCausalLM, each head's query and key rows (and their norms)
    back in Phi's order: the same weights, exactly."""
    hf, _, out = imported
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "PhiForCausalLM"
    originals = hf.state_dict()
    assert theirs.state_dict().keys() == originals.keys()
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(tensor, originals[name], rtol=0, atol=0, msg=name)


def test_the_ctranslate2_export_generates_what_transformers_generates(imported, tmp_path):
    """CTranslate2's shared_layer_norm and the projection's bias are Phi's: the same
    greedy tokens. It normalizes queries and keys by RMSNorm alone: refused by name."""
    hf, _, out = imported
    if not hf.config.qk_layernorm:
        assert_same_ctranslate2_tokens(hf, out, tmp_path, pad_id=0)
        return
    with pytest.raises(ExportError, match="qk_norm=True with norm='layer'"):
        export_ctranslate2(out, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()


def test_the_onnx_export_computes_transformers_logits(imported, tmp_path):
    """One norm for both sub-layers and the output's bias in the graph: left-padded rows
    too."""
    hf, _, out = imported
    assert_same_onnx_logits(hf, out, tmp_path, atol=2e-5)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_peft_adapter_merges_into_the_import(imported, tmp_path):
    """PEFT's LoRA on Phi's names (dense, fc1, fc2), the query and key rows in its rotary
    order."""
    _, ours, out = imported
    assert_peft_adapter_merges(ours, out, tmp_path, atol=1e-4, modules=[
        "q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"])


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_lora_run_goes_to_peft(small_hf, counting, tmp_path):  # noqa: F811
    """`export peft` of a LoRA run on the import: B's query and key rows in Phi's rotary
    order."""
    assert_a_lora_run_goes_to_peft(small_hf, import_phi, counting, tmp_path)
