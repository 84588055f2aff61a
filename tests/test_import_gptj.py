"""Hugging Face GPT-J and CodeGen -> our checkpoint: the imported model computes what
transformers.GPTJForCausalLM and CodeGenForCausalLM compute (logits, left-padded batches,
greedy generation through the cache, perplexity) with their parallel layers over one
norm, bias-free attention, rotary positions in adjacent pairs on part of each head and
the output's bias; the exports to transformers (as GPT-J), CTranslate2 and ONNX compute
it again, PEFT's adapters go both ways, and what we cannot reproduce is refused by name
with nothing written."""

import pytest
import torch

from tests.foreign_checkpoints import assert_a_lora_run_goes_to_peft, \
    assert_peft_adapter_merges, assert_refused, assert_same_ctranslate2_tokens, \
    assert_same_greedy_tokens, assert_same_logits, assert_same_onnx_logits, \
    assert_same_perplexity, assert_the_command_generates_as_transformers, damaged, \
    saved_with_drawn_norms, tokenizer_size
from transduce.cli import main
from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.hf_tokenizer import TokenizerError
from transduce.importers import ForeignCheckpointError, import_gptj
from transduce.importers.hf_gptj import codegen_split
from transduce.model import DecoderOnly, build_model, load_model
from tests.train.test_lm import counting  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")


def hf_checkpoint(directory, tokenizer_dir, kind="gptj", seed=0, **config):
    """A random GPTJForCausalLM or CodeGenForCausalLM, its LayerNorms and biases (the
    output's among them) drawn so that each counts, saved with the tokenizer's files."""
    torch.manual_seed(seed)
    names = {"gptj": ("GPTJConfig", "GPTJForCausalLM"),
             "codegen": ("CodeGenConfig", "CodeGenForCausalLM")}[kind]
    if "vocab_size" not in config:
        config["vocab_size"] = tokenizer_size(tokenizer_dir) + 8
    hf_config = getattr(transformers, names[0])(
        bos_token_id=0, eos_token_id=0, n_positions=64, initializer_range=0.2, **config)
    model = getattr(transformers, names[1])(hf_config).eval()
    return saved_with_drawn_norms(model, directory, tokenizer_dir, norms=("ln_",))


# GPT-J-6B's layout (part of each head rotated: a third here, a quarter in GPT-J-6B;
# untied output), and CodeGen's (its fused projection in four blocks) with half of each
# head rotated, tied, exact GELU.
CONFIGS = [dict(kind="gptj", n_embd=48, n_layer=2, n_head=4, rotary_dim=4, seed=6),
           dict(kind="codegen", n_embd=64, n_layer=2, n_head=4, n_inner=96, rotary_dim=8,
                tie_word_embeddings=True, activation_function="gelu",
                layer_norm_epsilon=1e-6, seed=1)]


@pytest.fixture(scope="module", params=range(len(CONFIGS)),
                ids=lambda i: CONFIGS[i]["kind"])
def imported(request, neox_tokenizer, tmp_path_factory):
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", neox_tokenizer, **dict(CONFIGS[request.param]))
    out = import_gptj(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    assert isinstance(ours, DecoderOnly)
    c, gptj = ours.config, hf.config.model_type == "gptj"
    assert (c.parallel_residual, c.shared_norm, c.output_bias, c.attention_bias) == \
        (True, True, True, False)
    assert c.rotary_dims == (4 if gptj else 8)        # of 12- and 16-wide heads
    assert c.tie_embeddings == ("none" if gptj else "all")
    assert c.d_ff == (4 * 48 if gptj else 96)
    names = ours.state_dict()
    assert not any(".norm3." in name or ("_attn." in name and name.endswith(".bias"))
                   for name in names)
    assert "decoder.layers.0.ffn.linear1.bias" in names
    assert_same_logits(hf, ours, atol=2e-5)


def test_greedy_generation_through_the_cache_matches_transformers(imported, monkeypatch):
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 30, monkeypatch)


def test_perplexity_uses_the_bos_and_eos_of_the_tokenizer(imported, tmp_path):
    hf, _, out = imported
    assert_same_perplexity(hf, out, tmp_path)


def test_the_command_generates_what_transformers_generates(imported, capsys):
    hf, _, out = imported
    command = "hf-gptj" if hf.config.model_type == "gptj" else "hf-codegen"
    assert_the_command_generates_as_transformers(hf, out, command, capsys, pad_id=0)


