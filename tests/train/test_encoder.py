"""Encoders (arch "encoder", BERT) in the training loop: a toy masked LM and a toy
classification learnt, exact resume, two processes equal to one, averaging keeps the
class names, fine-tuning from a pre-trained checkpoint (a new head, named), bad
labelled input named by file:line, and the refusals."""

import json
import random
import re

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError, TrainConfig, preset
from transduce.data.corpus import CorpusError, write_text_metadata
from transduce.data.labelled import read_labelled
from transduce.data.tokenizer import train_tokenizer
from transduce.model import build_model, load_model
from transduce.train.encoder import (EncoderObjective, EncoderTrainingError,
                                     load_pretrained, macro_f1,
                                     unused_parameter_names)
from transduce.train.log import LOG_NAME
from transduce.train import loop
from transduce.train.loop import train
from tests.train.test_loop import (_not_called, assert_two_processes_trained_alike,
                                   train_alone_at_double_update_freq, weights)

WORDS = "one two three four five six seven eight nine ten eleven twelve".split()
VOCAB = 320
CLASSES = {"low": WORDS[:4], "middle": WORDS[4:8], "high": WORDS[8:]}


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """Counting lines from a random word on: each masked word follows from its
    neighbours."""
    directory = tmp_path_factory.mktemp("counting")
    rng = random.Random(0)
    for split, size in (("train", 300), ("dev", 30), ("test", 30)):
        lines = [" ".join(WORDS[rng.randint(0, 9):]) for _ in range(size)]
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_text_metadata(directory, "en")
    train_tokenizer((directory / "train.txt").read_text(encoding="utf-8").splitlines(),
                    directory, vocab_size=VOCAB)
    return directory


def labelled_lines(rng, size):
    """Lines of 3-6 words from one class's words: the class is the line's label."""
    result = []
    for _ in range(size):
        label = rng.choice(sorted(CLASSES))
        words = [rng.choice(CLASSES[label]) for _ in range(rng.randint(3, 6))]
        result.append(f"{label}\t{' '.join(words)}")
    return result


@pytest.fixture(scope="module")
def classes(tmp_path_factory, counting):
    """A classification corpus over the counting words (no vocabulary of its own: a
    run from scratch copies the counting one in, a fine-tuning reads the checkpoint's)."""
    directory = tmp_path_factory.mktemp("classes")
    rng = random.Random(1)
    for split, size in (("train", 240), ("dev", 60), ("test", 30)):
        (directory / f"{split}.tsv").write_text("\n".join(labelled_lines(rng, size)) + "\n",
                                                encoding="utf-8")
    write_text_metadata(directory, "en", kind="classification")
    return directory


def bert_tiny(**changes):
    return preset("bert-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, **changes)


def train_config(**changes):
    values = dict(max_tokens=256, warmup_steps=20, log_every=10, eval_every=1000,
                  save_every=1000, dtype="float32", lr_scale=0.1)
    values.update(changes)
    return TrainConfig(**values)


def dev_records(run):
    lines = (run / LOG_NAME).read_text(encoding="utf-8").splitlines()
    return [record for record in map(json.loads, lines) if record["event"] == "dev"]


def test_a_toy_masked_lm_is_learnt(counting, tmp_path):
    """From the unigram loss (ln 10 ~ 2.3, accuracy ~0.2) to most masked words right."""
    run = tmp_path / "run"
    train(counting, run, bert_tiny(), train_config(max_steps=400, eval_every=400))
    last = dev_records(run)[-1]
    assert last["dev_mlm_loss"] < 0.9 and last["dev_mlm_accuracy"] > 0.8, last


def with_vocabulary(classes, counting, tmp_path):
    directory = tmp_path / "data"
    directory.mkdir()
    for path in classes.iterdir():
        if path.is_file():
            (directory / path.name).write_bytes(path.read_bytes())
    (directory / "spm.model").write_bytes((counting / "spm.model").read_bytes())
    return directory


def test_a_toy_classification_is_learnt_exactly(classes, counting, tmp_path, capsys):
    data = with_vocabulary(classes, counting, tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(run), "--arch", "encoder",
                 "--preset", "bert-tiny", "--task", "classify", "--max-steps", "150",
                 "--max-tokens", "256", "--warmup-steps", "20", "--lr-scale", "0.1",
                 "--eval-every", "150", "--dtype", "float32"]) == 0
    last = dev_records(run)[-1]
    assert last["dev_accuracy"] == 1.0 and last["dev_macro_f1"] == 1.0, last
    model = load_model(run)
    assert model.labels == ["high", "low", "middle"] and model.config.num_labels == 3


