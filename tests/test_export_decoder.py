"""The Hugging Face export of language models (Llama's layout as LlamaForCausalLM, GPT-2's
as GPT2LMHeadModel, Gemma 3's as Gemma3ForCausalLM) computes what our model computes,
its tokenizer.json gives our SentencePiece ids, and what the formats cannot hold is
refused by name."""

import warnings

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import preset
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.tokenizer import MODEL_NAME, Tokenizer, train_tokenizer
from transduce.decode.search import greedy_search
from transduce.export import ExportError, export_hf
from transduce.importers import import_gemma, import_gpt2, import_llama
from transduce.model import build_model, load_model
from tests.foreign_checkpoints import left_padded

transformers = pytest.importorskip("transformers")

VOCAB = 300
LAYOUTS = {  # preset, changes
    "llama": ("llama-tiny", {"tie_embeddings": "none"}),
    "llama-tied-mqa": ("llama-tiny", {"num_kv_heads": 1, "rope_base": 500000.0}),
    "gpt2": ("gpt-tiny", {}),
    "gpt2-relu": ("gpt-tiny", {"activation": "relu", "layer_norm_eps": 1e-6}),
    "gemma3": ("llama-tiny", {"sandwich_norm": True, "qk_norm": True,
                              "scale_embeddings": True, "activation": "gelu-tanh",
                              "attention_type": "sliding", "attention_window": 3,
                              "full_attention_layers": (1,), "local_rope_base": 100.0}),
    # BLOOM's: ALiBi's slopes (6 heads: two powers of two mixed), a norm of the embeddings
    "bloom": ("gpt-tiny", {"positional": "alibi", "embedding_norm": True, "num_heads": 6,
                           "d_model": 48, "d_ff": 192}),
}


def saved_language_model(tmp_path, tiny_corpus, name, **changes):
    """A random language model with its norms and biases moved off their initial values
    (so that a wrong mapping shows), saved with the corpus's SentencePiece model."""
    torch.manual_seed(5)
    model = build_model(preset(name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                               **changes)).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name or parameter_name.endswith("bias"):
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model, checkpoint.save(tmp_path / "ckpt", model, None, tiny_corpus / MODEL_NAME)


@pytest.fixture(params=list(LAYOUTS))
def exported(request, tmp_path, tiny_corpus):
    name, changes = LAYOUTS[request.param]
    model, path = saved_language_model(tmp_path, tiny_corpus, name, **changes)
    out = export_hf(path, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    expected = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel",
                "gemma3": "Gemma3ForCausalLM",
                "bloom": "BloomForCausalLM"}[request.param.split("-")[0]]
    assert type(theirs).__name__ == expected
    return model, theirs, out, path


def test_logits_match_and_padded_batches_too(exported):
    model, theirs, _, _ = exported
    tokens, mask = left_padded([13, 7, 1], 13, VOCAB, model.config.pad_id)
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens[:1]).logits, model(tokens[:1]),
                                   atol=2e-5, rtol=1e-5)
        expected = theirs(tokens, attention_mask=mask.long(), position_ids=positions).logits
        got = model(tokens, key_mask=mask)
    torch.testing.assert_close(got[mask], expected[mask], atol=2e-5, rtol=1e-5)


def test_a_prompt_is_tokenized_and_continued_as_ours(exported, monkeypatch):
    """AutoTokenizer gives [bos] + our SentencePiece ids, and greedy `generate`
    continues them as our search does (the random model's tokens compared, not its text:
    they are often bytes that make no UTF-8)."""
    model, theirs, out, path = exported
    ours = checkpoint.load_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = "And God said"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == [ours.bos_id, *ours.encode([prompt])[0]]
    assert theirs.generation_config.num_beams == 1
    monkeypatch.setattr(theirs.generation_config, "eos_token_id", None)   # all 20 steps
    with torch.no_grad():
        expected = theirs.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=20)[:, ids.shape[1]:]
    got = greedy_search(model, ids, bos_id=ids[:, -1], eos_id=-1, max_len=20)
    assert torch.equal(got, expected)


MIXED_TEXT = ["The quick brown fox jumps over the lazy dog. It's a dog's life, isn't it?",
              "El niño comió una manzana en la mañana; ¿verdad que sí? ¡Claro!",
              "Ça coûte 12,50 € — déjà vu, naïve café.", "日本語のテキストと中文的句子。",
              "Emoji: 🎉🙂👍🏽 and more 🎉.", "def f(x): return x ** 2  # code",
              "And God said, Let there be light: and there was light."]


