"""Hugging Face Gemma 3 (text) -> our checkpoint: the imported model computes what
transformers.Gemma3ForCausalLM computes (logits, left-padded batches, greedy generation
through the caches of its sliding and full layers, perplexity), its tokenizer gives the
fast tokenizer's ids with Gemma's leading <bos>, and a checkpoint we cannot reproduce is
refused by name with nothing written."""

import json
import warnings

import pytest
import torch

from transduce.cli import main
from transduce.decode.generate import Generator, PromptIds
from transduce.importers import import_gemma
from transduce.model import DecoderOnly, load_model
from tests.foreign_checkpoints import assert_peft_adapter_merges, assert_refused, \
    assert_same_greedy_tokens, assert_same_logits, assert_same_onnx_logits, \
    assert_same_perplexity, damaged

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TRAINING_TEXT = ["The quick brown fox jumps over the lazy dog. It's a dog's life.",
                 "El niño comió una manzana en la mañana; ¿verdad que sí?",
                 "In the beginning God created the heaven and the earth."]
PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"     # Gemma's ids 0, 1, 2, 3
# Logits reach 9 here (seven layers with gains near 2); transformers' own float32 logits
# differ from its float64 ones by up to 3.5e-5 (its norms compute in float32 even then).
ATOL = 1e-4


@pytest.fixture(scope="module")
def gemma_tokenizer(tmp_path_factory):
    """A SentencePiece-style BPE trained here with Gemma's special tokens and its
    post-processor: every sequence starts with <bos>."""
    directory = tmp_path_factory.mktemp("tokenizer")
    trained = tokenizers.SentencePieceBPETokenizer()
    trained.train_from_iterator(TRAINING_TEXT * 2, vocab_size=300, min_frequency=1,
                                special_tokens=[PAD, EOS, BOS, UNK], show_progress=False)
    trained.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 2)])
    trained.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}))
    return directory


def hf_checkpoint(directory, tokenizer_dir, seed=0, generation="Gemma3", **config):
    """A random Gemma3ForCausalLM (generation "Gemma2": Gemma2ForCausalLM) saved with
    save_pretrained, its norm weights w (Gemma's gains are 1 + w) drawn around 1 so that
    each counts and the sub-layers' outputs outweigh the scaled embedding (a gain of 1
    leaves tied models repeating one token), with the tokenizer's files."""
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    torch.manual_seed(seed)
    config_class = getattr(transformers, "Gemma3TextConfig" if generation == "Gemma3"
                           else f"{generation}Config")
    hf_config = config_class(
        vocab_size=vocab.get_vocab_size(), pad_token_id=0, eos_token_id=1, bos_token_id=2,
        initializer_range=0.2, **config)
    model = getattr(transformers, f"{generation}ForCausalLM")(hf_config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.5)
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return model


CONFIGS = [
    # gemma-3-1b's layout: five sliding layers to one full (the default pattern), a
    # window of 8 keys, multi-query, heads wider than hidden_size / heads, tied output
    dict(hidden_size=32, intermediate_size=48, num_hidden_layers=7, num_attention_heads=4,
         num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
         max_position_embeddings=96),
    # one layer in two full (Gemma 2's pattern) with linear rotary scaling on the full
    # layers (the larger Gemma 3's), other bases, grouped-query, an untied output, scores
    # over sqrt(12), not sqrt(head_dim) (27B's query_pre_attn_scalar: folded into q_norm)
    dict(hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
         num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12, sliding_window=6,
         max_position_embeddings=80, tie_word_embeddings=False,
         layer_types=["sliding_attention", "full_attention"] * 2,
         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                             "rope_theta": 50000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
         rms_norm_eps=1e-5, seed=1),
    # every layer full: softmax attention throughout, at the full layers' base
    dict(hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
         num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=12, sliding_window=4,
         max_position_embeddings=64, layer_types=["full_attention"] * 2,
         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 3000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
         seed=2),
]


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=lambda i: f"config{i}")
def imported(request, gemma_tokenizer, tmp_path_factory):
    """(HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", gemma_tokenizer, **dict(CONFIGS[request.param]))
    out = import_gemma(root / "hf", root / "ours")
    return hf, load_model(out), out


def test_logits_match_transformers(imported):
    hf, ours, _ = imported
    assert isinstance(ours, DecoderOnly) and not ours.training
    c = ours.config
    assert (c.norm, c.gated_ffn, c.activation, c.qk_norm, c.sandwich_norm,
            c.scale_embeddings) == ("rms", True, "gelu-tanh", True, True, True)
    full = [i for i, kind in enumerate(hf.config.layer_types) if kind == "full_attention"]
    assert c.attention_type == ("softmax" if len(full) == c.num_decoder_layers else "sliding")
    assert list(c.full_attention_layers) == (full if c.attention_type == "sliding" else [])
    assert_same_logits(hf, ours, atol=ATOL)


def test_the_import_reads_every_weight_it_needs(imported):
    """Leaving out the (1 + w) of Gemma's norms, or one kind of its layers' rotary
    positions, changes the logits: the check above sees each."""
    hf, ours, _ = imported
    tokens = torch.randint(0, hf.config.vocab_size, (2, 30))
    with torch.no_grad():
        expected = hf(tokens).logits
        norm = ours.decoder.layers[0].post_norm1
        norm.weight -= 1.0
        assert not torch.allclose(ours(tokens), expected, atol=1e-3)
        norm.weight += 1.0
        torch.testing.assert_close(ours(tokens), expected, atol=ATOL, rtol=1e-5)


def test_greedy_generation_through_the_cache_matches_transformers(imported, monkeypatch):
    """40 tokens after left-padded prompts: the windows (6 and 8 keys) slide while the
    full layers' caches grow."""
    hf, ours, _ = imported
    assert_same_greedy_tokens(hf, ours, 40, monkeypatch)


