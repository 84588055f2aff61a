"""Token classifiers (--task tag) in the training loop: a toy tagging learnt from
scratch and scored by `evaluate` and `tag`, fine-tuning a pre-trained encoder into a
tagger (a new head, named), LoRA's head trained whole, and bad corpora named."""

import json
import random

import pytest
import torch

from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.corpus import CorpusError, write_text_metadata
from transduce.model import load_model
from transduce.train.encoder import load_pretrained
from transduce.train.loop import train
from tests.train.test_encoder import WORDS, bert_tiny, counting, dev_records  # noqa: F401
from tests.train.test_encoder import train_config

# Words one to four are LOW, nine to twelve HIGH, the rest O: a run of the same kind is
# one entity, so B- or I- depends on the word before.
KIND = {word: "LOW" for word in WORDS[:4]} | {word: "HIGH" for word in WORDS[8:]}
TAGS = ["B-HIGH", "B-LOW", "I-HIGH", "I-LOW", "O"]


def tagged_sentence(rng):
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
    tags, previous = [], None
    for word in words:
        kind = KIND.get(word)
        tags.append("O" if kind is None else ("I-" if previous == kind else "B-") + kind)
        previous = kind
    return words, tags


def conll(sentences):
    return "".join("".join(f"{w}\t{t}\n" for w, t in zip(*s)) + "\n" for s in sentences)


@pytest.fixture(scope="module")
def tagging(tmp_path_factory, counting):  # noqa: F811
    """A tagging corpus over the counting words, with the counting vocabulary."""
    directory = tmp_path_factory.mktemp("tagging")
    rng = random.Random(2)
    for split, size in (("train", 300), ("dev", 60), ("test", 60)):
        (directory / f"{split}.conll").write_text(
            conll(tagged_sentence(rng) for _ in range(size)), encoding="utf-8")
    write_text_metadata(directory, "en", kind="tagging")
    (directory / "spm.model").write_bytes((counting / "spm.model").read_bytes())
    return directory


def test_a_toy_tagging_is_learnt(tagging, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(tagging), "--out", str(run), "--arch", "encoder",
                 "--preset", "bert-tiny", "--task", "tag", "--max-steps", "300",
                 "--max-tokens", "256", "--warmup-steps", "20", "--lr-scale", "0.1",
                 "--eval-every", "300", "--dtype", "float32"]) == 0
    last = dev_records(run)[-1]
    assert last["dev_entity_f1"] > 0.95 and last["dev_accuracy"] > 0.95, last
    model = load_model(run)
    assert model.config.token_classifier and model.labels == TAGS
    capsys.readouterr()
    assert main(["evaluate", "--model", str(run), "--data", str(tagging), "--split",
                 "test"]) == 0
    printed = capsys.readouterr().out
    assert "test: entity F1" in printed and "60 sentences" in printed
    scored = json.loads((run / "eval-test-tag.json").read_text())
    assert scored["f1"] > 0.9 and scored["sentences"] == 60
    written = (run / "eval-test-tag.conll").read_text().split("\n\n")
    assert len([block for block in written if block.strip()]) == 60
    (tmp_path / "in.txt").write_text("one two five nine\n")
    assert main(["tag", "--model", str(run), "--input", str(tmp_path / "in.txt"),
                 "--format", "entities"]) == 0
    assert capsys.readouterr().out == "LOW\tone two\tHIGH\tnine\n"


def test_fine_tuning_an_encoder_into_a_tagger(tagging, counting, tmp_path,  # noqa: F811
                                             capsys):
    pretrained = tmp_path / "pre"
    train(counting, pretrained, bert_tiny(), train_config(max_steps=5))
    run = tmp_path / "fine"
    assert main(["train", "--data", str(tagging), "--out", str(run), "--init",
                 str(pretrained), "--task", "tag", "--max-steps", "2", "--max-tokens", "256",
                 "--dtype", "float32"]) == 0
    assert "new classification head (classifier.bias, classifier.weight)" in \
        capsys.readouterr().out
    model = load_model(run)
    assert model.config.token_classifier and model.labels == TAGS
    assert model.classifier.weight.shape == (len(TAGS), model.config.d_model)
    # A tagger's head means nothing to a classifier of as many classes: it starts afresh.
    classifier = type(model)(model.config.replace(token_classifier=False))
    assert load_pretrained(classifier, run, torch.device("cpu")) == \
        ["classifier.bias", "classifier.weight"]
    assert not classifier.classifier.weight.equal(model.classifier.weight)


def test_a_lora_tagger_trains_its_head_whole(tagging, counting, tmp_path):  # noqa: F811
    """Beside the adapters, the new head trains (it moves between steps 1 and 3); the
    pooler, which tagging never runs, stays as pre-trained."""
    from transduce import checkpoint

    pretrained = tmp_path / "pre"
    train(counting, pretrained, bert_tiny(), train_config(max_steps=2))
    heads = {}
    for steps in (1, 3):
        run = tmp_path / f"lora-{steps}"
        train(tagging, run, bert_tiny(num_labels=len(TAGS), token_classifier=True),
              train_config(max_steps=steps, task="tag", lora_rank=4, lr_scale=1.0),
              init=pretrained)
        assert checkpoint.read_lora_section(checkpoint.resolve(run)) is not None
        model = load_model(run)
        heads[steps] = model.classifier.weight
        assert model.pooler.weight.equal(load_model(pretrained).pooler.weight)
    assert not heads[1].equal(heads[3])


def test_bad_corpora_and_settings_are_named(tagging, counting, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="is a tagging corpus; pass --task tag"):
        train(tagging, tmp_path / "a", bert_tiny(num_labels=5),
              train_config(max_steps=1, task="classify"))
    with pytest.raises(ConfigError, match="reads tagged words"):
        train(counting, tmp_path / "b", bert_tiny(num_labels=5, token_classifier=True),
              train_config(max_steps=1, task="tag"))
    with pytest.raises(ConfigError, match="trains a token classifier, but "
                                          "ModelConfig.token_classifier=False"):
        train(tagging, tmp_path / "c", bert_tiny(num_labels=5),
              train_config(max_steps=1, task="tag"))
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("train.conll", "corpus.json", "spm.model"):
        (bad / name).write_bytes((tagging / name).read_bytes())
    (bad / "dev.conll").write_text("one\tB-LOW\ntwo\tB-MIDDLE\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"dev.conll:2: tag 'B-MIDDLE' is not one of the "
                                          r"5 tags"):
        train(bad, tmp_path / "d", bert_tiny(num_labels=5, token_classifier=True),
              train_config(max_steps=1, task="tag"))
