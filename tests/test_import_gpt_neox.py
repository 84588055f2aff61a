"""Hugging Face GPT-NeoX (Pythia) -> our checkpoint: the imported model computes what
transformers.GPTNeoXForCausalLM computes (logits, left-padded batches, greedy generation
through the cache, perplexity) with parallel residuals or not and rotary positions on a
quarter of each head or all of it; configs of transformers 4 (rotary_pct) read alike;
the exports to transformers, CTranslate2 and ONNX compute it again, and PEFT's adapters go
both ways; what we cannot reproduce is refused by name with nothing written."""

import json

import pytest
import torch

from tests.foreign_checkpoints import assert_a_lora_run_goes_to_peft, \
    assert_peft_adapter_merges, assert_refused, assert_same_ctranslate2_tokens, \
    assert_same_greedy_tokens, assert_same_logits, assert_same_onnx_logits, \
    assert_same_perplexity, assert_the_command_generates_as_transformers, damaged, \
    saved_with_drawn_norms, tokenizer_size
from tests.train.test_lm import counting  # noqa: F401 - a fixture
from transduce import checkpoint
from transduce.cli import main
from transduce.importers import import_gpt_neox
from transduce.model import DecoderOnly, load_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SAMPLES = ["Hello world!", "  leading and trailing spaces  ", "El niño comió café.", ""]


def hf_checkpoint(directory, tokenizer_dir, seed=0, **config):
    """A random GPTNeoXForCausalLM, its LayerNorms and biases drawn so that each counts,
    saved with the tokenizer's files."""
    torch.manual_seed(seed)
    hf_config = transformers.GPTNeoXConfig(vocab_size=tokenizer_size(tokenizer_dir) + 8,
                                           bos_token_id=0, eos_token_id=0,
                                           max_position_embeddings=64,
                                           initializer_range=0.2, **config)
    return saved_with_drawn_norms(transformers.GPTNeoXForCausalLM(hf_config).eval(),
                                  directory, tokenizer_dir, norms=("layernorm", "layer_norm"))


# Pythia's layout (parallel residuals, a quarter of each head rotated, untied output)
# and the other one (one sub-layer after the other, every feature rotated, tied).
CONFIGS = [dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, rotary_pct=0.25, seed=6),
           dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=96, rotary_pct=1.0, rotary_emb_base=500,
                use_parallel_residual=False, tie_word_embeddings=True, hidden_act="gelu_fast",
                layer_norm_eps=1e-6, seed=1)]


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=lambda i: f"config{i}")
def imported(request, neox_tokenizer, tmp_path_factory):
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", neox_tokenizer, **dict(CONFIGS[request.param]))
    out = import_gpt_neox(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    assert isinstance(ours, DecoderOnly)
    c, parallel = ours.config, hf.config.use_parallel_residual
    assert (c.positional, c.parallel_residual, c.rotary_dims) == \
        ("rotary", parallel, 4 if parallel else None)       # 16-wide heads, a quarter turned
    assert c.tie_embeddings == ("none" if parallel else "all")
    assert_same_logits(hf, ours, atol=2e-5)


def test_greedy_generation_through_the_cache_matches_transformers(imported, monkeypatch):
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 30, monkeypatch)


def test_perplexity_uses_the_bos_and_eos_of_the_tokenizer(imported, tmp_path):
    hf, _, out = imported
    assert_same_perplexity(hf, out, tmp_path)


def test_tokenizer_ids_equal_the_fast_tokenizer(imported, neox_tokenizer):
    ours = checkpoint.load_tokenizer(imported[2])
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(neox_tokenizer / "tokenizer.json"), bos_token="<|endoftext|>",
        eos_token="<|endoftext|>")
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (0, 0, 0)    # eos pads
    assert not ours.prepend_bos
    assert ours.encode(SAMPLES) == [reference(text)["input_ids"] for text in SAMPLES]


def test_the_command_generates_what_transformers_generates(imported, capsys):
    hf, _, out = imported
    assert_the_command_generates_as_transformers(hf, out, "hf-gpt-neox", capsys, pad_id=0)