def test_prompt_lookup_generates_the_greedy_tokens_of_transformers(imported, monkeypatch):
    """Drafts checked a step at a time and forgotten where rejected, in the sliding
    layers' caches and the full layers' alike."""
    hf, _, out = imported
    generator = Generator.load(out)
    ids = [generator.tokenizer.bos_id] + [11, 25, 40, 7] * 4
    monkeypatch.setattr(hf.generation_config, "eos_token_id", None)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40,
                               pad_token_id=0)[0, len(ids):].tolist()
    row, = generator.generate_rows([PromptIds(ids)], max_new_tokens=40, prompt_lookup=4)
    assert row.tokens == expected[:len(row.tokens)]
    assert len(row.tokens) == 40 or row.ended and expected[len(row.tokens)] in generator.end_ids


def test_a_prompt_generates_from_the_ids_the_fast_tokenizer_gives(imported):
    """Generator.generate reads the prompt as the fast tokenizer does, <bos> first, and
    continues it as transformers' generate does."""
    hf, _, out = imported
    generator = Generator.load(out)
    tokenizer = generator.tokenizer
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id) == (0, 1, 2)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), bos_token=BOS, eos_token=EOS)
    ids = reference("In the beginning", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tokenizer.bos_id and tokenizer.prepend_bos
    with torch.no_grad():
        expected = hf.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None,
                               pad_token_id=0)[0, ids.shape[1]:].tolist()
    rows = generator.generate_rows([PromptIds(ids[0].tolist())], max_new_tokens=12)
    assert rows[0].tokens == expected[:len(rows[0].tokens)]
    assert len(rows[0].tokens) == 12 or expected[len(rows[0].tokens)] == tokenizer.eos_id


def test_perplexity_uses_the_bos_and_eos_of_the_tokenizer(imported, tmp_path):
    hf, _, out = imported
    assert_same_perplexity(hf, out, tmp_path)


def test_the_cache_size_formula_counts_each_kind_of_layer(imported, tmp_path, capsys):
    """`kv-size`: the sliding layers hold their window, the full ones every token;
    the formula equals the caches' measured bytes."""
    _, ours, out = imported
    assert main(["kv-size", "--model", str(out), "--tokens", "50"]) == 0
    printed = capsys.readouterr().out
    c = ours.config
    if c.full_attention_layers:
        assert f"layers {len(c.full_attention_layers)} x " in printed
        assert f"{c.attention_window} tokens (the window)" in printed
        assert "SlidingKVCache and KVCache buffers" in printed