def test_fine_tuning_loads_the_encoder_and_names_the_new_head(classes, counting, tmp_path,
                                                              capsys):
    pretrained = tmp_path / "pre"
    train(counting, pretrained, bert_tiny(), train_config(max_steps=20))
    run = tmp_path / "fine"
    assert main(["train", "--data", str(classes), "--out", str(run), "--init", str(pretrained),
                 "--task", "classify", "--max-steps", "1", "--max-tokens", "256",
                 "--dtype", "float32", "--dropout", "0.0"]) == 0
    printed = capsys.readouterr().out
    assert "new classification head (classifier.bias, classifier.weight)" in printed
    before, after = weights(checkpoint.resolve(pretrained)), weights(run / "step-0000001")
    assert "classifier.weight" in after and "classifier.weight" not in before
    assert after["classifier.weight"].shape == (3, 64)
    assert load_model(run).labels == ["high", "low", "middle"]
    # A classifier of another size is a pre-trained encoder too: its head is replaced.
    model = load_model(run)
    bigger = type(model)(model.config.replace(num_labels=5))
    assert load_pretrained(bigger, run, torch.device("cpu")) == \
        ["classifier.bias", "classifier.weight"]
    assert torch.equal(bigger.pooler.weight, model.pooler.weight)
    other = type(model)(model.config.replace(d_ff=256, num_labels=5))
    with pytest.raises(EncoderTrainingError, match="differs from this one in d_ff"):
        load_pretrained(other, run, torch.device("cpu"))


@pytest.mark.parametrize("objective", ["mlm", "mlm,nsp"])
def test_resume_continues_exactly(counting, tmp_path, objective, monkeypatch):
    """2N steps in one go == N steps, stop, resume, N more (mid-epoch), masks and pairs
    included; then averaging the run's checkpoints."""
    config = dict(max_tokens=128, ema_decay=0.5, objective=objective, save_every=3)
    straight, split = tmp_path / "straight", tmp_path / "split"
    model_config = bert_tiny(dropout=0.1)
    train(counting, straight, model_config, train_config(max_steps=12, **config))
    train(counting, split, model_config, train_config(max_steps=6, **config))
    position = checkpoint.load_trainer_state(checkpoint.resolve(split))["position"]
    assert position["batch"] > 0 and position["step"] == 6
    with monkeypatch.context() as patched:     # every weight is read: none drawn first
        patched.setattr(loop, "build_model", _not_called)
        train(counting, split, model_config, train_config(max_steps=12, **config),
              resume=True)
    for part in ("step-0000012", "ema"):
        a, b = weights(straight / part), weights(split / part)
        assert all(torch.equal(a[name], b[name]) for name in a)
    assert main(["average", str(straight), "--last", "2", "--out", str(tmp_path / "avg")]) == 0
    averaged = weights(tmp_path / "avg")
    x, y = weights(straight / "step-0000009"), weights(straight / "step-0000012")
    name = "encoder.layers.0.ffn.w_1.weight" if "encoder.layers.0.ffn.w_1.weight" in x \
        else next(iter(x))
    assert torch.allclose(averaged[name], (x[name] + y[name]) / 2)


def test_averaging_a_classifier_keeps_its_class_names(classes, counting, tmp_path):
    data = with_vocabulary(classes, counting, tmp_path)
    run = tmp_path / "run"
    train(data, run, bert_tiny(num_labels=3),
          train_config(max_steps=4, save_every=2, task="classify"))
    assert main(["average", str(run), "--last", "2", "--out", str(tmp_path / "avg")]) == 0
    assert load_model(tmp_path / "avg").labels == ["high", "low", "middle"]


@pytest.mark.parametrize("line,message", [
    ("low one two", "train.tsv:2: no tab"),
    ("low\t   ", "train.tsv:2: the text (after the first tab) is empty"),
    ("\tone two", "train.tsv:2: the label (before the first tab) is empty"),
    ("low\tone\t", "train.tsv:2: the second text (after the second tab) is empty"),
    ("low\tone\ttwo\tthree", "train.tsv:2: 3 tabs"),
    ("low\tone\ttwo", "train.tsv:2: a pair of texts, where line 1 has a single text"),
])
def test_bad_tsv_lines_are_named_by_file_and_line(tmp_path, line, message):
    (tmp_path / "train.tsv").write_text(f"low\tone\n{line}\nhigh\tnine\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=re.escape(message)):
        read_labelled(tmp_path / "train.tsv")


def test_a_dev_label_outside_the_classes_is_named(classes, counting, tmp_path):
    data = with_vocabulary(classes, counting, tmp_path)
    with open(data / "dev.tsv", "a", encoding="utf-8") as handle:
        handle.write("huge\ttwelve twelve\n")
    with pytest.raises(CorpusError, match=r"dev.tsv:61: label 'huge' is not one of the 3"):
        train(data, tmp_path / "run", bert_tiny(num_labels=3),
              train_config(max_steps=1, task="classify"))


def test_refusals(classes, counting, tmp_path):
    with pytest.raises(ConfigError, match="reads labelled text"):
        train(counting, tmp_path / "a", bert_tiny(num_labels=3),
              train_config(max_steps=1, task="classify"))
    with pytest.raises(ConfigError, match="pass --task classify"):
        train(classes, tmp_path / "b", bert_tiny(), train_config(max_steps=1))
    with pytest.raises(ConfigError, match="are for arch 'encoder'"):
        train(counting, tmp_path / "c", preset("gpt-tiny", src_vocab_size=VOCAB,
                                               tgt_vocab_size=VOCAB),
              train_config(max_steps=1, objective="mlm,nsp"))
    data = with_vocabulary(classes, counting, tmp_path)
    with pytest.raises(ConfigError, match="has 3 classes"):
        train(data, tmp_path / "d", bert_tiny(num_labels=4),
              train_config(max_steps=1, task="classify"))


def test_macro_f1():
    predicted, gold = torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 1, 1])
    # class 0: 2*1/(2+1) ; class 1: 2*1/(2+0+2) ; class 2: 0
    assert macro_f1(predicted, gold, 3) == pytest.approx((2 / 3 + 0.5 + 0) / 3)


