"""Classifying pairs of texts (entailment, paraphrase): `label<TAB>text<TAB>text` corpora
read as [CLS] A [SEP] B [SEP] with B in segment 1 (RoBERTa's <s> A </s></s> B </s>, one
segment), a long pair cut as the tokenizers library cuts one. Shown against
transformers: the batch training builds is the fast tokenizer's encoding of the pairs,
BertForSequenceClassification's and RobertaForSequenceClassification's loss on it is
ours, and classify() gives their probabilities, long pairs included, in PyTorch and
ONNX Runtime; and end to end: a task that needs both texts is learnt from the command
line, classified with --pairs, evaluated and served."""

import json
import random

import numpy as np
import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import TrainConfig
from transduce.data.corpus import CorpusError
from transduce.data.labelled import read_labelled
from transduce.data.masking import crop_pair
from transduce.data.tokenizer import train_tokenizer
from transduce.decode.encode import SentenceEncoder
from transduce.errors import LineTruncated
from transduce.importers import import_bert, import_roberta
from transduce.model import load_model
from transduce.train import encoder as encoder_training
from transduce.train.loop import _training_tokenizer
from tests.serve.conftest import client_for
from tests.test_import_roberta import TEXT, roberta_classifier, roberta_vocab  # noqa: F401
from tests.train.test_imported_encoder import VOCAB

transformers = pytest.importorskip("transformers")

NAMES = ["negative", "positive"]
WORDS = "one two three four five six seven eight nine ten eleven twelve".split()


def write_bert(directory):
    """A random BertForSequenceClassification over test_imported_encoder's vocabulary
    (its specials away from 0-4), 40 positions."""
    directory.mkdir()
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    fast = transformers.BertTokenizerFast.from_pretrained(str(directory))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=48, max_position_embeddings=40, pad_token_id=VOCAB.index("[PAD]"),
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.2,
        id2label=dict(enumerate(NAMES)), label2id={n: i for i, n in enumerate(NAMES)})
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return model


def pair_texts(family, rng, count):
    """(label, A, B) triples of the family's words, some A or B long."""
    pool = WORDS if family == "bert" else " ".join(TEXT).split()
    def text():
        return " ".join(rng.choice(pool) for _ in range(rng.randint(1, 9)))
    return [(rng.choice(NAMES), text(), text()) for _ in range(count)]


@pytest.fixture(scope="module", params=["bert", "roberta"])
def classifier(request, roberta_vocab, tmp_path_factory):  # noqa: F811 - a fixture
    """(family, transformers' model, its directory, our import, a pair corpus)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "bert":
        hf = write_bert(root / "hf")
        ours = import_bert(root / "hf", root / "ours")
    else:
        hf = roberta_classifier(root / "hf", roberta_vocab)
        ours = import_roberta(root / "hf", root / "ours")
    data = root / "data"
    data.mkdir()
    rng = random.Random(0)
    for split in ("train", "dev"):
        (data / f"{split}.tsv").write_text("".join(
            "\t".join(triple) + "\n" for triple in pair_texts(request.param, rng, 12)))
    (data / "corpus.json").write_text('{"kind": "classification", "lang": "en"}')
    return request.param, hf, root / "hf", ours, data


def test_a_pair_batch_gives_transformers_loss(classifier):
    family, hf, hf_dir, ours, data = classifier
    model_config, _ = checkpoint.read_configs(ours)
    tokenizer = _training_tokenizer(data, ours, model_config)
    split, batcher, _ = encoder_training.load_encoder_data(
        data, tokenizer, model_config, TrainConfig(task="classify", max_tokens=2000))
    indices = batcher.epoch_batches(0)[0]
    assert len(indices) == 12 and split.second_ids is not None
    batch = batcher.collate(indices, (0, 0))
    fast = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    corpus = split.corpus
    encoded = fast([corpus.texts[i] for i in indices], [corpus.seconds[i] for i in indices],
                   padding=True, return_tensors="pt")
    assert torch.equal(batch.ids, encoded["input_ids"])
    types = encoded.get("token_type_ids", torch.zeros_like(batch.ids))
    assert torch.equal(batch.segments, types)
    assert bool((batch.segments == 1).any()) == (family == "bert")   # RoBERTa: one type
    with torch.no_grad():
        expected = hf(**encoded, labels=batch.labels).loss
        model = load_model(ours).eval()
        losses = encoder_training.batch_losses(model, model, batch)
    torch.testing.assert_close(losses.sums["classify"] / len(indices), expected,
                               atol=1e-5, rtol=1e-5)


def test_pairs_classify_as_transformers_long_ones_cut_alike(classifier, tmp_path):
    family, hf, hf_dir, ours, data = classifier
    corpus = read_labelled(data / "dev.tsv")
    long = " ".join(["one two"] * 30) if family == "bert" else " ".join(TEXT)
    texts, seconds = corpus.texts + [long, "two"], corpus.seconds + ["three", long]
    fast = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    limit = load_model(ours).config.max_positions
    encoded = fast(texts, seconds, padding=True, truncation="longest_first", max_length=limit,
                   return_tensors="pt")
    with torch.no_grad():
        expected = hf(**encoded).logits.softmax(dim=-1).numpy()
    assert encoded["input_ids"].shape[1] == limit     # the long pairs were cut
    main(["export", "onnx", str(ours), str(tmp_path / "onnx")])
    for source in (ours, tmp_path / "onnx"):
        encoder = SentenceEncoder.load(source)
        with pytest.warns(LineTruncated) as caught:
            found = encoder.classify(texts, pairs=seconds, batch_tokens=200)
        assert sorted(str(w.message).split(":")[0] for w in caught) == \
            [f"line {len(texts) - 1}", f"line {len(texts)}"]
        got = np.array([[p.probabilities[name] for name in NAMES] for p in found])
        np.testing.assert_allclose(got, expected, atol=1e-5)
    with pytest.raises(ValueError, match="3 texts but 2 second texts"):
        encoder.classify(texts[:3], pairs=seconds[:2])


def test_crop_pair_cuts_as_the_tokenizers_longest_first(tmp_path):
    """Every split of a pair over a room that cuts it, against BertTokenizerFast's."""
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    fast = transformers.BertTokenizerFast.from_pretrained(str(tmp_path))
    for len_a in range(1, 9):
        for len_b in range(1, 9):
            for max_len in range(5, len_a + len_b + 4):
                types = fast(" ".join(["one"] * len_a), " ".join(["two"] * len_b),
                             truncation="longest_first", max_length=max_len)["token_type_ids"]
                a, b = crop_pair(np.arange(len_a), np.arange(len_b), max_len)
                assert (len(a), len(b)) == (types.count(0) - 2, types.count(1) - 1), \
                    (len_a, len_b, max_len)


