"""Hugging Face BERT -> our checkpoint: the imported EncoderOnly computes what
transformers' BertModel, BertForMaskedLM, BertForPreTraining and
BertForSequenceClassification compute (hidden states, pooled output, MLM, NSP and
classification logits, padded pairs of segments), its WordPiece tokenizer gives
BertTokenizerFast's ids, and a checkpoint we cannot reproduce is refused by name with
nothing written."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from transduce import checkpoint
from transduce.cli import main
from transduce.data.hf_tokenizer import HFTokenizer
from tests.foreign_checkpoints import assert_refused, damaged
from transduce.importers import fresh_heads, import_bert
from transduce.importers.hf_bert import read_tokenizer
from transduce.model import EncoderOnly, load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", "hello", "world",
         "Hello", "World", "The", "cafe", "café", "naive", "naïve", "run", "un", "want",
         "aff", "able", "El", "el", "niño", "nino", "comió"]
PIECES = ["##s", "##ed", "##ing", "##able", "##ly", "##a", "##e", "##o", "##ñ", "##n", "##i"]
CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
             ".,!?;:'\"()-¿¡éüñ中文字日本語")
VOCAB = SPECIAL + WORDS + PIECES + CHARS + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
SAMPLES = ["Hello world!", "The quick brown foxes jumped over the lazy dogs.",
           "El niño comió café; ¿naïve? ¡Sí!", "CAFÉ Café café cafe", "中文字符和日本語",
           "unwantable affable runs", "[MASK] the [UNK] and [SEP] [CLS]", "a\tb\nc\r\n  d",
           "qqqqzzzz xyzzy", "don't (stop) -- 3.14", "Ünïcödé àéîõü", ""]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """BERT tokenizer directories: {uncased,cased}/{txt,json}: vocab.txt (+
    tokenizer_config.json) alone, or as BertTokenizerFast saves them (tokenizer.json)."""
    root = tmp_path_factory.mktemp("vocab")
    for casing, lower in (("uncased", True), ("cased", False)):
        txt = root / casing / "txt"
        txt.mkdir(parents=True)
        (txt / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
        (txt / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": lower}))
        fast = transformers.BertTokenizerFast.from_pretrained(str(txt))
        fast.save_pretrained(str(root / casing / "json"))
        (root / casing / "json" / "vocab.txt").unlink(missing_ok=True)
    return root


def randomised(model):
    """BERT starts biases at 0 and LayerNorms at 1: make each count, so that a swapped
    mapping fails."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                parameter.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.05)
    return model


def hf_checkpoint(directory, kind, tokenizer_dir, seed=0, **config):
    """A random transformers Bert* model saved with save_pretrained, with a tokenizer."""
    torch.manual_seed(seed)
    hf_config = transformers.BertConfig(vocab_size=len(VOCAB), pad_token_id=0,
                                        initializer_range=0.2, **config)
    if kind == "BertForSequenceClassification":
        hf_config.id2label = {0: "negative", 1: "neutral", 2: "positive"}
        hf_config.label2id = {v: k for k, v in hf_config.id2label.items()}
    model = randomised(getattr(transformers, kind)(hf_config).eval())
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory)
    return model


