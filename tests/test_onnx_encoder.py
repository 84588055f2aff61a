"""An encoder-only model's ONNX export (one graph: hidden states, pooled output, sentence
embeddings, class logits) run by ONNX Runtime computes what our model computes, for
padded batches and pairs of segments, and what transformers computes for an imported
BERT; classify, embed and a server give the same answers on it as on the checkpoint."""

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from tests.test_export_decoder import VOCAB, saved_language_model
from tests.test_import_bert import CONFIGS, VOCAB as BERT_VOCAB, batch, hf_checkpoint
from transduce import checkpoint, load
from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.corpus import write_text_metadata
from transduce.decode.encode import SentenceEncoder
from transduce.decode.generate import Generator
from transduce.importers import import_bert
from transduce.serve import create_app

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from transduce.decode.onnx_encoder_engine import OnnxSentenceEncoder  # noqa: E402
from transduce.export.onnx import export_onnx  # noqa: E402

VARIANTS = {
    "bert": {},
    "bert-classifier": {"num_labels": 3},
    "pre-norm-rotary-gqa": {"norm_first": True, "positional": "rotary", "num_kv_heads": 2,
                            "num_labels": 2},
    "qk-norm": {"qk_norm": True},
}
LINES = ["uno dos tres casa", "el perro come", "", "gato rojo grande come el perro " * 3]


def exported(tmp_path, tiny_corpus, variant):
    model, path = saved_language_model(tmp_path, tiny_corpus, "bert-tiny",
                                       **VARIANTS[variant])
    if model.config.num_labels:
        model.labels = [f"class {i}" for i in range(model.config.num_labels)]
        path = checkpoint.save(tmp_path / "labelled", model, None, path / "spm.model")
    return model, path, OnnxSentenceEncoder(export_onnx(path, tmp_path / "onnx"))


def graph_outputs(engine, ids, segments):
    names = [output.name for output in engine.session.get_outputs()]
    arrays = engine.session.run(None, {"ids": ids.numpy(), "segments": segments.numpy()})
    return {name: torch.from_numpy(array) for name, array in zip(names, arrays)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_outputs_match_at_other_sizes_with_padding_and_segments(tmp_path, tiny_corpus, variant):
    model, _, engine = exported(tmp_path, tiny_corpus, variant)
    for lengths in ([1], [11, 5, 2], [3, 3]):
        ids = torch.randint(4, VOCAB, (len(lengths), max(lengths)))
        real = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
        ids = ids.masked_fill(~real, model.config.pad_id)
        segments = (torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None] // 2
                    ).long() * real
        got = graph_outputs(engine, ids, segments)
        with torch.no_grad():
            hidden = model(ids, segments)
            pooled = model.pool(hidden)
            want = {"hidden": hidden, "pooled": pooled,
                    "embeddings": model.sentence_embeddings(ids, segments)}
            if model.config.num_labels:
                want["logits"] = model.classify_logits(pooled)
        assert sorted(got) == sorted(want)
        for name in want:
            chosen = real if name == "hidden" else slice(None)
            torch.testing.assert_close(got[name][chosen], want[name][chosen], rtol=0, atol=1e-4)