@pytest.fixture(scope="module")
def same_or_not(tmp_path_factory):
    """A pair corpus whose label needs both texts: "same" when B repeats A (half the
    pairs), else "different"; with a vocabulary of the words."""
    data = tmp_path_factory.mktemp("same-or-not")
    rng = random.Random(0)

    def pair():
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        b = a if rng.random() < 0.5 else \
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        return ("same" if a == b else "different"), a, b

    for split, size in (("train", 400), ("dev", 60), ("test", 60)):
        (data / f"{split}.tsv").write_text("".join("\t".join(pair()) + "\n"
                                                   for _ in range(size)))
    (data / "corpus.json").write_text('{"kind": "classification", "lang": "en"}')
    train_tokenizer([" ".join(WORDS)] * 50, data, vocab_size=320)
    return data


def test_a_task_of_pairs_is_learnt_classified_evaluated_and_served(same_or_not, tmp_path,
                                                                   capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(same_or_not), "--out", str(run), "--arch", "encoder",
                 "--preset", "bert-tiny", "--task", "classify", "--max-steps", "600",
                 "--max-tokens", "256", "--dtype", "float32", "--eval-every", "600"]) == 0
    dev = [json.loads(line) for line in (run / "log.jsonl").open() if '"dev"' in line][-1]
    assert dev["dev_accuracy"] > 0.7, dev      # chance: about 0.5
    capsys.readouterr()
    lines = tmp_path / "pairs.txt"
    lines.write_text("one two\tone two\nthree\tnine ten\n", encoding="utf-8")
    assert main(["classify", "--model", str(run), "--input", str(lines), "--pairs"]) == 0
    printed = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    encoder = SentenceEncoder.load(run)
    expected = encoder.classify(["one two", "three"], pairs=["one two", "nine ten"])
    assert printed == [p.label for p in expected]
    assert main(["evaluate", "--model", str(run), "--data", str(same_or_not),
                 "--split", "test", "--out", str(tmp_path / "test")]) == 0
    result = json.loads((tmp_path / "test.json").read_text(encoding="utf-8"))
    assert result["lines"] == 60 and result["accuracy"] > 0.7
    long = "one " * encoder.model.config.max_positions
    with client_for(encoder, max_chars=len(long), max_texts=16) as client:
        answer = client.post("/v1/classify", json={"texts": ["one two", "three"],
                                                   "text_pairs": ["one two", "nine ten"]})
        assert answer.status_code == 200, answer.text
        assert [p["label"] for p in answer.json()["predictions"]] == \
            [p.label for p in expected]
        for body, status, field in [
                ({"texts": ["one"], "text_pairs": ["one", "two"]}, 422, "text_pairs"),
                ({"texts": ["one"], "text_pairs": [long]}, 413, "texts[0]"),
                ({"texts": ["one"], "text_pairs": [long + "x"]}, 413, "text_pairs[0]"),
                ({"texts": ["one"], "text_pairs": []}, 422, None)]:
            answer = client.post("/v1/classify", json=body)
            assert answer.status_code == status, (body, answer.text)
            if field:
                assert answer.json()["field"] == field


