"""Sentence-transformers models imported whole: the pooling their modules.json names
([CLS] as BGE, the mean as all-MiniLM and E5) and their Normalize module are recorded
by the import, and embed (Python, command line, server: /v1/embed and OpenAI's
/v1/embeddings, ONNX export) makes the vectors sentence-transformers makes from
transformers' hidden states, unless told otherwise; what we do not compute (max
pooling, a Dense module) is refused by name."""

import json
import shutil

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from tests.foreign_checkpoints import assert_refused
from tests.test_import_bert import CONFIGS, hf_checkpoint, vocab  # noqa: F401 - a fixture
from transduce import checkpoint
from transduce.cli import main
from transduce.decode.encode import SentenceEncoder
from transduce.importers import import_bert
from transduce.serve import create_app

transformers = pytest.importorskip("transformers")

LINES = ["The quick brown fox", "hello world!", "El niño comió café", "a b c d e f g"]


def sentence_transformers_dir(directory, vocab_dir, pooling, normalize, extra=()):
    """A random BertModel laid out as sentence-transformers saves one."""
    hf = hf_checkpoint(directory, "BertModel", vocab_dir, **CONFIGS[0])
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    modules += [{"idx": 2, "name": "2", "path": "2_Normalize",
                 "type": "sentence_transformers.models.Normalize"}] if normalize else []
    modules += list(extra)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    modes = {"pooling_mode_cls_token": pooling == "cls",
             "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
             "pooling_mode_mean_sqrt_len_tokens": False}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hf.config.hidden_size, **modes}))
    return hf


def their_vectors(hf, directory, pooling, normalize):
    """sentence-transformers' vectors, computed as it computes them from transformers'
    BertModel: [CLS]'s state or the mask-weighted mean, then L2-normalised."""
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory))
    inputs = tokenizer(LINES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**inputs).last_hidden_state
    if pooling == "cls":
        vectors = hidden[:, 0]
    else:
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        vectors = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(vectors, dim=-1).numpy() if normalize \
        else vectors.numpy()


@pytest.mark.parametrize("pooling,normalize", [("cls", True), ("mean", True), ("mean", False)])
def test_embed_makes_sentence_transformers_vectors(vocab, tmp_path, pooling, normalize):
    hf = sentence_transformers_dir(tmp_path / "hf", vocab / "uncased" / "json", pooling,
                                   normalize)
    out = import_bert(tmp_path / "hf", tmp_path / "ours")
    assert checkpoint.read_sentence_embedding(out) == {"pooling": pooling,
                                                       "normalize": normalize}
    encoder = SentenceEncoder.load(out)
    expected = their_vectors(hf, tmp_path / "hf", pooling, normalize)
    np.testing.assert_allclose(encoder.embed(LINES), expected, atol=1e-5)
    other = "mean" if pooling == "cls" else "cls"
    np.testing.assert_allclose(encoder.embed(LINES, pooling=other, normalize=False),
                               their_vectors(hf, tmp_path / "hf", other, False), atol=1e-5)
    assert main(["export", "onnx", str(out), str(tmp_path / "onnx")]) == 0
    exported = SentenceEncoder.load(tmp_path / "onnx")      # its config.json keeps the record
    np.testing.assert_allclose(exported.embed(LINES), expected, atol=1e-5)
    np.testing.assert_allclose(exported.embed(LINES, pooling=other, normalize=False),
                               their_vectors(hf, tmp_path / "hf", other, False), atol=1e-5)
    assert main(["export", "hf", str(out), str(tmp_path / "hf-again")]) == 0
    again = import_bert(tmp_path / "hf-again", tmp_path / "again")   # modules.json went along
    assert checkpoint.read_sentence_embedding(again) == {"pooling": pooling,
                                                         "normalize": normalize}
    np.testing.assert_allclose(SentenceEncoder.load(again).embed(LINES), expected, atol=1e-5)
    averaged = tmp_path / "run"
    for step in (1, 2):
        shutil.copytree(out, averaged / f"step-000000{step}")
    assert main(["average", str(averaged), "--last", "2", "--out", str(tmp_path / "avg")]) == 0
    assert checkpoint.read_sentence_embedding(tmp_path / "avg") == \
        checkpoint.read_sentence_embedding(out)


