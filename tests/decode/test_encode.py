"""Classifying and embedding lines with an encoder-only model: N in, N out, in order;
batched equals one at a time; embeddings are masked means of the last hidden states."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError, preset
from transduce.data.tokenizer import BOS_ID, EOS_ID, Tokenizer
from transduce.decode.encode import SentenceEncoder
from transduce.decode.evaluate import macro_f1
from transduce.decode.inputs import PromptIds, TextError
from transduce.errors import LineTruncated
from transduce.model import build_model
from transduce.model import int8 as int8_module
from tests.environment import subprocess_env

LINES = ["uno dos", "el perro grande come", "", "casa", "tres gato rojo rojo el casa perro"]
LABELS = ["animals", "numbers", "things"]


@pytest.fixture(scope="module")
def model(tiny_corpus):
    torch.manual_seed(0)
    vocab = Tokenizer(tiny_corpus / "spm.model").vocab_size
    net = build_model(preset("bert-tiny", src_vocab_size=vocab, tgt_vocab_size=vocab,
                             num_labels=len(LABELS))).eval()
    net.labels = LABELS
    return net


@pytest.fixture(scope="module")
def encoder(model, tiny_corpus):
    return SentenceEncoder(model, Tokenizer(tiny_corpus / "spm.model"))


@pytest.fixture(scope="module")
def saved(model, tiny_corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("bert") / "model"
    checkpoint.save(path, model, None, tiny_corpus / "spm.model")
    return path


def test_classify_gives_one_prediction_per_line_in_order(encoder):
    together = encoder.classify(LINES, batch_tokens=64)
    alone = [encoder.classify([line])[0] for line in LINES]
    assert len(together) == len(LINES)
    for a, b in zip(together, alone):
        assert a.label == b.label and a.label in LABELS
        assert sum(a.probabilities.values()) == pytest.approx(1.0, abs=1e-5)
        assert a.probability == pytest.approx(b.probability, abs=1e-5)
        assert a.probability == max(a.probabilities.values())


@pytest.mark.skipif(not int8_module.int8_available(), reason="no oneDNN int8 ops in this build")
def test_int8_classifies_alike_alone_and_in_a_batch_near_the_float_model(model, encoder,
                                                                          monkeypatch):
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)      # every product in int8
    int8 = SentenceEncoder(model, encoder.tokenizer, dtype="int8")
    together = int8.classify(LINES, batch_tokens=64)
    alone = [int8.classify([line])[0] for line in LINES]
    exact = encoder.classify(LINES)
    for a, b, c in zip(together, alone, exact):
        assert a.probabilities == b.probabilities
        assert all(abs(a.probabilities[name] - c.probabilities[name]) < 0.05 for name in LABELS)


def test_embeddings_are_masked_means_of_the_last_hidden_states(encoder, model):
    vectors = encoder.embed(LINES, batch_tokens=64)
    assert vectors.shape == (len(LINES), model.config.d_model) and vectors.dtype == np.float32
    for line, vector in zip(LINES, vectors):
        ids = torch.tensor([[BOS_ID, *encoder.tokenizer.encode([line])[0], EOS_ID]])
        with torch.no_grad():
            expected = model(ids)[0].mean(dim=0)       # alone: no padding to leave out
        np.testing.assert_allclose(vector, expected.numpy(), atol=1e-5, rtol=0)
    unit = encoder.embed(LINES, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)


def test_token_ids_are_read_as_they_are_and_texts_as_cls_text_sep(encoder, model):
    items = encoder.item_ids(LINES)
    assert items == [[BOS_ID, *ids, EOS_ID] for ids in encoder.tokenizer.encode(LINES)]
    given = [PromptIds(ids) for ids in items]
    mixed = [given[i] if i % 2 else line for i, line in enumerate(LINES)]
    np.testing.assert_array_equal(encoder.embed(mixed, batch_tokens=64),
                                  encoder.embed(LINES, batch_tokens=64))   # the same batches
    bare = PromptIds(items[1][1:-1])             # no [CLS] or [SEP]: read without them
    with torch.no_grad():
        expected = model(torch.tensor([bare]))[0].mean(dim=0).numpy()
    np.testing.assert_allclose(encoder.embed([bare])[0], expected, atol=1e-5, rtol=0)
    assert [p.label for p in encoder.classify(given)] == \
        [p.label for p in encoder.classify(LINES)]


@pytest.mark.parametrize("ids,problem", [
    ([], "line 2: no token ids"), ([5, -1], "line 2: token 1 is -1, not an id"),
    ([5, 10**6], "token 1 is 1000000, not an id of the model's vocabulary"),
    ([True], "token 0 is True")])
def test_ids_the_model_lacks_are_refused_naming_the_line(encoder, ids, problem):
    with pytest.raises(TextError, match=problem):
        encoder.embed(["uno", PromptIds(ids)])
    with pytest.raises(TextError, match="line 2: a list"):       # a list is no text
        encoder.embed(["uno", [5, 6]])


def test_a_line_over_the_models_positions_is_cut_with_a_warning(encoder, model):
    limit = model.config.max_positions
    long = " ".join(["casa perro"] * limit)
    (ids,) = encoder.item_ids([long])
    with pytest.warns(LineTruncated, match=f"line 2: {len(ids) - 2} tokens, truncated to the "
                                           f"model's limit of {limit}"):
        cut = encoder.embed(["uno", long])[1]
    kept = PromptIds([*ids[:limit - 1], EOS_ID])            # [SEP] kept at the end
    np.testing.assert_allclose(cut, encoder.embed([kept])[0], atol=1e-6, rtol=0)
    with pytest.warns(LineTruncated, match=f"line 1: {len(ids)} token ids, truncated"):
        given = encoder.embed([PromptIds(ids)])[0]
    np.testing.assert_allclose(given, encoder.embed([PromptIds(ids[:limit])])[0], atol=1e-6,
                               rtol=0)


def test_a_cpu_runs_batches_of_512_tokens_unless_told(encoder, monkeypatch):
    assert encoder.batch_tokens == 512
    shapes = []
    run = encoder._embeddings
    monkeypatch.setattr(encoder, "_embeddings",
                        lambda ids, pooling: shapes.append(ids.shape) or run(ids, pooling))
    lines = [" ".join(["casa perro"] * (1 + i % 7)) for i in range(200)]
    together = encoder.embed(lines)
    assert len(shapes) > 4 and all(b * t <= 512 for b, t in shapes)
    shapes.clear()
    np.testing.assert_allclose(encoder.embed(lines, batch_tokens=8192), together, atol=1e-5)
    assert len(shapes) <= 2 and max(b * t for b, t in shapes) > 2048


def test_a_model_without_a_classifier_or_of_another_kind_is_refused(tiny_corpus):
    tokenizer = Tokenizer(tiny_corpus / "spm.model")
    vocab = tokenizer.vocab_size
    plain = SentenceEncoder(build_model(preset("bert-tiny", src_vocab_size=vocab,
                                               tgt_vocab_size=vocab)), tokenizer)
    with pytest.raises(ConfigError, match="no classification head"):
        plain.classify(LINES)
    assert plain.embed(LINES).shape[0] == len(LINES)          # embedding needs no head
    with pytest.raises(ConfigError, match="encoder-only"):
        SentenceEncoder(build_model(preset("gpt-tiny", src_vocab_size=vocab,
                                           tgt_vocab_size=vocab)), tokenizer)


@pytest.mark.parametrize("batch_tokens", [0, -4, 2.5, True])
def test_batch_tokens_that_is_not_a_positive_integer_is_refused(encoder, batch_tokens):
    for method in (encoder.classify, encoder.embed):
        with pytest.raises(ConfigError, match=f"batch_tokens={batch_tokens!r}: must be a "
                                              f"positive integer"):
            method(LINES, batch_tokens=batch_tokens)


def test_cli_classify_and_embed(saved, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert main(["classify", "--model", str(saved), "--input", str(source)]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(LINES) and all(label in LABELS for label, _ in rows)
    assert main(["classify", "--model", str(saved), "--input", str(source), "--all"]) == 0
    first = capsys.readouterr().out.splitlines()[0].split("\t")
    assert [field.split("=")[0] for field in first] == LABELS
    out = tmp_path / "vectors.npy"
    assert main(["embed", "--model", str(saved), "--input", str(source), "--out", str(out),
                 "--normalize"]) == 0
    assert np.load(out).shape == (len(LINES), 64)


def test_cli_names_the_invalid_line_on_stdin(saved):
    result = subprocess.run([sys.executable, "-m", "transduce", "classify", "--model",
                             str(saved)], input=b"uno\n\xff\n", capture_output=True,
                            env=subprocess_env())
    assert result.returncode == 1 and b"<stdin>:2: invalid UTF-8" in result.stderr
    assert b"Traceback" not in result.stderr


def test_evaluate_reports_accuracy_and_macro_f1(saved, encoder, tmp_path, capsys):
    data = tmp_path / "labelled"
    data.mkdir()
    gold = ["numbers", "animals", "things", "animals"]
    texts = ["uno dos", "el perro grande come", "casa", "gato rojo"]
    (data / "test.tsv").write_text("".join(f"{g}\t{t}\n" for g, t in zip(gold, texts)))
    assert main(["evaluate", "--model", str(saved), "--data", str(data),
                 "--out", str(tmp_path / "eval")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    predicted = [p.label for p in encoder.classify(texts)]
    assert result["accuracy"] == pytest.approx(np.mean([p == g for p, g in zip(predicted, gold)]))
    assert 0.0 <= result["macro_f1"] <= 1.0 and result["classes"] == LABELS
    assert (tmp_path / "eval.tsv").read_text().count("\n") == len(texts)
    (data / "test.tsv").write_text("numbers\tuno\nbirds\tdos\n")
    assert main(["evaluate", "--model", str(saved), "--data", str(data)]) == 1
    assert "test.tsv:2: label 'birds' is not one of the 3 classes" in capsys.readouterr().err


def test_macro_f1_is_the_mean_of_the_classes_f1():
    predicted, gold = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 1, 1, 2, 2, 0])
    # class 0: tp 1 fp 1 fn 1 -> 0.5; class 1: tp 1 fp 0 fn 1 -> 2/3; class 2: tp 2 fp 1 fn 0 -> 0.8
    assert macro_f1(predicted, gold, 3) == pytest.approx((0.5 + 2 / 3 + 0.8) / 3)


def test_transduce_load_gives_the_object_of_the_models_kind(saved, tiny_corpus, tmp_path):
    import transduce
    from transduce.decode.generate import Generator
    from transduce.decode.translate import Translator

    assert isinstance(transduce.load(saved), SentenceEncoder)
    assert transduce.load(saved).classify(["uno"])[0].label in LABELS
    vocab = Tokenizer(tiny_corpus / "spm.model").vocab_size
    for name, kind in (("gpt-tiny", Generator), ("tiny", Translator)):
        path = tmp_path / name
        checkpoint.save(path, build_model(preset(name, src_vocab_size=vocab,
                                                 tgt_vocab_size=vocab)), None,
                        tiny_corpus / "spm.model")
        assert isinstance(transduce.load(path), kind)


def test_load_encodes_with_the_model_it_read_as_a_copy_would(model, encoder, saved):
    """SentenceEncoder.load hands its own model over (in_place): one copy, not two."""
    loaded = SentenceEncoder.load(saved)
    assert np.allclose(loaded.embed(LINES), encoder.embed(LINES), atol=1e-6)
    given = build_model(model.config)
    given.labels = model.labels
    assert SentenceEncoder(given, encoder.tokenizer, in_place=True).model is given
