"""Hugging Face BLOOM -> our checkpoint: the imported model computes what
transformers.BloomForCausalLM computes (logits, left-padded batches, greedy generation
through the cache, perplexity) with ALiBi's slopes for head counts that are powers of
two and not, its tokenizer gives the fast tokenizer's ids, and what we cannot reproduce
is refused by name with nothing written."""

import json

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.importers import import_bloom
from transduce.model import DecoderOnly, load_model
from tests.foreign_checkpoints import assert_refused, assert_same_ctranslate2_tokens, \
    assert_same_greedy_tokens, assert_same_logits, assert_same_onnx_logits, \
    assert_same_perplexity, assert_the_command_generates_as_transformers, damaged, \
    saved_with_drawn_norms

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TRAINING_TEXT = ["The quick brown fox jumps over the lazy dog. It's a dog's life.",
                 "El niño comió una manzana en la mañana; ¿verdad que sí?",
                 "In the beginning God created the heaven and the earth.",
                 "Ça coûte 12,50 € — déjà vu, naïve café."]
SAMPLES = ["Hello world!", "  leading and trailing spaces  ", "El niño comió café.", ""]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]          # BLOOM's ids 0 to 3


@pytest.fixture(scope="module")
def bloom_tokenizer(tmp_path_factory):
    """A byte-level BPE with BLOOM's special tokens; no post-processor (BLOOM adds no
    <s> to a prompt)."""
    directory = tmp_path_factory.mktemp("tokenizer")
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(TRAINING_TEXT * 2, vocab_size=320, min_frequency=1,
                                special_tokens=SPECIALS, show_progress=False)
    trained.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}))
    return directory


def hf_checkpoint(directory, tokenizer_dir, seed=0, **config):
    """A random BloomForCausalLM saved with save_pretrained, its LayerNorm gains drawn
    around 1 and its biases around 0 so that each counts, with the tokenizer's files."""
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    torch.manual_seed(seed)
    hf_config = transformers.BloomConfig(vocab_size=vocab.get_vocab_size(), bos_token_id=1,
                                         eos_token_id=2, pad_token_id=3,
                                         initializer_range=0.2, **config)
    return saved_with_drawn_norms(transformers.BloomForCausalLM(hf_config).eval(), directory,
                                  tokenizer_dir, norms=("layernorm", "ln_f"))


CONFIGS = [dict(hidden_size=32, n_layer=2, n_head=4, seed=6),
           dict(hidden_size=48, n_layer=2, n_head=6, layer_norm_epsilon=1e-6, seed=1)]


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=lambda i: f"config{i}")
def imported(request, bloom_tokenizer, tmp_path_factory):
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", bloom_tokenizer, **dict(CONFIGS[request.param]))
    out = import_bloom(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    assert isinstance(ours, DecoderOnly)
    c = ours.config
    assert (c.positional, c.embedding_norm, c.activation) == ("alibi", True, "gelu-tanh")
    assert_same_logits(hf, ours, atol=2e-5)


def test_greedy_generation_through_the_cache_matches_transformers(imported, monkeypatch):
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 30, monkeypatch)


def test_perplexity_uses_the_bos_and_eos_of_the_tokenizer(imported, tmp_path):
    hf, _, out = imported
    assert_same_perplexity(hf, out, tmp_path)


def test_tokenizer_ids_equal_the_fast_tokenizer(imported, bloom_tokenizer):
    ours = checkpoint.load_tokenizer(imported[2])
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(bloom_tokenizer / "tokenizer.json"), bos_token="<s>",
        eos_token="</s>", pad_token="<pad>")
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 3)
    assert ours.encode(SAMPLES) == [reference(text)["input_ids"] for text in SAMPLES]


def test_the_command_generates_what_transformers_generates(imported, capsys):
    hf, _, out = imported
    assert_the_command_generates_as_transformers(hf, out, "hf-bloom", capsys, pad_id=3)


@pytest.fixture(scope="module")
def small_hf(bloom_tokenizer, tmp_path_factory):
    """One small BLOOM directory, copied and damaged by each bad-input test."""
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, bloom_tokenizer, hidden_size=16, n_layer=1, n_head=2)
    return directory


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, "model_type='gpt2'; only 'bloom'"),
    ({"apply_residual_connection_post_layernorm": True},
     "apply_residual_connection_post_layernorm=true is not supported"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=false is not supported"),
    ({"n_head": 3}, "d_model=16 is not divisible by num_heads=3"),
    ({"eos_token_id": 5}, "eos_token_id=5 but the tokenizer's eos token '</s>' is 2"),
])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, change, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(change))
    assert_refused(import_bloom, directory, tmp_path, message)


def test_the_ctranslate2_export_generates_what_transformers_generates(imported, tmp_path):
    """CTranslate2's ALiBi and layernorm_embedding are BLOOM's: the same greedy tokens."""
    hf, _, out = imported
    tokenizer = checkpoint.load_tokenizer(out)
    assert_same_ctranslate2_tokens(hf, out, tmp_path, pad_id=3, first=[tokenizer.bos_id])


def test_the_onnx_export_computes_transformers_logits(imported, tmp_path):
    """ALiBi and the embeddings' norm in the graph: left-padded rows too."""
    hf, _, out = imported
    assert_same_onnx_logits(hf, out, tmp_path, atol=2e-5)


def test_the_hf_export_is_bloom_again(imported, tmp_path):
    """export hf writes BloomForCausalLM, q, k and v fused head by head again: the same
    logits, left-padded rows too, and the same weights."""
    hf, _, out = imported
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "BloomForCausalLM"
    originals = hf.state_dict()
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(tensor, originals[name], rtol=0, atol=0, msg=name)
    assert_same_logits(theirs, load_model(out), atol=2e-5)