def test_classify_embed_cli_and_server_give_the_checkpoint_s_answers(tmp_path, tiny_corpus,
                                                                      capsys):
    _, path, _ = exported(tmp_path, tiny_corpus, "bert-classifier")
    out = tmp_path / "cli"
    assert main(["export", "onnx", str(path), str(out)]) == 0
    assert "run it with `transduce classify|embed --model" in capsys.readouterr().out
    ours, theirs = SentenceEncoder.load(path), load(out)
    assert isinstance(theirs, SentenceEncoder) and isinstance(theirs.model, OnnxSentenceEncoder)
    assert theirs.labels == ours.labels == ["class 0", "class 1", "class 2"]
    for got, want in zip(theirs.classify(LINES, batch_tokens=16), ours.classify(LINES)):
        assert got.label == want.label
        assert got.probabilities == pytest.approx(want.probabilities, abs=1e-5)
    np.testing.assert_allclose(theirs.embed(LINES, normalize=True),
                               ours.embed(LINES, normalize=True), atol=1e-5)
    (tmp_path / "lines.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    for engine in ("auto", "onnxruntime"):
        assert main(["classify", "--model", str(out), "--engine", engine,
                     "--input", str(tmp_path / "lines.txt")]) == 0
        assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == \
            [p.label for p in ours.classify(LINES)]
    assert main(["embed", "--model", str(out), "--input", str(tmp_path / "lines.txt"),
                 "--out", str(tmp_path / "vectors.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "vectors.npy"), ours.embed(LINES), atol=1e-5)
    corpus = tmp_path / "labelled-corpus"
    corpus.mkdir()
    (corpus / "test.tsv").write_text("".join(f"class {i % 3}\t{line or 'casa'}\n"
                                             for i, line in enumerate(LINES)), encoding="utf-8")
    write_text_metadata(corpus, "es", kind="classification")
    for model in (path, out):        # the checkpoint's predictions, then the export's
        assert main(["evaluate", "--model", str(model), "--data", str(corpus),
                     "--out", str(tmp_path / f"eval-{model.name}")]) == 0
    predictions = [[line.split("\t")[0] for line in (tmp_path / f"eval-{model.name}.tsv")
                    .read_text(encoding="utf-8").splitlines()] for model in (path, out)]
    assert predictions[1] == predictions[0] and len(predictions[0]) == len(LINES)
    capsys.readouterr()
    with TestClient(create_app(theirs)) as client:
        classified = client.post("/v1/classify", json={"texts": LINES}).json()["predictions"]
        assert [p["label"] for p in classified] == [p.label for p in ours.classify(LINES)]
        embedded = client.post("/v1/embed", json={"texts": LINES}).json()
        np.testing.assert_allclose(embedded["embeddings"], ours.embed(LINES), atol=1e-5)
        described = client.get("/v1/models").json()["data"][0]
        assert described["kind"] == "encoder" and described["labels"] == ours.labels
        assert described["attention_maps"] is False            # the graph returns states
        assert client.post("/v1/attention", json={"text": "a"}).status_code == 404


def test_an_imported_bert_export_computes_what_transformers_computes(tmp_path):
    vocabulary = tmp_path / "vocab"
    vocabulary.mkdir()
    (vocabulary / "vocab.txt").write_text("\n".join(BERT_VOCAB) + "\n", encoding="utf-8")
    (vocabulary / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    hf = hf_checkpoint(tmp_path / "hf", "BertForSequenceClassification", vocabulary,
                       **dict(CONFIGS[1]))
    engine = OnnxSentenceEncoder(export_onnx(import_bert(tmp_path / "hf", tmp_path / "ours"),
                                             tmp_path / "onnx"))
    ids, segments, mask = batch(hf.config)
    got = graph_outputs(engine, ids, segments)
    with torch.no_grad():
        result = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=segments,
                    output_hidden_states=True)
    torch.testing.assert_close(got["hidden"][mask], result.hidden_states[-1][mask],
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got["logits"], result.logits, atol=1e-4, rtol=1e-5)
    assert engine.labels == ["negative", "neutral", "positive"]


def test_int8_export_stays_close(tmp_path, tiny_corpus):
    model, path, _ = exported(tmp_path, tiny_corpus, "bert-classifier")
    engine = OnnxSentenceEncoder(export_onnx(path, tmp_path / "int8", quantize="int8"))
    ids = torch.randint(4, VOCAB, (3, 9))
    got = graph_outputs(engine, ids, torch.zeros_like(ids))
    with torch.no_grad():
        hidden = model(ids)
    error = (got["hidden"] - hidden).abs().max().item()
    assert 0 < error < 0.1 * hidden.abs().max().item()      # quantized, and close


def test_wrong_uses_of_the_export_are_refused_clearly(tmp_path, tiny_corpus, capsys):
    _, path, _ = exported(tmp_path, tiny_corpus, "bert")
    out = tmp_path / "onnx"
    with pytest.raises(ConfigError, match="--dtype"):
        SentenceEncoder.load(out, dtype="bfloat16")
    with pytest.raises(ConfigError, match="no classification head"):
        load(out).classify(LINES)
    with pytest.raises(ConfigError, match="generation needs a language model"):
        Generator.load(out)
    assert main(["classify", "--model", str(out), "--engine", "torch"]) == 2
    assert "only ONNX Runtime runs" in capsys.readouterr().err
    assert main(["translate", "--model", str(out)]) == 2
    assert "translation needs an encoder-decoder" in capsys.readouterr().err
    assert main(["generate", "--model", str(out), "--prompt", "a"]) == 2
    assert "generation needs a language model" in capsys.readouterr().err