@pytest.mark.parametrize("corpus", ["tiny", "mixed"])
def test_the_sentencepiece_model_as_tokenizer_json_gives_its_ids(corpus, tiny_corpus,
                                                                   tmp_path):
    """Every line, and lines with what SentencePiece handles apart: runs of spaces,
    leading and trailing ones, characters out of the vocabulary (byte fallback)."""
    if corpus == "tiny":
        lines = (tiny_corpus / "train.es").read_text(encoding="utf-8").splitlines()
        lines += (tiny_corpus / "train.en").read_text(encoding="utf-8").splitlines()
        ours = Tokenizer(tiny_corpus / MODEL_NAME)
    else:
        lines = MIXED_TEXT
        ours = train_tokenizer(MIXED_TEXT * 20, tmp_path, vocab_size=600)
    theirs = HFTokenizer.from_sentencepiece(ours)
    lines += ["  two  spaces ", " lead", "tab\there", "ünïcödé 中文 🎉 ∮", "", "x\n y", "ŝ" * 5]
    assert theirs.encode(lines) == ours.encode(lines)
    assert [theirs.decode(ids) for ids in theirs.encode(lines)] == \
        [ours.decode(ids) for ids in ours.encode(lines)]
    assert theirs.prepend_bos and theirs.specials == {"bos_id": ours.bos_id,
                                                      "eos_id": ours.eos_id,
                                                      "pad_id": ours.pad_id}


@pytest.mark.parametrize("importer,name,changes", [
    (import_llama, "llama-tiny", {"tie_embeddings": "none", "num_kv_heads": 2}),
    (import_gpt2, "gpt-tiny", {}),
    (import_gemma, "llama-tiny", {**LAYOUTS["gemma3"][1], "num_kv_heads": 1})])
def test_an_export_imports_back_to_the_same_model(importer, name, changes, tmp_path,
                                                  tiny_corpus):
    model, path = saved_language_model(tmp_path, tiny_corpus, name, **changes)
    back = load_model(importer(export_hf(path, tmp_path / "hf"), tmp_path / "back"))
    # (the GPT-2 importer pads with eos, as GPT-2 has no pad token)
    assert back.config.replace(dropout=model.config.dropout,
                               pad_id=model.config.pad_id) == model.config
    for (key, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), key
    tokens = Tokenizer(tiny_corpus / MODEL_NAME).encode(["And God said", " two  spaces"])
    assert checkpoint.load_tokenizer(tmp_path / "back").encode(
        ["And God said", " two  spaces"]) == tokens


