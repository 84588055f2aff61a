"""Hugging Face GPT-2 -> our checkpoint: the imported model computes what
transformers.GPT2LMHeadModel computes (logits, padded batches, greedy generation), its
tokenizer gives GPT2TokenizerFast's ids, and a checkpoint we cannot reproduce is refused
by name with nothing written."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from transduce import checkpoint
from transduce.cli import main
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.decode.generate import Generator
from tests.foreign_checkpoints import assert_refused, assert_same_greedy_tokens, \
    assert_same_logits, assert_same_perplexity, damaged
from transduce.importers import import_gpt2
from transduce.model import DecoderOnly, load_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

EOT = "<|endoftext|>"
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's a dog's life, isn't it?",
    "El niño comió una manzana en la mañana; ¿verdad que sí? ¡Claro!",
    "Ça coûte 12,50 € — déjà vu, naïve café.",
    "日本語のテキストと中文的句子。", "Emoji: 🎉🙂👍🏽 and more 🎉.",
    "spaces    between\twords\nand\n\nnew lines\r\n", "def f(x): return x ** 2  # code",
]
SAMPLES = ["Hello world!", "  leading and trailing spaces  ", "El niño comió café.",
           "Ünïcödé àéîõü ñ ß", "中文字符和日本語のテキスト", "🎉🙂👍🏽 emoji", "a\tb\nc\r\n\n",
           "multiple     spaces", "don't can't I'm we'll", "¿¡punctuation!?...,;:--()[]{}",
           f"text with {EOT} inside", "zzzzzzzzzzzzzzzz qqq", ""]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE trained here (<|endoftext|> is id 0), saved both ways:
    json/tokenizer.json and pair/vocab.json + pair/merges.txt."""
    root = tmp_path_factory.mktemp("bpe")
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(TRAINING_TEXT * 2, vocab_size=400, min_frequency=1,
                                special_tokens=[EOT], show_progress=False)
    (root / "json").mkdir()
    (root / "pair").mkdir()
    trained.save(str(root / "json" / "tokenizer.json"))
    trained.save_model(str(root / "pair"))
    return root


def hf_checkpoint(directory, tokenizer_dir, **config):
    """A random GPT2LMHeadModel saved with save_pretrained, with the tokenizer's files."""
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_dir.parent / "json" / "tokenizer.json"))
    eot = vocab.token_to_id(EOT)
    torch.manual_seed(config.pop("seed", 0))
    hf_config = transformers.GPT2Config(vocab_size=vocab.get_vocab_size(), bos_token_id=eot,
                                        eos_token_id=eot, initializer_range=0.2, **config)
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():   # GPT-2 starts biases at 0 and LayerNorms at 1: make each count
        for name, parameter in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                parameter.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory)
    return model


CONFIGS = [
    dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, activation_function="gelu_new"),
    dict(n_layer=1, n_head=4, n_embd=48, n_positions=80, activation_function="relu",
         n_inner=40, seed=1),
    dict(n_layer=3, n_head=1, n_embd=24, n_positions=96, layer_norm_epsilon=1e-6,
         activation_function="gelu_pytorch_tanh", seed=2),
]


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=lambda i: f"config{i}")
def imported(request, bpe, tmp_path_factory):
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", bpe / "json", **dict(CONFIGS[request.param]))
    out = import_gpt2(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    assert isinstance(ours, DecoderOnly) and not ours.training
    assert_same_logits(hf, ours, atol=1e-5)


def test_greedy_generation_matches_transformers(imported, monkeypatch):
    # (a lone bos, which is also pad, would otherwise be taken for padding)
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 50, monkeypatch)


def test_an_empty_prompt_generates_what_transformers_generates_from_bos(imported):
    """GPT-2's tokenizer puts no bos before a prompt; an empty one starts from
    <|endoftext|> alone, as transformers' generate does when given no input ids."""
    hf, _, out = imported
    generator = Generator.load(out)
    assert not generator.tokenizer.prepend_bos
    with torch.no_grad():
        expected = hf.generate(do_sample=False, max_new_tokens=20,
                               pad_token_id=generator.tokenizer.eos_id)[0, 1:]
    text = generator.generate([""], max_new_tokens=20)[0]
    assert text == generator.tokenizer.decode(expected.tolist())   # config 2: eos at once


