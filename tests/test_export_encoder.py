"""The Hugging Face export of encoder-only models (BertForPreTraining, or
BertForSequenceClassification with a classification head) computes what our model
computes, its tokenizer.json gives our ids in BERT's template, it imports back to the
same model, and what BERT cannot hold is refused by name."""

import warnings

import numpy as np
import pytest
import torch

from tests.test_export_decoder import VOCAB, saved_language_model
from transduce import checkpoint
from transduce.cli import main
from transduce.data.masking import MASK_ID
from transduce.export import ExportError, export_hf
from transduce.importers import fresh_heads, import_bert
from transduce.model import load_model

transformers = pytest.importorskip("transformers")

LINES = ["uno dos tres casa", "el perro come", "gato rojo grande come el perro"]


def exported(tmp_path, tiny_corpus, **changes):
    model, path = saved_language_model(tmp_path, tiny_corpus, "bert-tiny", **changes)
    if model.config.num_labels:
        model.labels = [f"class {i}" for i in range(model.config.num_labels)]
        path = checkpoint.save(tmp_path / "labelled", model, None, path / "spm.model")
    return model, path, export_hf(path, tmp_path / "hf")


def padded_pairs(pad_id):
    """Right-padded ids, segments 0 / 1 and the real tokens' mask."""
    ids = torch.randint(5, VOCAB, (3, 12))
    real = torch.arange(12)[None, :] < torch.tensor([12, 7, 2])[:, None]
    segments = ((torch.arange(12)[None, :] >= torch.tensor([6, 3, 1])[:, None]) & real).long()
    return ids.masked_fill(~real, pad_id), segments, real


@pytest.mark.parametrize("num_labels", [0, 3], ids=["pre-training", "classifier"])
def test_outputs_match_transformers_and_import_back(tmp_path, tiny_corpus, num_labels):
    model, path, out = exported(tmp_path, tiny_corpus, num_labels=num_labels,
                                activation="gelu-tanh")
    auto = transformers.AutoModelForSequenceClassification if num_labels else \
        transformers.AutoModelForPreTraining
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = auto.from_pretrained(out).eval()
    assert type(theirs).__name__ == ("BertForSequenceClassification" if num_labels
                                     else "BertForPreTraining")
    ids, segments, real = padded_pairs(model.config.pad_id)
    with torch.no_grad():
        result = theirs(input_ids=ids, attention_mask=real.long(), token_type_ids=segments,
                        output_hidden_states=True)
        hidden = model(ids, segments)
        pooled = model.pool(hidden)
    close = dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(result.hidden_states[-1][real], hidden[real], **close)
    if num_labels:
        torch.testing.assert_close(result.logits, model.classify_logits(pooled), **close)
        assert theirs.config.id2label == {i: f"class {i}" for i in range(3)}
    else:
        torch.testing.assert_close(result.prediction_logits[real],
                                   model.mlm_logits(hidden)[real], **close)
        torch.testing.assert_close(result.seq_relationship_logits, model.nsp_logits(pooled),
                                   **close)
    back = load_model(import_bert(out, tmp_path / "back"))
    assert back.config.replace(dropout=model.config.dropout) == model.config
    assert back.labels == model.labels
    fresh = fresh_heads(tmp_path / "back")       # a classifier's export has no MLM or NSP
    assert fresh == (["mlm_head", "nsp_head"] if num_labels else [])
    ours = dict(model.state_dict())
    for key, value in back.state_dict().items():
        assert key.split(".")[0] in fresh or torch.equal(value, ours[key]), key


def test_the_tokenizer_gives_our_ids_in_bert_s_template(tmp_path, tiny_corpus):
    _, path, out = exported(tmp_path, tiny_corpus)
    ours = checkpoint.load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for line, ids in zip(LINES, ours.encode(LINES)):
        assert theirs(line)["input_ids"] == [ours.bos_id, *ids, ours.eos_id]
    pair = theirs(LINES[0], LINES[1])
    first, second = ours.encode(LINES[:2])
    assert pair["input_ids"] == [ours.bos_id, *first, ours.eos_id, *second, ours.eos_id]
    # BERT reads the second text as segment 1: the tokenizer must say so (transformers'
    # default tokenizer gives no segment ids).
    assert pair["token_type_ids"] == [0] * (len(first) + 2) + [1] * (len(second) + 1)
    assert theirs.mask_token_id == MASK_ID and theirs.pad_token_id == ours.pad_id