def test_the_command_line_and_the_server_follow_the_record(vocab, tmp_path, capsys):
    hf = sentence_transformers_dir(tmp_path / "hf", vocab / "uncased" / "json", "cls", True)
    out = tmp_path / "ours"
    assert main(["import", "hf-bert", str(tmp_path / "hf"), "--out", str(out)]) == 0
    assert "sentence embeddings (modules.json): cls pooling, L2-normalised" in \
        capsys.readouterr().out
    (tmp_path / "lines.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    common = ["embed", "--model", str(out), "--input", str(tmp_path / "lines.txt")]
    assert main([*common, "--out", str(tmp_path / "a.npy")]) == 0
    assert "cls pooling, L2-normalised" in capsys.readouterr().err
    np.testing.assert_allclose(np.load(tmp_path / "a.npy"),
                               their_vectors(hf, tmp_path / "hf", "cls", True), atol=1e-5)
    assert main([*common, "--out", str(tmp_path / "b.npy"), "--pooling", "mean",
                 "--no-normalize"]) == 0
    assert "mean pooling, not normalised" in capsys.readouterr().err
    np.testing.assert_allclose(np.load(tmp_path / "b.npy"),
                               their_vectors(hf, tmp_path / "hf", "mean", False), atol=1e-5)
    with TestClient(create_app(SentenceEncoder.load(out))) as client:
        default = client.post("/v1/embed", json={"texts": LINES}).json()
        assert (default["pooling"], default["normalized"]) == ("cls", True)
        np.testing.assert_allclose(default["embeddings"], np.load(tmp_path / "a.npy"),
                                   atol=1e-5)
        asked = client.post("/v1/embed", json={"texts": LINES, "pooling": "mean",
                                               "normalize": False}).json()
        np.testing.assert_allclose(asked["embeddings"], np.load(tmp_path / "b.npy"),
                                   atol=1e-5)
        openai_shaped = client.post("/v1/embeddings", json={"input": LINES}).json()["data"]
        np.testing.assert_allclose([item["embedding"] for item in openai_shaped],
                                   np.load(tmp_path / "a.npy"), atol=1e-5)
        bad = client.post("/v1/embed", json={"texts": LINES, "pooling": "max"})
        assert bad.status_code == 422 and "pooling" in bad.text
        described = client.get("/v1/models").json()["data"][0]
        assert described["sentence_embedding"] == {"pooling": "cls", "normalize": True}


def test_a_model_without_a_record_pools_the_mean(vocab, tmp_path):
    hf_checkpoint(tmp_path / "hf", "BertModel", vocab / "uncased" / "json", **CONFIGS[0])
    encoder = SentenceEncoder.load(import_bert(tmp_path / "hf", tmp_path / "ours"))
    assert encoder.embedding_defaults == {"pooling": "mean", "normalize": False}
    with pytest.raises(Exception, match="pooling='max': choose one of mean, cls"):
        encoder.embed(LINES, pooling="max")


DENSE = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}


@pytest.mark.parametrize("change,messages", [
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_max_tokens": True})), ["pooling_mode_max_tokens", "only one of"]),
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})),
     ["pooling pooling_mode_mean_tokens, pooling_mode_cls_token"]),
    (lambda d: (d / "1_Pooling" / "config.json").unlink(), ["config.json: missing"]),
    (lambda d: (d / "modules.json").write_text("{"), ["modules.json: unreadable"]),
    (lambda d: (d / "modules.json").write_text(json.dumps(
        json.loads((d / "modules.json").read_text()) + [DENSE])),
     ["a Dense module ('3_Dense') after pooling", "remove modules.json"]),
])
def test_what_sentence_transformers_does_otherwise_is_refused(vocab, tmp_path, change, messages):
    directory = tmp_path / "hf"
    sentence_transformers_dir(directory, vocab / "uncased" / "json", "cls", True)
    change(directory)
    assert_refused(import_bert, directory, tmp_path, *messages)


def test_a_damaged_record_is_named(vocab, tmp_path):
    sentence_transformers_dir(tmp_path / "hf", vocab / "uncased" / "json", "mean", False)
    out = import_bert(tmp_path / "hf", tmp_path / "ours")
    config = json.loads((out / "config.json").read_text())
    config["sentence_embedding"] = {"pooling": "max", "normalize": False}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(checkpoint.CheckpointError, match="\"sentence_embedding\" must be"):
        SentenceEncoder.load(out)