def test_perplexity_of_an_imported_model_uses_its_end_token(imported, tmp_path):
    hf, _, out = imported
    assert_same_perplexity(hf, out, tmp_path)


def test_imported_checkpoint_records_its_tokenizer(imported, bpe):
    _, ours, out = imported
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                      "tokenizer.json"]
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["tokenizer"] == {"file": "tokenizer.json", "bos_id": 0, "eos_id": 0,
                                     "pad_id": 0}
    assert recorded["origin"]["imported"] == "hf-gpt2"
    tokenizer = checkpoint.load_tokenizer(out)
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 0, 0)
    assert not tokenizer.prepend_bos        # GPT-2 prompts are read without a bos
    assert ours.config.pad_id == 0 and ours.config.arch == "decoder"
    assert ours.output_proj.weight is ours.decoder.embed.embedding.weight


@pytest.mark.parametrize("layout", ["json", "pair"])
def test_tokenizer_ids_equal_gpt2_tokenizer_fast(bpe, layout):
    reference = transformers.GPT2TokenizerFast.from_pretrained(str(bpe / layout))
    if layout == "json":
        ours = HFTokenizer.from_file(bpe / "json" / "tokenizer.json", bos=EOT, eos=EOT)
    else:
        ours = HFTokenizer.from_byte_level_bpe(bpe / "pair" / "vocab.json",
                                               bpe / "pair" / "merges.txt", bos=EOT, eos=EOT)
    encoded = ours.encode(SAMPLES)
    assert encoded == [reference.encode(text, add_special_tokens=False) for text in SAMPLES]
    assert encoded == [reference(text)["input_ids"] for text in SAMPLES]
    assert ours.vocab_size == len(reference)
    for text, ids in zip(SAMPLES, encoded):
        if EOT not in text:
            assert ours.decode(ids) == text


def test_both_tokenizer_layouts_import_to_the_same_ids(bpe, tmp_path):
    hf_checkpoint(tmp_path / "hf", bpe / "pair", n_layer=1, n_head=2, n_embd=16,
                  n_positions=32)
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    out = import_gpt2(tmp_path / "hf", tmp_path / "ours")
    from_pair = checkpoint.load_tokenizer(out)
    from_json = HFTokenizer.from_file(bpe / "json" / "tokenizer.json", bos=EOT, eos=EOT)
    assert from_pair.encode(SAMPLES) == from_json.encode(SAMPLES)


def test_decode_stops_at_the_end_token_that_is_also_bos_and_pad(bpe):
    tokenizer = HFTokenizer.from_file(bpe / "json" / "tokenizer.json", bos=EOT, eos=EOT)
    hello, world = tokenizer.encode(["Hello", " world"])
    eot = tokenizer.eos_id
    assert tokenizer.decode([eot, eot, *hello, *world, eot, *world, eot]) == "Hello world"
    assert tokenizer.decode([eot, eot]) == ""


def test_save_and_average_keep_the_tokenizer_json_and_its_ids(imported, tmp_path):
    _, ours, out = imported
    copy = checkpoint.save(tmp_path / "copy", ours, None, out / "tokenizer.json")
    average = checkpoint.average([out, copy], tmp_path / "average")
    for path in (copy, average):
        assert (path / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
        assert not (path / "spm.model").exists()
        assert checkpoint.load_tokenizer(path).specials == {"bos_id": 0, "eos_id": 0,
                                                            "pad_id": 0}
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(out / "tokenizer.json", loose)
    with pytest.raises(checkpoint.CheckpointError, match="special ids"):
        checkpoint.save(tmp_path / "bad", ours, None, loose / "tokenizer.json")
    assert not (tmp_path / "bad").exists()


def test_load_tokenizer_names_the_directory_without_one(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match=f"{tmp_path}: no tokenizer"):
        checkpoint.load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def small_hf(bpe, tmp_path_factory):
    """One small GPT-2 directory, copied and damaged by each bad-input test."""
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, bpe / "json", n_layer=2, n_head=2, n_embd=16, n_positions=32)
    return directory