def test_an_import_exports_back_to_gemma3(imported, tmp_path):
    """export hf writes Gemma3ForCausalLM again (each layer's kind, both rotary bases,
    the norms' 1 + w), computing transformers' logits over more tokens than the window."""
    from transduce.export import export_hf

    hf, _, out = imported
    exported = export_hf(out, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(theirs).__name__ == "Gemma3ForCausalLM"
    assert theirs.config.layer_types == hf.config.layer_types
    tokens = torch.randint(0, hf.config.vocab_size, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, hf(tokens).logits, atol=ATOL,
                                   rtol=1e-5)


def test_an_import_exports_to_ctranslate2(imported, tmp_path):
    """A CTranslate2 Generator on the import's export continues a prompt (within the
    window) as transformers does, its window sliding over the tokens generated, each
    layer with its own window and rotary base."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce import checkpoint
    from transduce.export import export_ctranslate2

    hf, _, out = imported
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # prompts longer than the window: none here
        exported = export_ctranslate2(out, tmp_path / "ct2")
    tokenizer = checkpoint.load_tokenizer(out)
    ids = [tokenizer.bos_id, *tokenizer.encode(["In the beginning"])[0]]
    assert len(ids) <= hf.config.sliding_window
    generator = ctranslate2.Generator(str(exported), device="cpu", intra_threads=1)
    found = generator.generate_batch([[tokenizer.piece(t) for t in ids]], max_length=15,
                                     sampling_topk=1, include_prompt_in_result=False,
                                     end_token=[])
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=15,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):]
    assert found[0].sequences_ids[0] == expected.tolist()
    assert len(set(expected.tolist())) > 3


@pytest.fixture(scope="module")
def small_hf(gemma_tokenizer, tmp_path_factory):
    """One small Gemma 3 directory (three layers, the last full), copied and damaged by
    each bad-input test."""
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, gemma_tokenizer, hidden_size=16, intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                  max_position_embeddings=32, sliding_window_pattern=3)
    return directory


def refused(directory, tmp_path, *messages):
    assert_refused(import_gemma, directory, tmp_path, *messages)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, "model_type='gpt2'; only 'gemma3_text' or 'gemma2'"),
    ({"model_type": "gemma3"}, "model_type='gemma3' needs a text_config object"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_activation": "tanh"}, "hidden_activation='tanh' is not supported"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0: must be a positive number"),
    ({"query_pre_attn_scalar": "8"}, "query_pre_attn_scalar=\"8\": must be a positive"),
    ({"_sliding_window_pattern": 0, "sliding_window_pattern": None, "layer_types": None},
     "_sliding_window_pattern=0: must be a positive integer"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
     "layer_types must list \"sliding_attention\" or \"full_attention\" for each of the 3"),
    ({"layer_types": ["full_attention"]}, "for each of the 3 layers"),
    ({"layer_types": [{"kind": "full"}, "full_attention", "full_attention"]},
     "for each of the 3 layers"),
    ({"sliding_window": 1}, "sliding_window=1: must be an integer of at least 2"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                          "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters.rope_type='yarn' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "a scaled rotary position on the sliding layers is not supported"),
    ({"eos_token_id": 5}, "eos_token_id=5 but the tokenizer's eos token '<eos>' is 1"),
])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, change, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(change))
    refused(directory, tmp_path, "config.json", message)


def test_refuses_a_missing_or_an_unknown_weight(small_hf, tmp_path):
    def remove(tensors):
        del tensors["model.layers.2.post_feedforward_layernorm.weight"]
    refused(damaged(small_hf, tmp_path / "a", weights=remove), tmp_path / "a",
            "missing weight 'layers.2.post_feedforward_layernorm.weight'")

    def add(tensors):
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(16)
    refused(damaged(small_hf, tmp_path / "b", weights=add), tmp_path / "b",
            "unknown weight 'model.layers.0.self_attn.q_proj.bias'")


def test_a_transformers_4_config_imports_as_the_same_model(small_hf, tmp_path):
    """Before transformers 5, the layers' kinds came from sliding_window_pattern and the
    rotary bases from rope_theta and rope_local_base_freq: read from there, the model
    computes transformers' logits, and a base left out is Gemma 3's default."""
    def older(values):
        values.pop("layer_types")
        values.pop("rope_parameters")
        values.update(sliding_window_pattern=3, rope_theta=20000.0, rope_local_base_freq=50.0)
    directory = damaged(small_hf, tmp_path, config=older)
    ours = load_model(import_gemma(directory, tmp_path / "out"))
    c = ours.config
    assert (c.full_attention_layers, c.rope_base, c.local_rope_base) == ((2,), 20000.0, 50.0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=ATOL, rtol=1e-5)


def test_an_import_exports_to_onnx(imported, tmp_path):
    """The ONNX export's pass (each sliding layer's band in its mask, the full layers'
    mask without it) computes transformers' logits, left-padded rows too."""
    hf, _, out = imported
    assert_same_onnx_logits(hf, out, tmp_path, atol=ATOL)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_peft_adapter_of_the_directory_merges_into_the_import(imported, tmp_path):
    """A query scale of its own (the second layout's) sits in q_norm's gain, after
    q_proj: the update of q_proj merges as it is."""
    _, ours, out = imported
    assert_peft_adapter_merges(ours, out, tmp_path, atol=ATOL)


def test_command_line_import(small_hf, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["import", "hf-gemma", str(small_hf), "--out", str(out)]) == 0
    assert "3 layers, d_model 16, 2 heads, 1 key/value heads" in capsys.readouterr().out
    bad = damaged(small_hf, tmp_path, config=lambda c: c.update(final_logit_softcapping=30.0))
    assert main(["import", "hf-gemma", str(bad), "--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert "final_logit_softcapping=30.0" in err and "Traceback" not in err