@pytest.mark.parametrize("task,objective,unused", [
    ("pretrain", "mlm", ["pooler.bias", "pooler.weight", "nsp_head.bias", "nsp_head.weight",
                         "classifier.bias", "classifier.weight"]),
    ("pretrain", "mlm,nsp", ["classifier.bias", "classifier.weight"]),
    ("classify", "mlm", ["mlm_head.dense.bias", "mlm_head.dense.weight", "mlm_head.norm.bias",
                         "mlm_head.norm.weight", "mlm_head.decoder.bias", "nsp_head.bias",
                         "nsp_head.weight"]),
])
def test_the_heads_an_objective_never_runs_are_named(task, objective, unused):
    """What DDP is told to leave alone, named in the module it wraps; the masked-LM
    head's matrix, the token embeddings, is never among them."""
    model = build_model(bert_tiny(num_labels=3))
    net = EncoderObjective(model)
    names = unused_parameter_names(net, model, TrainConfig(task=task, objective=objective))
    assert sorted(names) == sorted(f"model.{name}" for name in unused)


@pytest.mark.parametrize("task, unused", [
    ("pretrain", ["pooler.weight", "pooler_norm.weight", "nsp_head.bias", "nsp_head.weight",
                  "classifier.bias", "classifier.weight"]),
    ("tag", ["mlm_head.dense.weight", "mlm_head.norm.weight", "mlm_head.decoder.bias",
             "nsp_head.bias", "nsp_head.weight"]),
])
def test_a_prediction_heads_parameters_run_in_every_fine_tuning(task, unused):
    """ModernBERT's heads all read through its prediction head (the pooler and its
    norm): unused in pre-training, used in tagging; and exactly the parameters named
    get no gradient from the task's loss."""
    model = build_model(preset("modernbert-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                               num_labels=3, token_classifier=task == "tag"))
    names = unused_parameter_names(EncoderObjective(model), model, TrainConfig(task=task))
    assert sorted(names) == sorted(f"model.{name}" for name in unused)
    ids = torch.randint(5, VOCAB, (2, 12))
    hidden = model(ids)
    loss = model.mlm_logits(hidden).sum() if task == "pretrain" else \
        model.tag_logits(hidden).sum()
    loss.backward()
    without = sorted(f"model.{name}" for name, p in model.named_parameters() if p.grad is None)
    assert without == sorted(names)


@pytest.mark.parametrize("objective", ["mlm", "mlm,nsp"])
def test_two_processes_equal_one_with_double_update_freq(counting, tmp_path, objective):
    """Pre-training in two gloo processes: the heads run inside the module DDP wraps,
    so every gradient a step uses is averaged across processes; the heads the objective
    does not use (masked LM alone: the pooler and the next-sentence head) are left out
    of DDP, which then needs no search for unused parameters."""
    common = ["--data", str(counting), "--arch", "encoder", "--preset", "bert-tiny",
              "--objective", objective, "--max-tokens", "128", "--max-steps", "4",
              "--warmup-steps", "5", "--threads", "1", "--dtype", "float32"]
    train_alone_at_double_update_freq(tmp_path / "one", common)
    assert_two_processes_trained_alike(tmp_path / "one", tmp_path / "two", common)


def test_fine_tuning_in_two_processes_equals_one(classes, counting, tmp_path):
    """A classifier fine-tuned from a pre-trained encoder in two processes: the
    masked-LM and next-sentence heads are left out of DDP."""
    pretrained = tmp_path / "pre"
    train(counting, pretrained, bert_tiny(), train_config(max_steps=2, max_tokens=128,
                                                          objective="mlm,nsp"))
    common = ["--data", str(classes), "--init", str(pretrained), "--task", "classify",
              "--max-tokens", "128", "--max-steps", "4", "--warmup-steps", "5",
              "--threads", "1", "--dtype", "float32"]
    train_alone_at_double_update_freq(tmp_path / "one", common)
    assert_two_processes_trained_alike(tmp_path / "one", tmp_path / "two", common)