def test_the_cli_names_the_class_and_bert_s_limits_are_refused(tmp_path, tiny_corpus, capsys):
    _, path = saved_language_model(tmp_path, tiny_corpus, "bert-tiny")
    assert main(["export", "hf", str(path), str(tmp_path / "hf")]) == 0
    assert "BertForPreTraining: load it with transformers.AutoModelForPreTraining" in \
        capsys.readouterr().out
    for changes, message in (({"norm_first": True}, "norm_first=True (BERT's is False)"),
                             ({"num_kv_heads": 2}, "num_kv_heads=2"),
                             ({"positional": "rotary"}, "positional='rotary'")):
        _, path = saved_language_model(tmp_path / str(len(message)), tiny_corpus, "bert-tiny",
                                       **changes)
        with pytest.raises(ExportError, match="cannot export to BERT") as error:
            export_hf(path, tmp_path / "refused")
        assert message in str(error.value)
        assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("changes", [{}, {"norm_first": True, "positional": "sinusoidal",
                                          "activation": "relu"}],
                         ids=["bert", "pre-norm-sinusoidal"])
def test_the_ctranslate2_encoder_gives_our_states_and_pooled_output(tmp_path, tiny_corpus,
                                                                    changes):
    """`export ct2` of an encoder: ctranslate2.Encoder.forward_batch gives our hidden
    states and pooled output, with segments and without (all 0, as ours)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2

    model, path = saved_language_model(tmp_path, tiny_corpus, "bert-tiny", **changes)
    assert main(["export", "ct2", str(path), str(tmp_path / "ct2")]) == 0
    encoder = ctranslate2.Encoder(str(tmp_path / "ct2"))
    ids, segments, real = padded_pairs(model.config.pad_id)
    lengths = real.sum(dim=1).tolist()
    rows = [row[:n] for row, n in zip(ids.tolist(), lengths)]
    for given in (segments, None):
        types = None if given is None else [row[:n] for row, n in zip(given.tolist(), lengths)]
        result = encoder.forward_batch(rows, token_type_ids=types)
        with torch.no_grad():
            hidden = model(ids, given)
            pooled = model.pool(hidden)
        states = torch.as_tensor(np.asarray(result.last_hidden_state))
        torch.testing.assert_close(states[real], hidden[real], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(torch.as_tensor(np.asarray(result.pooler_output)), pooled,
                                   atol=2e-5, rtol=1e-5)
    int8 = ctranslate2.Encoder(str(export_ctranslate2(path, tmp_path / "int8", "int8")))
    states = torch.as_tensor(np.asarray(int8.forward_batch(rows).last_hidden_state))
    with torch.no_grad():
        hidden = model(ids)
    error = (states[real] - hidden[real]).abs().max().item()
    assert 0 < error < 0.1 * hidden[real].abs().max().item()       # quantized, and close


def test_what_ctranslate2_s_encoder_cannot_hold_is_refused_by_name(tmp_path, tiny_corpus):
    from transduce.export import export_ctranslate2

    for changes, message in (({"positional": "rotary"}, "positional='rotary'"),
                             ({"num_kv_heads": 2}, "num_kv_heads=2"),
                             ({"bias": False}, "bias=False")):
        _, path = saved_language_model(tmp_path / str(len(message)), tiny_corpus, "bert-tiny",
                                       **changes)
        with pytest.raises(ExportError, match="cannot export to CTranslate2") as error:
            export_ctranslate2(path, tmp_path / "refused")
        assert message in str(error.value)
        assert not (tmp_path / "refused").exists()