def test_a_sliding_window_exports_as_mistral_and_imports_back(tmp_path, tiny_corpus):
    model, path = saved_language_model(tmp_path, tiny_corpus, "llama-tiny",
                                       attention_type="sliding", attention_window=4)
    out = export_hf(path, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "MistralForCausalLM" and theirs.config.sliding_window == 5
    tokens, mask = left_padded([13, 7, 1], 13, VOCAB, model.config.pad_id)   # beyond the window
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = theirs(tokens, attention_mask=mask.long(), position_ids=positions).logits
        got = model(tokens, key_mask=mask)
    torch.testing.assert_close(got[mask], expected[mask], atol=2e-5, rtol=1e-5)
    back = load_model(import_llama(out, tmp_path / "back"))
    assert back.config.replace(dropout=model.config.dropout) == model.config
    for (key, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name,changes,message", [
    ("gpt-tiny", {"num_kv_heads": 2}, "num_kv_heads=2 (GPT-2 has full multi-head"),
    ("gpt-tiny", {"positional": "sinusoidal"}, "positional='sinusoidal' (the format's is "
                                               "'learned')"),
    # rotary positions with LayerNorms are StableLM's (with SwiGLU) or GPT-NeoX's
    ("llama-tiny", {"bias": True, "norm": "layer"},
     "cannot export to StableLM: bias=True (the format's is False)"),
    ("llama-tiny", {"norm": "layer", "parallel_residual": True, "qk_norm": True},
     "cannot export to StableLM: parallel_residual=True with shared_norm=False (StableLM's "
     "parallel layers, and only they, read one norm); qk_norm=True without "
     "qk_norm_per_head"),
    ("llama-tiny", {"gated_ffn": False, "norm": "layer", "activation": "gelu"},
     "cannot export to GPT-NeoX: bias=False (the format's is True); num_kv_heads=2 "
     "(GPT-NeoX has full multi-head attention)"),
    ("gpt-tiny", {"parallel_residual": True},
     "cannot export to GPT-2: parallel_residual=True (the format's layers add their "
     "sub-layers one after the other)"),
    ("gpt-tiny", {"output_bias": True}, "output_bias=True (the format's output has no bias)"),
    ("gpt-tiny", {"attention_bias": False},
     "cannot export to GPT-2: attention_bias=False (the format's attention has biases where "
     "the rest of the model has them)"),
    # bias-free attention with rotary positions is GPT-J's
    ("gpt-tiny", {"attention_bias": False, "positional": "rotary"},
     "cannot export to GPT-J: parallel_residual=False (the format's is True); shared_norm="
     "False (the format's is True)"),
    # an output bias or one norm for parallel sub-layers is Phi's
    ("llama-tiny", {"output_bias": True, "norm": "layer", "gated_ffn": False, "bias": True,
                    "num_kv_heads": 4},
     "cannot export to Phi: parallel_residual=False (the format's is True); shared_norm="
     "False (the format's is True)"),
    ("gpt-tiny", {"attention_type": "sliding"}, "attention_type='sliding'"),
    ("llama-tiny", {"attention_type": "sliding", "qkv_bias": True},     # Qwen2's window
     "Qwen2 with a SentencePiece vocabulary"),
    ("gpt-tiny", {"gated_ffn": True, "scale_embeddings": True}, "scale_embeddings=True"),
    ("llama-tiny", {"qkv_bias": True}, "Qwen2 with a SentencePiece vocabulary"),
    ("llama-tiny", {"qk_norm": True}, "Qwen3 with a SentencePiece vocabulary"),
    ("llama-tiny", {"qk_norm": True, "qkv_bias": True}, "qkv_bias=True (Qwen3's attention_bias"),
    ("gpt-tiny", {"qk_norm": True}, "qk_norm=True (the format has no norms of the queries"),
    ("llama-tiny", {"sandwich_norm": True}, "cannot export to Gemma 2: scale_embeddings=False"),
    ("llama-tiny", {"sandwich_norm": True, "local_rope_base": 10.0, "attention_type": "sliding",
                    "full_attention_layers": (1,)},
     "cannot export to Gemma 3: qk_norm=False (the format's is True); scale_embeddings=False"),
    ("llama-tiny", {"attention_softcap": 5.0, "logit_softcap": 3.0},
     "attention_softcap=5.0 (the format does not soft-cap them); logit_softcap=3.0"),
    ("llama-tiny", {"attention_type": "sliding", "full_attention_layers": (1,)},
     "cannot export to Mistral: full_attention_layers=[1] (the format's layers share one "
     "attention type)"),
])
def test_what_the_formats_cannot_hold_is_refused_by_name(name, changes, message, tmp_path,
                                                         tiny_corpus):
    _, path = saved_language_model(tmp_path, tiny_corpus, name, **changes)
    with pytest.raises(ExportError, match="cannot export to") as error:
        export_hf(path, tmp_path / "hf")
    assert message in str(error.value)
    assert not (tmp_path / "hf").exists()


