"""Hugging Face DistilBERT -> our checkpoint and back: the imported EncoderOnly (no
segment embeddings, a ReLU pooler) computes what transformers' DistilBertModel,
DistilBertForMaskedLM and DistilBertForSequenceClassification compute (hidden states of
padded rows, masked-LM and classification logits, pairs classified through PyTorch and
ONNX Runtime), `export hf` writes a DistilBERT again, the ONNX and CTranslate2 exports
compute the same, fine-tuning builds transformers' batch and loss, and what we cannot
reproduce (another family, a multiple-choice head) is refused by name with nothing
written."""

import json
import shutil

import numpy as np
import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import fresh_heads, import_bert, import_distilbert
from transduce.model import EncoderOnly, load_model
from tests.foreign_checkpoints import assert_a_classification_batch_gives_transformers_loss, \
    assert_refused, damaged
from tests.test_import_bert import SAMPLES, VOCAB, hf_checkpoint as bert_checkpoint
from tests.test_import_bert import vocab  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CONFIGS = [
    dict(n_layers=2, n_heads=2, dim=32, hidden_dim=48, max_position_embeddings=64,
         activation="gelu"),
    dict(n_layers=1, n_heads=4, dim=48, hidden_dim=40, max_position_embeddings=40,
         activation="relu", sinusoidal_pos_embds=True, seed=1),
    dict(n_layers=3, n_heads=1, dim=24, hidden_dim=64, max_position_embeddings=32,
         activation="gelu_new", seed=2),
]
KINDS = ["DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def randomised(model):
    """Biases at 0 and LayerNorms at 1 would hide a swapped mapping: draw them."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                parameter.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.05)
    return model


def hf_checkpoint(directory, kind, tokenizer_dir, seed=0, **config):
    """A random transformers DistilBert* model saved with save_pretrained, with
    DistilBertTokenizerFast's files."""
    torch.manual_seed(seed)
    hf_config = transformers.DistilBertConfig(vocab_size=len(VOCAB), pad_token_id=0,
                                              initializer_range=0.2, **config)
    if kind.endswith("SequenceClassification"):
        hf_config.id2label, hf_config.label2id = LABELS, {v: k for k, v in LABELS.items()}
    model = randomised(getattr(transformers, kind)(hf_config).eval())
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory)
    return model


@pytest.fixture(scope="module")
def tokenizer_dir(vocab, tmp_path_factory):  # noqa: F811
    """The uncased vocabulary as DistilBertTokenizerFast saves it."""
    directory = tmp_path_factory.mktemp("distilbert-tokenizer")
    fast = transformers.DistilBertTokenizerFast.from_pretrained(str(vocab / "uncased" / "txt"))
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module", params=[(c, k) for c in range(len(CONFIGS)) for k in KINDS],
                ids=lambda case: f"config{case[0]}-{case[1]}")