@pytest.fixture(scope="module")
def small_hf(neox_tokenizer, tmp_path_factory):
    """One small GPT-NeoX directory, copied and damaged by each bad-input test."""
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, neox_tokenizer, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=32, rotary_pct=0.25)
    return directory


def test_a_transformers_4_config_reads_as_transformers_5_s(small_hf, tmp_path):
    """rotary_pct and rotary_emb_base, not rope_parameters: the same model."""
    def older(values):
        rope = values.pop("rope_parameters")
        values |= {"rotary_pct": rope["partial_rotary_factor"],
                   "rotary_emb_base": rope["rope_theta"], "rope_scaling": None}

    directory = damaged(small_hf, tmp_path, config=older)
    assert "rope_parameters" not in json.loads((directory / "config.json").read_text())
    old = load_model(import_gpt_neox(directory, tmp_path / "old"))
    new = load_model(import_gpt_neox(small_hf, tmp_path / "new"))
    assert old.config == new.config and old.config.rotary_dims == 4
    for (name, a), b in zip(old.state_dict().items(), new.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, "model_type='gpt2'; only 'gpt_neox'"),
    ({"attention_bias": False}, "attention_bias=false is not supported"),
    ({"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000}},
     "rope_parameters.rope_type='dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0,
                          "rope_theta": 10000}},
     "partial_rotary_factor=0: must be a fraction of a head's features"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.2,
                          "rope_theta": 10000}},
     "rotary_dims=3: must be an even number"),
    ({"num_attention_heads": 3}, "d_model=32 is not divisible by num_heads=3"),
    ({"eos_token_id": 5}, "eos_token_id=5 but the tokenizer's eos token '<|endoftext|>' is 0"),
])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, change, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(change))
    assert_refused(import_gpt_neox, directory, tmp_path, message)


def test_refuses_a_missing_or_unknown_weight(small_hf, tmp_path):
    def renamed(tensors):
        tensors["gpt_neox.layers.0.attention.extra.weight"] = \
            tensors.pop("gpt_neox.layers.0.attention.dense.weight")

    directory = damaged(small_hf, tmp_path, weights=renamed)
    assert_refused(import_gpt_neox, directory, tmp_path,
                   "missing weight 'layers.0.attention.dense.weight'")


def test_the_hf_export_is_gpt_neox_again(imported, tmp_path):
    """export hf writes GPTNeoXForCausalLM, each head's query and key rows back in
    GPT-NeoX's order and q, k, v fused head by head: the same weights, exactly."""
    hf, _, out = imported
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "GPTNeoXForCausalLM"
    originals = hf.state_dict()
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(tensor, originals[name], rtol=0, atol=0, msg=name)
    assert theirs.config.use_parallel_residual == hf.config.use_parallel_residual


def test_the_ctranslate2_export_generates_what_transformers_generates(imported, tmp_path):
    """CTranslate2's parallel residuals and rotary_dim are GPT-NeoX's: the same greedy
    tokens."""
    hf, _, out = imported
    assert_same_ctranslate2_tokens(hf, out, tmp_path, pad_id=0)


def test_the_onnx_export_computes_transformers_logits(imported, tmp_path):
    """Parallel residuals and partial rotary positions in the graph: left-padded rows
    too."""
    hf, _, out = imported
    assert_same_onnx_logits(hf, out, tmp_path, atol=2e-5)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_peft_adapter_merges_into_the_import(imported, tmp_path):
    """PEFT's LoRA on GPT-NeoX's fused query_key_value (each head's query, key and value
    rows together, the query and key rows in its rotary order), dense and MLP."""
    _, ours, out = imported
    assert_peft_adapter_merges(ours, out, tmp_path, atol=1e-4, modules=[
        "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"])


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_lora_run_goes_to_peft(small_hf, counting, tmp_path):  # noqa: F811
    """`export peft` of a LoRA run on the import: q, k and v's adapters one of rank 3r on
    query_key_value, B's rows head by head and in GPT-NeoX's rotary order."""
    assert_a_lora_run_goes_to_peft(small_hf, import_gpt_neox, counting, tmp_path)