def test_bad_pair_input_is_named(same_or_not, tmp_path, capsys):
    """A split of single texts beside one of pairs, a file of both, and a --pairs line
    without its tab."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.tsv", "corpus.json", "spm.model"):
        (data / name).write_bytes((same_or_not / name).read_bytes())
    (data / "dev.tsv").write_text("same\tone two\n", encoding="utf-8")
    common = ["--arch", "encoder", "--preset", "bert-tiny", "--task", "classify",
              "--max-steps", "1"]
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), *common]) == 2
    assert "one holds pairs of texts, the other single texts" in capsys.readouterr().err
    (data / "dev.tsv").write_text("same\tone\tone\nsame\tone two\n", encoding="utf-8")
    with pytest.raises(CorpusError, match="dev.tsv:2: a single text, where line 1 has a "
                                          "pair of texts: a file holds one kind"):
        read_labelled(data / "dev.tsv")
    run = tmp_path / "tiny"
    assert main(["train", "--data", str(same_or_not), "--out", str(run), *common]) == 0
    (tmp_path / "in.txt").write_text("one\ttwo\nthree four\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["classify", "--model", str(run), "--input", str(tmp_path / "in.txt"),
                 "--pairs"]) == 1
    assert "in.txt:2: 0 tabs; --pairs reads `text<TAB>second text` lines" in \
        capsys.readouterr().err


def test_a_classifier_records_what_it_classifies(same_or_not, tmp_path, capsys):
    """Fine-tuned on pairs or on single texts, the checkpoint says which (through
    averaging and the ONNX export); classify, the CLI, evaluate and the server then
    refuse the other kind of input by name, where they would answer with classes that
    mean nothing for it. An unrecorded classifier (an import) takes either."""
    from transduce.config import ConfigError
    from transduce.export.onnx import export_onnx

    texts = tmp_path / "texts"
    texts.mkdir()
    for name in ("corpus.json", "spm.model"):
        (texts / name).write_bytes((same_or_not / name).read_bytes())
    for split in ("train", "dev", "test"):
        rows = (same_or_not / f"{split}.tsv").read_text(encoding="utf-8").splitlines()
        (texts / f"{split}.tsv").write_text("".join(
            "\t".join(row.split("\t")[:2]) + "\n" for row in rows), encoding="utf-8")
    common = ["--arch", "encoder", "--preset", "bert-tiny", "--task", "classify",
              "--max-steps", "1", "--save-every", "1"]
    for data, name in ((same_or_not, "pairs"), (texts, "texts")):
        assert main(["train", "--data", str(data), "--out", str(tmp_path / name),
                     *common]) == 0
        latest = checkpoint.resolve(tmp_path / name)
        averaged = checkpoint.average([latest, latest], tmp_path / f"{name}-average")
        for path in (latest, averaged):
            assert checkpoint.read_classifier_inputs(path) == name, path
    pairs_model = SentenceEncoder.load(tmp_path / "pairs")
    onnx_model = SentenceEncoder.load(export_onnx(tmp_path / "pairs", tmp_path / "onnx"))
    for encoder in (pairs_model, onnx_model):
        assert len(encoder.classify(["one"], pairs=["one"])) == 1
        with pytest.raises(ConfigError, match="fine-tuned on pairs of texts: give each text "
                                              "its second text"):
            encoder.classify(["one"])
    with pytest.raises(ConfigError, match="fine-tuned on single texts, not pairs"):
        SentenceEncoder.load(tmp_path / "texts").classify(["one"], pairs=["one"])
    (tmp_path / "in.txt").write_text("one two\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["classify", "--model", str(tmp_path / "pairs"),
                 "--input", str(tmp_path / "in.txt")]) == 2
    assert "--pairs FILE on the command line" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(tmp_path / "texts"), "--data", str(same_or_not),
                 "--split", "test", "--out", str(tmp_path / "test")]) == 2
    assert "fine-tuned on single texts" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(tmp_path / "pairs"), "--data", str(same_or_not),
                 "--split", "test", "--no-doubles", "--out", str(tmp_path / "test")]) == 2
    assert "--no-doubles applies to translation" in capsys.readouterr().err
    with client_for(pairs_model, max_chars=100, max_texts=16) as client:
        assert client.get("/v1/models").json()["data"][0]["classifier_inputs"] == "pairs"
        answer = client.post("/v1/classify", json={"texts": ["one"]})
        assert answer.status_code == 422 and answer.json()["field"] == "text_pairs"
        assert "fine-tuned on pairs of texts" in answer.text
    pairs_model.classifier_inputs = None                  # as an import: either kind
    assert len(pairs_model.classify(["one"])) == 1
    config = json.loads((averaged / checkpoint.CONFIG).read_text(encoding="utf-8"))
    (averaged / checkpoint.CONFIG).write_text(json.dumps({**config, "classifier_inputs":
                                                          "triples"}), encoding="utf-8")
    with pytest.raises(checkpoint.CheckpointError, match='config.json: "classifier_inputs" '
                                                         'must be "texts" or "pairs"'):
        SentenceEncoder.load(averaged)