def test_fine_tuning_keeps_the_attention_bias_free_and_exports_as_gptj(
        imported, counting, tmp_path):  # noqa: F811
    """`train --init` of the import trains the output's bias and the feed-forward
    networks' and adds none to the attention; the tuned model exports as GPTJForCausalLM
    computing our logits (a CodeGen import too: the same layers)."""
    _, ours, out = imported
    run = tmp_path / "run"
    assert main(["train", "--data", str(counting), "--out", str(run), "--init", str(out),
                 "--max-steps", "4", "--max-tokens", "128", "--dtype", "float32"]) == 0
    tuned = load_model(run)
    assert not torch.equal(tuned.output_proj.bias, ours.output_proj.bias)
    assert tuned.decoder.layers[0].self_attn.q_proj.bias is None
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "GPTJForCausalLM"
    tokens = torch.randint(2, ours.config.tgt_vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(tuned(tokens), theirs(tokens).logits, atol=2e-5, rtol=1e-5)


def test_the_hf_export_is_gptj_with_the_original_s_weights(imported, tmp_path):
    """export hf writes GPTJForCausalLM, each head's query and key rows back in GPT-J's
    adjacent pairs: the same weights, exactly (CodeGen's fused rows as GPT-J's q, k
    and v)."""
    hf, _, out = imported
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    originals = hf.state_dict()
    for name in [name for name in originals if name.endswith("attn.qkv_proj.weight")]:
        fused = originals.pop(name)
        for part, rows in zip("qkv", codegen_split(fused, hf.config.n_embd)):
            originals[name.replace("qkv_proj", f"{part}_proj")] = rows
    assert theirs.state_dict().keys() == originals.keys()
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(tensor, originals[name], rtol=0, atol=0, msg=name)


def test_the_ctranslate2_export_generates_what_transformers_generates(imported, tmp_path):
    """CTranslate2's shared_layer_norm, its projections without biases where ours have
    none, and the output's bias: the same greedy tokens."""
    hf, _, out = imported
    assert_same_ctranslate2_tokens(hf, out, tmp_path, pad_id=0)


def test_the_onnx_export_computes_transformers_logits(imported, tmp_path):
    hf, _, out = imported
    assert_same_onnx_logits(hf, out, tmp_path, atol=2e-5)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_peft_adapter_merges_into_the_import(imported, tmp_path):
    """PEFT's LoRA on GPT-J's names (q_proj, k_proj, v_proj, out_proj, fc_in, fc_out),
    the query and key rows in its adjacent pairs; on CodeGen's fused qkv_proj, refused
    by name."""
    hf, ours, out = imported
    if hf.config.model_type == "gptj":
        assert_peft_adapter_merges(ours, out, tmp_path, atol=1e-4, modules=[
            "q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"])
        return
    with pytest.raises(ForeignCheckpointError, match="qkv_proj"):
        assert_peft_adapter_merges(ours, out, tmp_path, atol=1e-4, modules=["qkv_proj"])
    assert not (tmp_path / "merged").exists()


@pytest.fixture(scope="module")
def small_hf(neox_tokenizer, tmp_path_factory):
    """One small GPT-J directory, copied and damaged by each bad-input test."""
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, neox_tokenizer, n_embd=32, n_layer=1, n_head=2, rotary_dim=8)
    return directory


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_lora_run_goes_to_peft(small_hf, counting, tmp_path):  # noqa: F811
    """`export peft` of a LoRA run on the import: B's query and key rows in GPT-J's
    adjacent pairs."""
    assert_a_lora_run_goes_to_peft(small_hf, import_gptj, counting, tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt_neox"}, "model_type='gpt_neox'; only 'gptj'"),
    ({"activation_function": "quick_gelu"}, "activation_function='quick_gelu' is not "
                                            "supported"),
    ({"rotary_dim": 5}, "rotary_dim=5: must be an even number of a head's 16 features"),
    ({"rotary_dim": 18}, "rotary_dim=18: must be an even number"),
    ({"rotary_dim": None}, "rotary_dim=None: must be"),
    ({"model_type": "codegen", "n_embd": 34, "n_head": 1}, "n_embd=34: CodeGen's fused"),
    ({"eos_token_id": 5}, "eos_token_id=5 but the tokenizer's eos token '<|endoftext|>' is 0"),
])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, change, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(change))
    assert_refused(import_gptj, directory, tmp_path, message)