CONFIGS = [
    dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=48,
         max_position_embeddings=64, hidden_act="gelu"),
    dict(num_hidden_layers=1, num_attention_heads=4, hidden_size=48, intermediate_size=40,
         max_position_embeddings=40, type_vocab_size=3, hidden_act="gelu_new",
         layer_norm_eps=1e-6, seed=1),
    dict(num_hidden_layers=3, num_attention_heads=1, hidden_size=24, intermediate_size=64,
         max_position_embeddings=32, type_vocab_size=4, hidden_act="gelu_pytorch_tanh",
         seed=2),
    dict(num_hidden_layers=2, num_attention_heads=3, hidden_size=36, intermediate_size=20,
         max_position_embeddings=32, hidden_act="relu", seed=3),
]
KINDS = ["BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification"]
CASES = [(c, k) for c in range(len(CONFIGS)) for k in KINDS]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"config{case[0]}-{case[1]}")
def imported(request, vocab, tmp_path_factory):
    """(kind, HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    index, kind = request.param
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", kind, vocab / "uncased" / "json", **dict(CONFIGS[index]))
    out = import_bert(root / "hf", root / "ours")
    return kind, hf, load_model(out), out


def batch(hf_config, lengths=(13, 8, 2), seed=0):
    """Right-padded pairs [CLS] A [SEP] B [SEP]: ids, segments (0 for A, 1 for B, and,
    where the model has more types, 2 on the first row's last tokens), the real tokens."""
    generator = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(5, hf_config.vocab_size, (len(lengths), length), generator=generator)
    ids[:, 0] = 2
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    segments = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        half = max(n // 2, 1)
        ids[row, half - 1] = 3
        ids[row, n - 1] = 3
        segments[row, half:n] = 1
    if hf_config.type_vocab_size > 2:
        segments[0, -3:] = 2
    return ids.masked_fill(~mask, 0), segments.masked_fill(~mask, 0), mask


def test_outputs_match_transformers(imported):
    kind, hf, ours, out = imported
    assert isinstance(ours, EncoderOnly) and not ours.training
    ids, segments, mask = batch(hf.config)
    with torch.no_grad():
        result = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=segments,
                    output_hidden_states=True)
        hidden = ours(ids, segments, key_mask=mask)
        pooled = ours.pool(hidden)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[mask], result.hidden_states[-1][mask], **close)
    if kind == "BertModel":
        torch.testing.assert_close(pooled, result.pooler_output, **close)
    if kind in ("BertForMaskedLM", "BertForPreTraining"):
        logits = result.logits if kind == "BertForMaskedLM" else result.prediction_logits
        torch.testing.assert_close(ours.mlm_logits(hidden)[mask], logits[mask], **close)
    if kind == "BertForPreTraining":
        torch.testing.assert_close(ours.nsp_logits(pooled), result.seq_relationship_logits,
                                   **close)
    if kind == "BertForSequenceClassification":
        torch.testing.assert_close(ours.classify_logits(pooled), result.logits, **close)
        assert ours.labels == ["negative", "neutral", "positive"]
        assert ours.config.num_labels == 3
    else:
        assert ours.classifier is None and ours.labels is None
    expected_fresh = {"BertModel": ["mlm_head", "nsp_head"],
                      "BertForMaskedLM": ["pooler", "nsp_head"], "BertForPreTraining": [],
                      "BertForSequenceClassification": ["mlm_head", "nsp_head"]}[kind]
    assert fresh_heads(out) == expected_fresh
    assert torch.equal(ours.mlm_head.decoder.weight, ours.embed.embedding.weight)