def imported(request, tokenizer_dir, tmp_path_factory):
    """(kind, HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    index, kind = request.param
    root = tmp_path_factory.mktemp("hf")
    hf = hf_checkpoint(root / "hf", kind, tokenizer_dir, **CONFIGS[index])
    out = import_distilbert(root / "hf", root / "ours")
    return kind, hf, load_model(out), out


def padded(hf_config, lengths=(13, 8, 1), seed=0):
    """Right-padded rows [CLS] ... [SEP] ... [SEP] of random tokens, and the real tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, hf_config.vocab_size, (len(lengths), max(lengths)),
                        generator=generator)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    ids[:, 0] = 2
    for row, n in enumerate(lengths):
        ids[row, n - 1] = ids[row, max(n // 2 - 1, 0)] = 3 if n > 1 else 2
    return ids.masked_fill(~mask, 0), mask


def test_outputs_match_transformers(imported):
    kind, hf, ours, out = imported
    assert isinstance(ours, EncoderOnly) and not ours.training
    assert (ours.config.type_vocab_size, ours.config.pooler_activation) == (0, "relu")
    assert ours.embed.segments is None and ours.config.layer_norm_eps == 1e-12
    ids, mask = padded(hf.config)
    with torch.no_grad():
        result = hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
        hidden = ours(ids, key_mask=mask)
        segments = torch.ones_like(ids)       # not read: DistilBERT has no segments
        assert torch.equal(ours(ids, segments, key_mask=mask), hidden)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[mask], result.hidden_states[-1][mask], **close)
    if kind == "DistilBertForMaskedLM":
        torch.testing.assert_close(ours.mlm_logits(hidden)[mask], result.logits[mask], **close)
    if kind == "DistilBertForSequenceClassification":
        torch.testing.assert_close(ours.classify_logits(ours.pool(hidden)), result.logits,
                                   **close)
        assert ours.labels == list(LABELS.values())
    else:
        assert ours.classifier is None and ours.labels is None
    expected_fresh = {"DistilBertModel": ["pooler", "mlm_head"],
                      "DistilBertForMaskedLM": ["pooler"],
                      "DistilBertForSequenceClassification": ["mlm_head"]}[kind]
    assert fresh_heads(out) == expected_fresh
    assert torch.equal(ours.mlm_head.decoder.weight, ours.embed.embedding.weight)


def test_pairs_are_classified_as_transformers_does_through_torch_and_onnx(tokenizer_dir,
                                                                        tmp_path):
    """Pairs, [CLS] A [SEP] B [SEP] with no segment ids, by `SentenceEncoder.classify`
    on the checkpoint and on its ONNX export (a graph of ids alone): transformers'
    probabilities, from DistilBertTokenizerFast's encoding."""
    pytest.importorskip("onnxruntime")
    from transduce.decode.encode import SentenceEncoder
    from transduce.decode.onnx_encoder_engine import OnnxSentenceEncoder
    from transduce.export.onnx import export_onnx

    hf = hf_checkpoint(tmp_path / "hf", "DistilBertForSequenceClassification", tokenizer_dir,
                       **CONFIGS[0])
    out = import_distilbert(tmp_path / "hf", tmp_path / "ours")
    texts, seconds = SAMPLES[:4], SAMPLES[4:8]
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    encoded = fast(texts, seconds, padding=True, return_tensors="pt")
    assert "token_type_ids" not in encoded
    with torch.no_grad():
        expected = hf(**encoded).logits.softmax(dim=-1).numpy()
    onnx = OnnxSentenceEncoder(export_onnx(out, tmp_path / "onnx"))
    assert [i.name for i in onnx.session.get_inputs()] == ["ids"]
    for model in (load_model(out), onnx):
        encoder = SentenceEncoder(model, checkpoint.load_tokenizer(out))
        got = [list(p.probabilities.values()) for p in encoder.classify(texts, pairs=seconds)]
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_a_classification_batch_gives_transformers_loss(tokenizer_dir, tmp_path):
    """Fine-tuning an imported DistilBERT: the batch our training builds is
    DistilBertTokenizerFast's padded encoding, and transformers' model gives our loss."""
    hf = hf_checkpoint(tmp_path / "hf", "DistilBertForSequenceClassification", tokenizer_dir,
                       dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
                       **CONFIGS[0])
    out = import_distilbert(tmp_path / "hf", tmp_path / "ours")
    texts = [text for text in SAMPLES if text and "\t" not in text and "\n" not in text]
    lines = [(LABELS[i % 3], text) for i, text in enumerate(texts)]
    assert_a_classification_batch_gives_transformers_loss(hf, out, lines, tmp_path, pad_id=0)


@pytest.fixture(scope="module", params=KINDS[1:])
def imported_for_export(request, tokenizer_dir, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp("exported")
    hf = hf_checkpoint(root / "hf", kind, tokenizer_dir, **CONFIGS[1])
    return kind, hf, import_distilbert(root / "hf", root / "ours")


def test_export_hf_is_distilbert_again(imported_for_export, tmp_path, capsys):
    """`export hf` of the import: a DistilBERT that the Auto classes read, whose
    tokenizer gives the original's ids and no segment ids (DistilBERT's forward takes
    none), with the original's outputs, which imports back to the same weights."""
    kind, hf, out = imported_for_export
    exported = tmp_path / "hf"
    assert main(["export", "hf", str(out), str(exported)]) == 0
    auto = transformers.AutoModelForSequenceClassification if "Classification" in kind \
        else transformers.AutoModelForMaskedLM
    assert f"{kind}: load it with transformers.{auto.__name__}" in capsys.readouterr().out
    theirs = auto.from_pretrained(str(exported)).eval()
    assert type(theirs).__name__ == kind
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    original = transformers.AutoTokenizer.from_pretrained(str(out.parent / "hf"))
    for text in SAMPLES[:-1]:
        assert tokenizer(text)["input_ids"] == original(text)["input_ids"], text
    pair = tokenizer(SAMPLES[:2], SAMPLES[2:4], padding=True, return_tensors="pt")
    assert set(pair) == {"input_ids", "attention_mask"}
    settings = json.loads((exported / "tokenizer_config.json").read_text())
    assert settings["model_input_names"] == ["input_ids", "attention_mask"]   # whatever the
    # version of transformers, whose default for a fast tokenizer was once with segments
    assert torch.equal(pair["input_ids"],
                       original(SAMPLES[:2], SAMPLES[2:4], padding=True,
                                return_tensors="pt")["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(theirs(**pair).logits, hf(**pair).logits, atol=1e-5,
                                   rtol=1e-5)
    again = import_distilbert(exported, tmp_path / "again")
    ours, back = load_model(out).state_dict(), load_model(again).state_dict()
    fresh = set(fresh_heads(again)) | {"nsp_head"}     # DistilBERT has none: never read
    assert set(ours) == set(back)
    for name, tensor in ours.items():
        assert name.split(".")[0] in fresh or torch.equal(tensor, back[name]), name


def test_export_ct2_gives_transformers_states_and_our_relu_pooler(imported_for_export,
                                                                   tmp_path):
    """CTranslate2's encoder, with one embedding (no segments): transformers' hidden
    states, and our pooled output (ReLU) where the import has its pre_classifier."""
    kind, hf, out = imported_for_export
    pooled, ct2_pooled = assert_ct2_states(hf, out, tmp_path)
    if "Classification" in kind:
        assert (pooled == 0).any()           # ReLU's zeros, which tanh would not give
        torch.testing.assert_close(ct2_pooled, pooled, atol=1e-5, rtol=1e-5)


def assert_ct2_states(hf, out, tmp_path):
    """CTranslate2's encoder of `export ct2 OUT` gives transformers' last hidden states
    on padded rows -> (our pooled output, CTranslate2's)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2

    ids, mask = padded(hf.config)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
        ours = load_model(out)
        pooled = ours.pool(ours(ids, key_mask=mask))
    encoder = ctranslate2.Encoder(str(export_ctranslate2(out, tmp_path / "ct2")))
    lengths = mask.sum(dim=1).tolist()
    result = encoder.forward_batch([row[:n] for row, n in zip(ids.tolist(), lengths)])
    states = torch.as_tensor(np.asarray(result.last_hidden_state))
    torch.testing.assert_close(states[mask], expected.hidden_states[-1][mask], atol=1e-5,
                               rtol=1e-5)
    return pooled, torch.as_tensor(np.asarray(result.pooler_output))


def test_export_hf_refuses_what_distilbert_computes_otherwise():
    from transduce.config import preset
    from transduce.export.common import ExportError
    from transduce.export.hf_encoder import check_bert_exportable

    def refused(message, **changes):
        config = preset("bert-tiny", src_vocab_size=50, tgt_vocab_size=50, **changes)
        with pytest.raises(ExportError, match=message):
            check_bert_exportable(EncoderOnly(config))

    refused(r"DistilBERT \(DistilBertForSequenceClassification\): pooler_activation='tanh'",
            type_vocab_size=0, num_labels=2)
    refused(r"layer_norm_eps=1e-05 \(DistilBERT's LayerNorms take 1e-12\)",
            type_vocab_size=0, layer_norm_eps=1e-5, pooler_activation="relu")
    refused(r"BERT \(BertForPreTraining\): pooler_activation='relu' \(BertForPreTraining's "
            r"pooler has tanh\)", pooler_activation="relu")
    refused(r"RoBERTa \(RobertaForSequenceClassification\): pooler_activation='relu'",
            type_vocab_size=1, pooler_activation="relu", num_labels=2)
    # Where the class has no pooler, the pooler's activation is not in the way.
    check_bert_exportable(EncoderOnly(preset("bert-tiny", src_vocab_size=50,
                                             tgt_vocab_size=50, type_vocab_size=0)))


@pytest.fixture(scope="module")
def small_hf(tokenizer_dir, tmp_path_factory):
    """One small DistilBertForMaskedLM directory, copied and damaged by each test."""
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, "DistilBertForMaskedLM", tokenizer_dir, **CONFIGS[0])
    return directory


def refused(directory, tmp_path, *messages):
    assert_refused(import_distilbert, directory, tmp_path, *messages)


@pytest.mark.parametrize("change, messages", [
    (lambda c: c.update(model_type="bert"),
     ["model_type='bert'", "import it with `transduce import hf-bert`"]),
    (lambda c: c.update(activation="silu"), ["activation='silu' is not supported"]),
    (lambda c: c.pop("dim") and None, ["no 'dim'"]),
    (lambda c: c.update(architectures=["DistilBertForMultipleChoice"]),
     ["architectures=['DistilBertForMultipleChoice']", "a multiple-choice model"]),
], ids=["model-type", "activation", "no-dim", "multiple-choice"])
def test_refuses_what_it_cannot_reproduce(small_hf, tmp_path, change, messages):
    refused(damaged(small_hf, tmp_path, config=change), tmp_path, "config.json", *messages)


def test_refuses_bad_weights(small_hf, tmp_path):
    def remove(tensors):
        del tensors["distilbert.transformer.layer.1.ffn.lin1.bias"]

    def untie(tensors):
        tensors["vocab_projector.weight"] = tensors[
            "distilbert.embeddings.word_embeddings.weight"] + 1.0

    def segments(tensors):
        tensors["distilbert.embeddings.token_type_embeddings.weight"] = torch.zeros(2, 32)

    refused(damaged(small_hf, tmp_path / "a", weights=remove), tmp_path / "a",
            "missing weight 'transformer.layer.1.ffn.lin1.bias'")
    refused(damaged(small_hf, tmp_path / "b", weights=untie), tmp_path / "b",
            "'vocab_projector.weight' differs")
    refused(damaged(small_hf, tmp_path / "c", weights=segments), tmp_path / "c",
            "unknown weight 'distilbert.embeddings.token_type_embeddings.weight'")


@pytest.mark.parametrize("importer, kind, tokenizer", [
    (import_distilbert, "DistilBertForMultipleChoice", "distilbert"),
    (import_bert, "BertForMultipleChoice", "bert"),
], ids=["distilbert", "bert"])
def test_a_multiple_choice_model_is_refused(importer, kind, tokenizer, tokenizer_dir,
                                            vocab, tmp_path):  # noqa: F811
    """Its classifier scores each choice of [CLS] context [SEP] choice [SEP], read one
    choice a row: a head of one output that ours would read as a cross-encoder's. It is
    refused by its class, before its weights are read."""
    if tokenizer == "bert":
        bert_checkpoint(tmp_path / "hf", kind, vocab / "uncased" / "json",
                        num_hidden_layers=1, num_attention_heads=2, hidden_size=16,
                        intermediate_size=16)
    else:
        hf_checkpoint(tmp_path / "hf", kind, tokenizer_dir, **CONFIGS[0])
    assert_refused(importer, tmp_path / "hf", tmp_path, f"architectures=['{kind}']",
                   "a multiple-choice model, whose head ours has no place for")


def test_command_line_import(tokenizer_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    hf_checkpoint(bare, "DistilBertModel", tokenizer_dir, **CONFIGS[0])
    assert main(["import", "hf-distilbert", str(bare), "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "encoder-only: 2 layers" in printed and "masked-LM head (mlm_head)" in printed
    assert isinstance(checkpoint.load_tokenizer(tmp_path / "a"), HFTokenizer)
    assert main(["import", "hf-bert", str(bare), "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "import it with `transduce import hf-distilbert`" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model"]["type_vocab_size"] == 0