@pytest.mark.parametrize("weight", ["lm_head.bias", "transformer.h.0.mlp.fc_in.bias"])
def test_refuses_a_missing_weight(small_hf, tmp_path, weight):
    def without(tensors):
        del tensors[weight]

    directory = damaged(small_hf, tmp_path, weights=without)
    assert_refused(import_gptj, directory, tmp_path,
                   f"missing weight {weight.removeprefix('transformer.')!r}")


def test_refuses_an_attention_bias_gptj_does_not_have(small_hf, tmp_path):
    def with_a_query_bias(tensors):
        tensors["transformer.h.0.attn.q_proj.bias"] = torch.zeros(32)

    directory = damaged(small_hf, tmp_path, weights=with_a_query_bias)
    assert_refused(import_gptj, directory, tmp_path,
                   "unknown weight 'transformer.h.0.attn.q_proj.bias'")


def test_attention_bias_false_drops_the_attention_s_biases_alone():
    """attention_bias=False needs biases to drop, in the Transformer's attention."""
    for fields in ({"bias": False}, {"qkv_bias": True}, {"arch": "rnn-luong"}):
        with pytest.raises(ConfigError, match="attention_bias=False"):
            ModelConfig(attention_bias=False, **fields)
    config = preset("gpt2", src_vocab_size=40, tgt_vocab_size=40, d_model=16, num_heads=2,
                    d_ff=32, num_decoder_layers=1, attention_bias=False)
    layer = build_model(config).decoder.layers[0]
    assert all(getattr(layer.self_attn, name).bias is None
               for name in ("q_proj", "k_proj", "v_proj", "out_proj"))
    assert layer.ffn.linear1.bias is not None and layer.norm1.bias is not None


CODE = ["def add(x, y):\n    return x + y\n", "\tif x:\n\t\tpass  # done\n",
        "class A:\n        def f(self):\n            return 1\n"]


@pytest.fixture(scope="module")
def codegen_vocabulary(tmp_path_factory):
    """GPT-2's vocab.json + merges.txt trained on a little code, with CodeGen's
    added_tokens.json of runs of spaces and tabs after them (no tokenizer.json)."""
    import json

    tokenizers = pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("codegen-vocabulary")
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(CODE * 3, vocab_size=300, min_frequency=1,
                                special_tokens=["<|endoftext|>"], show_progress=False)
    trained.save_model(str(directory))
    size = trained.get_vocab_size()
    runs = [" " * n for n in (8, 4, 2)] + ["\t\t"]
    (directory / "added_tokens.json").write_text(json.dumps(
        {run: size + i for i, run in enumerate(runs)}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
         "tokenizer_class": "GPT2Tokenizer"}))
    return directory


def test_codegen_s_added_tokens_split_code_as_transformers_does(codegen_vocabulary,
                                                                 tmp_path):
    """Without a tokenizer.json, added_tokens.json's runs of whitespace are matched whole
    before BPE, the longest first, at the ids it names: transformers' ids, and back."""
    from transduce import checkpoint

    theirs = transformers.AutoTokenizer.from_pretrained(codegen_vocabulary)
    directory = tmp_path / "hf"
    hf_checkpoint(directory, codegen_vocabulary, kind="codegen", vocab_size=len(theirs) + 8,
                  n_embd=32, n_layer=1, n_head=2, rotary_dim=8)
    tokenizer = checkpoint.load_tokenizer(import_gptj(directory, tmp_path / "ours"))
    text = CODE + ["x =        1\n\t\t\ty"]
    expected = [theirs(line)["input_ids"] for line in text]
    assert tokenizer.encode(text) == expected
    assert any(len(theirs) - 4 <= i for ids in expected for i in ids)   # the runs are used
    assert [tokenizer.decode(ids) for ids in expected] == text


def test_added_tokens_at_other_ids_are_refused(codegen_vocabulary, tmp_path):
    import json

    directory = tmp_path / "hf"
    hf_checkpoint(directory, codegen_vocabulary, kind="codegen", vocab_size=320, n_embd=32,
                  n_layer=1, n_head=2, rotary_dim=8)
    added = json.loads((directory / "added_tokens.json").read_text())
    (directory / "added_tokens.json").write_text(json.dumps(
        {token: index + 1 for token, index in added.items()}))
    with pytest.raises(TokenizerError, match=r"added_tokens.json: '        ' is named id \d+, "
                                        r"but the vocabulary gives it \d+"):
        import_gptj(directory, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