def test_the_hugging_face_encoder_decoder_export_refuses_llama_layers(tmp_path, tiny_corpus):
    """(CTranslate2's encoder-decoder holds them: test_export.py.)"""
    from transduce.model import Transformer

    model = Transformer(preset("tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                               norm="rms", gated_ffn=True)).eval()
    path = checkpoint.save(tmp_path / "ckpt", model, None, tiny_corpus / MODEL_NAME)
    with pytest.raises(ExportError, match="norm='rms'.*gated_ffn=True"):
        export_hf(path, tmp_path / "out")


def test_command_line_export_names_the_class_to_load(tmp_path, tiny_corpus, capsys):
    _, path = saved_language_model(tmp_path, tiny_corpus, "llama-tiny")
    assert main(["export", "hf", str(path), str(tmp_path / "hf")]) == 0
    assert "LlamaForCausalLM: load it with transformers.AutoModelForCausalLM" in \
        capsys.readouterr().out
    assert main(["export", "ct2", str(path), str(tmp_path / "ct2")]) == 0
    assert "load it with ctranslate2.Generator; tokenizer: " in capsys.readouterr().out


ctranslate2 = pytest.importorskip("ctranslate2")

# And what CTranslate2 holds besides: scaled rotary positions (Llama 3.1's with an
# original context short enough that every band of frequencies is there) and Mistral's
# sliding window, shorter than the tokens generated.
CT2_LAYOUTS = {
    **LAYOUTS,
    "llama-rope-linear": ("llama-tiny", {"rope_scaling": "linear", "rope_factor": 4.0}),
    "llama-rope-llama3": ("llama-tiny", {"rope_scaling": "llama3", "rope_factor": 8.0,
                                         "rope_original_positions": 16}),
    "llama-sliding": ("llama-tiny", {"attention_type": "sliding", "attention_window": 15}),
    "qwen3-qk-norm": ("llama-tiny", {"qk_norm": True, "head_size": 8}),
    "qk-norm-learned": ("gpt-tiny", {"qk_norm": True, "norm": "rms"}),
    # Gemma 3's: a window of 16 keys on the first layer, the second full
    "gemma3": ("llama-tiny", {**LAYOUTS["gemma3"][1], "attention_window": 15}),
}


@pytest.mark.parametrize("layout", list(CT2_LAYOUTS))
def test_ctranslate2_scores_and_greedy_tokens_match(layout, tmp_path, tiny_corpus):
    """A CTranslate2 Generator on the export: greedy generation, and the log-probability
    of every token of a random continuation, as ours."""
    from transduce.export import export_ctranslate2

    name, changes = CT2_LAYOUTS[layout]
    model, path = saved_language_model(tmp_path, tiny_corpus, name, **changes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_ctranslate2(path, tmp_path / "ct2")
    assert [str(w.message) for w in caught if "sliding window" in str(w.message)] == (
        ["CTranslate2's sliding window (16 keys) gives this model's tokens from prompts of "
         "up to 16 tokens; from a longer prompt it computes others, and its score_batch "
         "fails on sequences longer than 16 tokens"]
        if model.config.attention_type == "sliding" else [])
    tokenizer = checkpoint.load_tokenizer(out.parent / "ckpt")
    assert (out / MODEL_NAME).is_file()
    generator = ctranslate2.Generator(str(out), device="cpu", intra_threads=1)
    ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(["And God said"])[0]]])
    prompt = [tokenizer.piece(t) for t in ids[0].tolist()]
    ours = greedy_search(model, ids, bos_id=ids[:, -1], eos_id=-1, max_len=12)[0].tolist()
    found = generator.generate_batch([prompt], max_length=12, sampling_topk=1,
                                     include_prompt_in_result=False, end_token=[])
    assert found[0].sequences_ids[0] == ours and len(ours) == 12
    whole = ids[0].tolist() + torch.randint(4, VOCAB, (12,)).tolist()   # any continuation
    if model.config.attention_type == "sliding":
        # CTranslate2 4.8 fails to score a sequence longer than its window of 16 keys, and
        # computes longer prompts otherwise (the export warns): a prompt within it, and
        # the window sliding over the tokens generated after it.
        assert ids.shape[1] <= 16 < ids.shape[1] + 12
        whole = whole[:16]
    scored = generator.score_batch([[tokenizer.piece(t) for t in whole]])[0]
    with torch.no_grad():
        log_probs = model(torch.tensor([whole])).log_softmax(-1)[0]
    expected = [log_probs[t, whole[t + 1]].item() for t in range(len(whole) - 1)]
    assert scored.log_probs == pytest.approx(expected, abs=1e-4)



def test_ctranslate2_refuses_what_its_decoder_cannot_express(tmp_path, tiny_corpus):
    from transduce.export import export_ctranslate2

    _, path = saved_language_model(tmp_path, tiny_corpus, "gpt-tiny", norm_first=False,
                                   attention_type="linear", qk_norm=True)
    with pytest.raises(ExportError, match="cannot export to CTranslate2: attention_type="
                                          "'linear'.*qk_norm=True with norm='layer' "
                                          r"\(CTranslate2 normalizes queries and keys by "
                                          r"RMSNorm only\).*norm_first=False"):
        export_ctranslate2(path, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()