def test_the_ctranslate2_export_gives_transformers_hidden_states(imported, tmp_path):
    """`export ct2` of the import: ctranslate2.Encoder's last_hidden_state (and, where
    the model has its pooler, pooler_output) are transformers', by the import's ids."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2

    kind, hf, _, path = imported
    encoder = ctranslate2.Encoder(str(export_ctranslate2(path, tmp_path / "ct2")))
    assert sorted(p.name for p in (tmp_path / "ct2").iterdir()) == [
        "config.json", "model.bin", "tokenizer.json", "transduce-export.json", "vocabulary.json"]
    ids, segments, mask = batch(hf.config)
    lengths = mask.sum(dim=1).tolist()
    result = encoder.forward_batch([row[:n] for row, n in zip(ids.tolist(), lengths)],
                                   token_type_ids=[row[:n] for row, n in
                                                   zip(segments.tolist(), lengths)])
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=segments,
                      output_hidden_states=True)
    close = dict(atol=1e-5, rtol=1e-5)
    hidden = torch.as_tensor(np.asarray(result.last_hidden_state))
    torch.testing.assert_close(hidden[mask], expected.hidden_states[-1][mask], **close)
    if kind == "BertModel":
        torch.testing.assert_close(torch.as_tensor(np.asarray(result.pooler_output)),
                                   expected.pooler_output, **close)


def test_default_padding_mask_is_the_pad_token(imported):
    _, hf, ours, _ = imported
    ids, segments, mask = batch(hf.config, seed=1)
    with torch.no_grad():
        assert torch.equal(ours(ids, segments), ours(ids, segments, key_mask=mask))


@pytest.mark.parametrize("casing", ["uncased", "cased"])
@pytest.mark.parametrize("source", ["txt", "json"])
def test_tokenizer_ids_match_bert_tokenizer_fast(vocab, casing, source):
    directory = vocab / casing / source
    fast = transformers.BertTokenizerFast.from_pretrained(str(directory))
    ours = read_tokenizer(directory)
    for text in SAMPLES:
        assert ours.encode([text]) == [fast(text, add_special_tokens=False)["input_ids"]], text
    assert ours.specials == {"bos_id": 2, "eos_id": 3, "pad_id": 0, "mask_id": 4}
    assert (ours.mask_id, ours.unk_id, ours.prepend_bos) == (4, 1, True)
    words = ["The quick brown fox", "hello world"]
    for text, ids in zip(words, ours.encode(words)):
        assert ours.decode([2, *ids, 3, 0, 0]) == fast.decode(ids)
    if casing == "uncased":
        assert ours.encode(["CAFÉ"]) == ours.encode(["cafe"])
    else:
        assert ours.encode(["Hello"]) != ours.encode(["hello"])


def test_tokenizer_follows_strip_accents_and_chinese_chars(vocab, tmp_path):
    directory = tmp_path / "tok"
    shutil.copytree(vocab / "cased" / "txt", directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"do_lower_case": False, "strip_accents": True, "tokenize_chinese_chars": False}))
    fast = transformers.BertTokenizerFast.from_pretrained(str(directory))
    ours = read_tokenizer(directory)
    for text in SAMPLES:
        assert ours.encode([text]) == [fast(text, add_special_tokens=False)["input_ids"]], text
    assert ours.encode(["café"]) == ours.encode(["cafe"])


def test_checkpoint_keeps_the_tokenizer_and_its_specials(vocab, tmp_path):
    hf_checkpoint(tmp_path / "hf", "BertForMaskedLM", vocab / "cased" / "txt",
                  **CONFIGS[0])
    out = import_bert(tmp_path / "hf", tmp_path / "ours")
    loaded = checkpoint.load_tokenizer(out)
    direct = HFTokenizer.from_wordpiece(vocab / "cased" / "txt" / "vocab.txt",
                                        lowercase=False)
    assert isinstance(loaded, HFTokenizer)
    assert loaded.encode(SAMPLES) == direct.encode(SAMPLES)
    assert loaded.specials == {"bos_id": 2, "eos_id": 3, "pad_id": 0, "mask_id": 4}
    assert (loaded.mask_id, loaded.unk_id, loaded.prepend_bos) == (4, 1, True)
    assert load_model(out).config.pad_id == 0


def test_a_tokenizer_json_without_template_still_starts_with_cls(vocab, tmp_path):
    directory = tmp_path / "tok"
    shutil.copytree(vocab / "uncased" / "json", directory)
    values = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    values["post_processor"] = None
    (directory / "tokenizer.json").write_text(json.dumps(values), encoding="utf-8")
    ours = read_tokenizer(directory)
    assert ours.prepend_bos
    ours.save(tmp_path / "saved.json")
    again = HFTokenizer.from_file(tmp_path / "saved.json", bos=2, eos=3, pad=0)
    assert again.prepend_bos and again.encode(SAMPLES) == ours.encode(SAMPLES)


@pytest.fixture(scope="module")
def small_hf(vocab, tmp_path_factory):
    """One small BertForPreTraining directory, copied and damaged by each bad-input test."""
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, "BertForPreTraining", vocab / "uncased" / "json",
                  **CONFIGS[0])
    return directory


def refused(directory, tmp_path, *messages):
    assert_refused(import_bert, directory, tmp_path, *messages)


def test_legacy_names_prefix_and_pytorch_model_bin(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    legacy = {}
    for key, tensor in tensors.items():
        key = key if key.startswith(("bert.", "cls.")) else f"bert.{key}"
        if "LayerNorm" in key:
            key = key.removesuffix(".weight") + ".gamma" if key.endswith(".weight") \
                else key.removesuffix(".bias") + ".beta"
        legacy[key] = tensor
    legacy["bert.embeddings.position_ids"] = torch.arange(64)[None]
    legacy["bert.embeddings.token_type_ids"] = torch.zeros(1, 64, dtype=torch.long)
    legacy["cls.predictions.decoder.weight"] = legacy["bert.embeddings.word_embeddings.weight"]
    bias = legacy.get("cls.predictions.bias", legacy.get("cls.predictions.decoder.bias"))
    legacy["cls.predictions.bias"] = legacy["cls.predictions.decoder.bias"] = bias.clone()
    assert any(k.endswith(".gamma") for k in legacy)
    (directory / "model.safetensors").unlink()
    torch.save(legacy, directory / "pytorch_model.bin")
    out = import_bert(directory, tmp_path / "out")
    reference = import_bert(small_hf, tmp_path / "reference")
    for (name, a), (_, b) in zip(load_model(out).state_dict().items(),
                                 load_model(reference).state_dict().items()):
        assert torch.equal(a, b), name
    assert fresh_heads(out) == []


def test_refuses_another_model_type(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(model_type="roberta"))
    refused(directory, tmp_path, "config.json", "model_type='roberta'")


@pytest.mark.parametrize("option,value,message", [
    ("position_embedding_type", "relative_key", 'position_embedding_type="relative_key"'),
    ("is_decoder", True, "is_decoder=true"),
    ("add_cross_attention", True, "add_cross_attention=true"),
    ("hidden_act", "silu", "hidden_act='silu'"),
])
def test_refuses_options_it_cannot_reproduce(small_hf, tmp_path, option, value, message):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update({option: value}))
    refused(directory, tmp_path, "config.json", message, "not supported")


def test_refuses_a_missing_weight(small_hf, tmp_path):
    def remove(tensors):
        del tensors["bert.encoder.layer.1.intermediate.dense.bias"]
    refused(damaged(small_hf, tmp_path, weights=remove), tmp_path, "model.safetensors",
            "missing weight 'encoder.layer.1.intermediate.dense.bias'")


def test_refuses_a_partial_head(small_hf, tmp_path):
    def remove(tensors):
        del tensors["cls.seq_relationship.bias"]
    refused(damaged(small_hf, tmp_path, weights=remove), tmp_path,
            "missing weight 'cls.seq_relationship.bias'")


def test_refuses_an_unknown_weight(small_hf, tmp_path):
    def add(tensors):
        tensors["bert.encoder.layer.0.attention.self.distance_embedding.weight"] = \
            torch.zeros(3)
    refused(damaged(small_hf, tmp_path, weights=add), tmp_path,
            "unknown weight 'bert.encoder.layer.0.attention.self.distance_embedding.weight'")


def test_refuses_an_untied_decoder(small_hf, tmp_path):
    def untie(tensors):
        tensors["cls.predictions.decoder.weight"] = \
            tensors["bert.embeddings.word_embeddings.weight"] + 1
    refused(damaged(small_hf, tmp_path, weights=untie), tmp_path,
            "'cls.predictions.decoder.weight' differs", "tied")


def test_refuses_a_shape_the_configuration_does_not_give(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(intermediate_size=20))
    refused(directory, tmp_path, "model.safetensors",
            "'encoder.layer.0.intermediate.dense.weight' has shape (48, 32), the "
            "configuration needs (20, 32)")


def test_refuses_a_directory_without_a_tokenizer(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path)
    for name in ("tokenizer.json", "vocab.txt"):
        (directory / name).unlink(missing_ok=True)
    refused(directory, tmp_path, f"{directory}: no tokenizer")


def test_refuses_a_pad_id_the_tokenizer_does_not_have(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path, config=lambda c: c.update(pad_token_id=5))
    refused(directory, tmp_path, "pad_token_id=5 but the tokenizer's pad token '[PAD]' is 0")


def test_command_line_import_reports_fresh_heads(vocab, small_hf, tmp_path, capsys):
    bare = tmp_path / "bare"
    hf_checkpoint(bare, "BertModel", vocab / "cased" / "txt", **CONFIGS[0])
    out = tmp_path / "out"
    assert main(["import", "hf-bert", str(bare), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "encoder-only: 2 layers" in printed
    assert "initialised afresh" in printed and "masked-LM head (mlm_head)" in printed \
        and "next-sentence head (nsp_head)" in printed
    assert main(["import", "hf-bert", str(bare), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["import", "hf-bert", str(small_hf), "--out", str(out), "--force"]) == 0
    assert "afresh" not in capsys.readouterr().out
    gpt2 = damaged(small_hf, tmp_path, config=lambda c: c.update(model_type="gpt2"))
    assert main(["import", "hf-bert", str(gpt2), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "model_type='gpt2'" in err and "Traceback" not in err