def refused(directory, tmp_path, *messages):
    assert_refused(import_gpt2, directory, tmp_path, *messages)


def test_refuses_another_model_type(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(model_type="bert"))
    refused(directory, tmp_path, "config.json", "model_type='bert'")


@pytest.mark.parametrize("option,value", [("scale_attn_by_inverse_layer_idx", True),
                                          ("reorder_and_upcast_attn", True),
                                          ("scale_attn_weights", False),
                                          ("activation_function", "silu"),
                                          ("add_cross_attention", True)])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, option, value):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update({option: value}))
    refused(directory, tmp_path, "config.json", f"{option}={json.dumps(value)}"
            if option != "activation_function" else f"{option}='silu'")


def test_refuses_a_missing_weight(small_hf, tmp_path):
    def remove(tensors):
        del tensors["transformer.h.1.mlp.c_fc.bias"]
    directory = damaged(small_hf, tmp_path, weights=remove)
    refused(directory, tmp_path, "model.safetensors", "missing weight 'h.1.mlp.c_fc.bias'")


def test_refuses_an_unknown_weight(small_hf, tmp_path):
    def add(tensors):
        tensors["transformer.h.0.attn.rotary.weight"] = torch.zeros(3)
    refused(damaged(small_hf, tmp_path, weights=add), tmp_path,
            "unknown weight 'transformer.h.0.attn.rotary.weight'")


def test_refuses_an_untied_output_layer(small_hf, tmp_path):
    def untie(tensors):
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
    refused(damaged(small_hf, tmp_path, weights=untie), tmp_path, "'lm_head.weight' differs")


def test_refuses_a_shape_the_configuration_does_not_give(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(n_inner=20))
    refused(directory, tmp_path, "model.safetensors", "'h.0.mlp.c_fc.weight' has shape "
            "(16, 64), the configuration needs (16, 20)")


def test_reads_pytorch_model_bin_without_prefix_and_with_buffers(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    bare["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))      # old causal buffers
    bare["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    bare["lm_head.weight"] = bare["wte.weight"].clone()
    (directory / "model.safetensors").unlink()
    torch.save(bare, directory / "pytorch_model.bin")
    out = import_gpt2(directory, tmp_path / "out")
    reference = import_gpt2(small_hf, tmp_path / "reference")
    for (name, a), (_, b) in zip(load_model(out).state_dict().items(),
                                 load_model(reference).state_dict().items()):
        assert torch.equal(a, b), name


def test_command_line_import_and_overwrite(small_hf, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["import", "hf-gpt2", str(small_hf), "--out", str(out)]) == 0
    assert "2 layers" in capsys.readouterr().out
    assert main(["import", "hf-gpt2", str(small_hf), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["import", "hf-gpt2", str(small_hf), "--out", str(out), "--force"]) == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["import", "hf-gpt2", str(small_hf), "--out", str(other), "--force"]) == 2
    assert (other / "keep.txt").read_text() == "mine"
    bert = damaged(small_hf, tmp_path, config=lambda c: c.update(model_type="bert"))
    assert main(["import", "hf-gpt2", str(bert), "--out", str(tmp_path / "bert")]) == 1
    err = capsys.readouterr().err
    assert "model_type='bert'" in err and "Traceback" not in err


@pytest.mark.parametrize("change,message", [
    ({"eos_token_id": 5}, "eos_token_id=5 but the tokenizer's eos token '<|endoftext|>' is 0"),
    ({"vocab_size": 100}, "vocab_size=100 is smaller than the tokenizer's"),
    ({"n_head": 3}, "not divisible by num_heads=3"),
])
def test_refuses_a_configuration_that_disagrees(small_hf, tmp_path, change, message):
    refused(damaged(small_hf, tmp_path, config=lambda c: c.update(change)), tmp_path,
            "config.json", message)


def test_refuses_a_directory_without_a_tokenizer(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path)
    (directory / "tokenizer.json").unlink()
    refused(directory, tmp_path, f"{directory}: no tokenizer")
