"""Question answerers (--task answer) in the training loop: a toy answering learnt from
scratch and scored by `evaluate` and `answer`; each window's item and answer positions
as transformers' tokenizers and its question-answering example label them; the span
loss as BertForQuestionAnswering's, batched as one at a time; fine-tuning an encoder
into an answerer, with LoRA too; and bad corpora named."""

import json
import random

import numpy as np
import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.answer_windows import ContextPieces, Window, answer_pieces, \
    context_words, load_qa_split, window_span
from transduce.data.batching import EncoderBatcher
from transduce.data.corpus import CorpusError, write_text_metadata
from transduce.data.masking import EncoderSpecials
from transduce.model import load_model
from transduce.config import TrainConfig
from transduce.model import build_model
from transduce.train.encoder import EncoderObjective, batch_losses, load_pretrained, \
    unused_parameter_names
from transduce.train.loop import train
from tests.encoder_heads import IMPORTERS, SEGMENTED, imported_head
from tests.test_import_bert import vocab  # noqa: F401 - a fixture
from tests.test_import_roberta import roberta_vocab  # noqa: F401 - a fixture
from tests.train.test_encoder import WORDS, bert_tiny, counting, dev_records  # noqa: F401
from tests.train.test_encoder import train_config
from tests.train.test_loop import (assert_two_processes_trained_alike,
                                   train_alone_at_double_update_freq)

transformers = pytest.importorskip("transformers")

LOW, HIGH = WORDS[:4], WORDS[8:]     # "one" asks for the run of LOW words, "nine" HIGH's


def toy_paragraph(rng, number, unanswerable=0.0):
    """Filler words with a run of LOW words and one of HIGH words somewhere in them (but
    a share `unanswerable` of them has no HIGH run), and a question for each run."""
    words = [rng.choice(WORDS[4:8]) for _ in range(rng.randint(4, 10))]
    for pool in (LOW, HIGH):
        if pool is HIGH and unanswerable and rng.random() < unanswerable:
            continue
        at = rng.randint(0, len(words))
        words[at:at] = [rng.choice(pool) for _ in range(rng.randint(1, 2))]
    context, asked = " ".join(words), []
    for question, pool in (("one", LOW), ("nine", HIGH)):
        run = [n for n, word in enumerate(words) if word in pool]
        start = len(" ".join(words[:run[0]] + [""])) if run and run[0] else 0
        answers = [{"text": " ".join(words[run[0]:run[-1] + 1]), "answer_start": start}] \
            if run else []
        asked.append({"id": f"{number}-{question}", "question": question,
                      "answers": answers, "is_impossible": not run})
    return {"context": context, "qas": asked}


def squad(paragraphs):
    return json.dumps({"version": "1.1", "data": [{"title": "toy", "paragraphs": paragraphs}]})


@pytest.fixture(scope="module")
def answering(tmp_path_factory, counting):  # noqa: F811
    """A question-answering corpus over the counting words, with their vocabulary."""
    directory = tmp_path_factory.mktemp("answering")
    rng = random.Random(3)
    for split, size in (("train", 300), ("dev", 30), ("test", 30)):
        (directory / f"{split}.json").write_text(
            squad([toy_paragraph(rng, n) for n in range(size)]), encoding="utf-8")
    write_text_metadata(directory, "en", kind="qa")
    (directory / "spm.model").write_bytes((counting / "spm.model").read_bytes())
    return directory


def test_a_toy_question_answering_is_learnt(answering, tmp_path, capsys):
    """In windows of 16 positions (2.7 a question): most find no answer, and are
    labelled [CLS], whose share in the softmax keeps their spans low; dev scores the
    answers `answer` gives (1.00 here from step 700 on, untrained 0.03)."""
    run = tmp_path / "run"
    assert main(["train", "--data", str(answering), "--out", str(run), "--arch", "encoder",
                 "--preset", "bert-tiny", "--max-positions", "16", "--task", "answer",
                 "--max-steps", "800", "--max-tokens", "512", "--warmup-steps", "50",
                 "--lr-scale", "0.2", "--eval-every", "800", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "600 questions in 1616 windows of 16 positions" in printed
    last = dev_records(run)[-1]
    assert last["dev_exact_match"] > 0.9 and last["dev_f1"] > 0.95, last
    model = load_model(run)
    assert model.config.question_answering and model.labels == ["start", "end"]
    assert main(["evaluate", "--model", str(run), "--data", str(answering), "--split",
                 "test"]) == 0
    scored = json.loads((run / "eval-test-answer.json").read_text())
    assert scored["questions"] == 60 and scored["exact_match"] > 0.9, scored
    (tmp_path / "in.txt").write_text("nine\tfive six ten eleven seven two eight\n"
                                     "one\tfive six ten eleven seven two eight\n")
    capsys.readouterr()
    assert main(["answer", "--model", str(run), "--input", str(tmp_path / "in.txt")]) == 0
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == \
        ["ten eleven", "two"]


def test_unanswerable_questions_are_learnt_and_abstained_from(counting, tmp_path,  # noqa: F811
                                                              capsys):
    """SQuAD 2.0's layout: a third of the paragraphs have no HIGH run, so "nine" has no
    answer there. Trained on [CLS] for those, the answerer gives the empty answer
    (`evaluate` and dev let it compete on such a split, `answer` with --no-answer)."""
    data, run = tmp_path / "squad2", tmp_path / "run"
    data.mkdir()
    rng = random.Random(5)
    for split, size in (("train", 300), ("dev", 30), ("test", 30)):
        (data / f"{split}.json").write_text(
            squad([toy_paragraph(rng, n, unanswerable=0.3) for n in range(size)]),
            encoding="utf-8")
    write_text_metadata(data, "en", kind="qa")
    (data / "spm.model").write_bytes((counting / "spm.model").read_bytes())
    assert main(["train", "--data", str(data), "--out", str(run), "--arch", "encoder",
                 "--preset", "bert-tiny", "--max-positions", "16", "--task", "answer",
                 "--max-steps", "600", "--max-tokens", "512", "--warmup-steps", "50",
                 "--lr-scale", "0.2", "--eval-every", "600", "--dtype", "float32"]) == 0
    last = dev_records(run)[-1]
    assert last["dev_exact_match"] > 0.85, last
    assert main(["evaluate", "--model", str(run), "--data", str(data), "--split", "dev"]) == 0
    scored = json.loads((run / "eval-dev-answer.json").read_text())    # what dev scored
    assert (scored["exact_match"], scored["f1"]) == pytest.approx(
        (last["dev_exact_match"], last["dev_f1"]))
    assert main(["evaluate", "--model", str(run), "--data", str(data), "--split",
                 "test"]) == 0
    scored = json.loads((run / "eval-test-answer.json").read_text())
    assert scored["abstains"] and scored["no_answer"]["questions"] == scored["unanswerable"]
    assert scored["no_answer"]["exact_match"] > 0.75 and scored["exact_match"] > 0.8, scored
    (tmp_path / "in.txt").write_text("nine\tfive six two seven eight\n"
                                     "nine\tfive six ten seven two eight\n")
    capsys.readouterr()
    for flags, abstains in (([], False), (["--no-answer"], True)):
        assert main(["answer", "--model", str(run), "--input", str(tmp_path / "in.txt"),
                     *flags]) == 0
        answers = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
        assert answers[1] == "ten" and (answers[0] == "") == abstains, answers


QUESTIONS = ["who jump over the dog", "where", "what the fox want", "who run"]
CONTEXTS = ["the quick brown fox jump over the lazy dog", "hello world cafe",
            "the dog want the cafe and the fox run over the lazy world and the quick brown "
            "fox want the dog to run the end",
            "the dog want the cafe and the fox run over the lazy world and the quick brown "
            "fox want the dog to run the end"]
ANSWERS = ["the quick brown fox", None, "the dog to run", "dog"]   # None: unanswerable


def qa_corpus(directory, questions, contexts, answers):
    """{train,dev}.json of these questions; an answer's start is its last occurrence."""
    qas = [{"context": c, "qas": [{"id": str(n), "question": q, "answers": [] if a is None
                                   else [{"text": a, "answer_start": c.rindex(a)}]}]}
           for n, (q, c, a) in enumerate(zip(questions, contexts, answers))]
    for split in ("train", "dev"):
        (directory / f"{split}.json").write_text(squad(qas), encoding="utf-8")
    write_text_metadata(directory, "en", kind="qa")
    return directory


@pytest.fixture(scope="module", params=list(IMPORTERS))
def imported(request, vocab, roberta_vocab, tmp_path_factory):  # noqa: F811
    """(family, transformers' question answerer, its tokenizer, our import's path, a
    corpus of QUESTIONS): 24 positions."""
    family = request.param
    tokenizer_dir = roberta_vocab / "json" if family == "roberta" else vocab / "uncased" / "json"
    root = tmp_path_factory.mktemp(f"answerer-{family}")
    hf, fast, out = imported_head(family, "QuestionAnswering", root, tokenizer_dir, 24)
    (root / "corpus").mkdir()
    return family, hf, fast, out, qa_corpus(root / "corpus", QUESTIONS, CONTEXTS, ANSWERS)


def transformers_windows(fast, max_length, stride, one_segment):
    """transformers' question-answering example's training features: each question and
    each window of its context (truncation "only_second", min(stride, half the window)
    tokens shared), the answer's first and last tokens found by their character offsets,
    [CLS] (0) when the window does not hold it whole -> [(input ids, start, end)]."""
    features = []
    for question, context, answer in zip(QUESTIONS, CONTEXTS, ANSWERS):
        asked = len(fast(question, add_special_tokens=False)["input_ids"])
        room = max_length - asked - 3 - one_segment
        encoded = fast(question, context, truncation="only_second", max_length=max_length,
                       stride=min(stride, room // 2), return_overflowing_tokens=True,
                       return_offsets_mapping=True)
        for n, ids in enumerate(encoded["input_ids"]):
            start, end = 0, 0
            if answer is not None:
                first_char = context.rindex(answer)
                last_char = first_char + len(answer)
                sequence, offsets = encoded.sequence_ids(n), encoded["offset_mapping"][n]
                tokens = [i for i, s in enumerate(sequence) if s == 1]
                if offsets[tokens[0]][0] <= first_char and offsets[tokens[-1]][1] >= last_char:
                    start = next(i for i in tokens if offsets[i][1] > first_char)
                    end = max(i for i in tokens if offsets[i][0] < last_char)
            features.append((list(ids), start, end))
    return features


@pytest.mark.parametrize("stride", [3, 128])
def test_windows_are_labelled_as_transformers_labels_them(imported, stride):
    """Each window's item (ids) and answer positions, whole words answers, against the
    tokenizer's own windows and the offsets' labels: a stride past half a window shares
    half of it (128 here)."""
    family, hf, fast, out, corpus = imported
    tokenizer = checkpoint.load_tokenizer(out)
    one_segment = family == "roberta"
    split = load_qa_split(corpus, "train", tokenizer, 24, one_segment, stride)
    batcher = EncoderBatcher(split.ids, second_ids=split.second_ids, spans=split.spans,
                             max_tokens=1024, max_len=24, vocab_size=len(fast), mask=False,
                             shuffle=False, specials=EncoderSpecials.of(tokenizer),
                             one_segment=one_segment)
    ours = []
    for index in range(batcher.num_items):
        batch = batcher.collate(np.array([index]))
        ours.append((batch.ids[0].tolist(), *batch.spans[0].tolist()))
    assert ours == transformers_windows(fast, 24, stride, one_segment)
    assert sum(start > 0 for _, start, _ in ours) >= (1 if one_segment else 3)   # answers
    assert len(ours) > len(QUESTIONS) + 2                  # long contexts in 3 windows or more


def test_the_span_loss_is_transformers_loss(imported):
    """Our summed loss of a padded batch of windows is BertForQuestionAnswering's
    (each window alone, unpadded, as transformers' loss does not leave out padding)."""
    family, hf, fast, out, corpus = imported
    model = load_model(out).train(False)
    tokenizer = checkpoint.load_tokenizer(out)
    one_segment = family == "roberta"
    split = load_qa_split(corpus, "train", tokenizer, 24, one_segment, 3)
    batcher = EncoderBatcher(split.ids, second_ids=split.second_ids, spans=split.spans,
                             max_tokens=1024, max_len=24, vocab_size=len(fast), mask=False,
                             shuffle=False, specials=EncoderSpecials.of(tokenizer),
                             one_segment=one_segment)
    indices = np.arange(batcher.num_items)
    batch = batcher.collate(indices)
    assert (batch.ids == model.config.pad_id).any()        # padded rows are in it
    with torch.no_grad():
        ours = batch_losses(model, model, batch).sums["answer"]
        theirs = 0.0
        for index in indices:
            one = batcher.collate(np.array([index]))
            inputs = {"input_ids": one.ids, "start_positions": one.spans[:, 0],
                      "end_positions": one.spans[:, 1]}
            if family in SEGMENTED:
                inputs["token_type_ids"] = one.segments
            theirs += float(hf(**inputs).loss)
    assert ours.item() == pytest.approx(theirs, rel=1e-5)


def test_an_imported_answerer_trains_on_with_its_own_tokenizer(imported, tmp_path, capsys):
    """--init of an imported ...ForQuestionAnswering and --task answer: its tokenizer
    reads the corpus (no spm.model in it), its head carries over, dev is scored."""
    family, hf, fast, out, corpus = imported
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--init", str(out),
                 "--task", "answer", "--max-steps", "2", "--eval-every", "2",
                 "--max-len", "24"]) == 0
    assert "4 questions in" in capsys.readouterr().out
    assert {"dev_loss", "dev_exact_match", "dev_f1"} <= set(dev_records(run)[-1])
    trained, start = load_model(run), load_model(out)
    assert trained.config == start.config and trained.labels == ["start", "end"]
    moved = (trained.classifier.weight - start.classifier.weight).abs().max()
    assert 0 < moved < 0.05       # two small steps from the import's head (drawn at 0.5)


def test_an_answer_is_labelled_as_the_whole_words_it_touches():
    """An answer inside a word (punctuation around it) labels the words it touches, as
    answers are read back; characters of no word label nothing."""
    context = "hello (world), and more"
    words = context_words(context)
    pieces = ContextPieces(words, np.array([0, 0, 1, 1, 1, 2, 3]))
    start = context.index("world")
    assert answer_pieces(pieces, start, start + 5) == (2, 4)          # "(world)," whole
    assert answer_pieces(pieces, 0, len(context)) == (0, 6)
    assert answer_pieces(pieces, 5, 6) is None                        # the space alone


def test_a_window_labels_an_answer_it_holds_whole():
    """Pieces 5 to 9 of a context after a question of 2: [CLS] q q [SEP] at 0 to 3."""
    window = Window(0, np.array([7, 8]), np.arange(10, 15), 5, np.arange(5))
    assert window_span(window, (5, 9), False) == (4, 8)
    assert window_span(window, (6, 6), True) == (6, 6)        # RoBERTa's </s></s>
    for outside in ((4, 6), (8, 10), (4, 10), None):
        assert window_span(window, outside, False) == (0, 0)


def test_fine_tuning_an_encoder_into_a_question_answerer(answering, counting,  # noqa: F811
                                                         tmp_path, capsys):
    """--init with --task answer: the pre-trained encoder's weights and a new head of a
    start and an end, scored on dev."""
    pretrained, run = tmp_path / "pre", tmp_path / "run"
    train(counting, pretrained, bert_tiny(max_positions=16), train_config(max_steps=2))
    assert main(["train", "--data", str(answering), "--out", str(run), "--init",
                 str(pretrained), "--task", "answer", "--max-steps", "2",
                 "--eval-every", "2"]) == 0
    capsys.readouterr()
    model = load_model(run)
    assert model.config.question_answering and model.config.num_labels == 2
    assert {"dev_loss", "dev_exact_match", "dev_f1"} <= set(dev_records(run)[-1])
    assert checkpoint.read_configs(checkpoint.resolve(run))[1].max_len == 384   # BERT's
    assert load_pretrained(model, pretrained, torch.device("cpu")) == \
        ["classifier.bias", "classifier.weight"]


def test_the_heads_an_answerer_never_runs_are_left_out_of_ddp():
    model = build_model(bert_tiny(num_labels=2, question_answering=True))
    names = unused_parameter_names(EncoderObjective(model), model, TrainConfig(task="answer"))
    assert sorted(names) == sorted(f"model.{name}" for name in [
        "pooler.bias", "pooler.weight", "mlm_head.dense.bias", "mlm_head.dense.weight",
        "mlm_head.norm.bias", "mlm_head.norm.weight", "mlm_head.decoder.bias",
        "nsp_head.bias", "nsp_head.weight"])


def test_fine_tuning_an_answerer_in_two_processes_equals_one(answering, counting,  # noqa: F811
                                                             tmp_path):
    """Two gloo processes at update_freq 1 train the weights one process trains at 2:
    the span loss's mean over the step's windows across processes."""
    pretrained = tmp_path / "pre"
    train(counting, pretrained, bert_tiny(max_positions=16), train_config(max_steps=2))
    common = ["--data", str(answering), "--init", str(pretrained), "--task", "answer",
              "--max-tokens", "128", "--max-steps", "4", "--warmup-steps", "5",
              "--eval-every", "100", "--threads", "1", "--dtype", "float32"]
    train_alone_at_double_update_freq(tmp_path / "one", common)
    assert_two_processes_trained_alike(tmp_path / "one", tmp_path / "two", common)


def test_a_lora_answerer_trains_its_head_whole(answering, counting, tmp_path):  # noqa: F811
    """Beside the adapters, the new head trains (it moves between steps 1 and 3); the
    pooler, which answering never runs, stays as pre-trained."""
    pretrained = tmp_path / "pre"
    train(counting, pretrained, bert_tiny(max_positions=16), train_config(max_steps=2))
    heads = {}
    for steps in (1, 3):
        run = tmp_path / f"lora-{steps}"
        train(answering, run, bert_tiny(max_positions=16, num_labels=2,
                                        question_answering=True),
              train_config(max_steps=steps, task="answer", lora_rank=4, lr_scale=1.0),
              init=pretrained)
        assert checkpoint.read_lora_section(checkpoint.resolve(run)) is not None
        model = load_model(run)
        heads[steps] = model.classifier.weight
        assert model.pooler.weight.equal(load_model(pretrained).pooler.weight)
    assert not heads[1].equal(heads[3])


def test_bad_question_answering_corpora_are_named(answering, tmp_path, capsys):
    """A question of no answer_start, a start that misses its text (skipped, counted),
    a question with no room, and the wrong task for the corpus."""
    directory = tmp_path / "bad"
    directory.mkdir()
    (directory / "spm.model").write_bytes((answering / "spm.model").read_bytes())
    qa_corpus(directory, ["one", "nine"], ["two six ten", "two six ten"], ["two", "ten"])
    values = json.loads((directory / "train.json").read_text())
    values["data"][0]["paragraphs"][1]["qas"][0]["answers"][0]["answer_start"] = 1
    (directory / "train.json").write_text(json.dumps(values))
    from transduce.data.tokenizer import Tokenizer
    tokenizer = Tokenizer(directory / "spm.model")
    split = load_qa_split(directory, "train", tokenizer, 16, False)
    assert "2 questions in 1 windows" in split.report[0]
    assert "1 skipped (no answer at answer_start, or no context): '1'" in split.report[0]
    del values["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"]
    (directory / "train.json").write_text(json.dumps(values))
    with pytest.raises(CorpusError, match=r"train.json: question '0' has no answer_start"):
        load_qa_split(directory, "train", tokenizer, 16, False)
    with pytest.raises(CorpusError, match=r"dev.json: question 1: \d+ pieces leave no room "
                                          r"for its context .* \(max_len=4\)"):
        load_qa_split(directory, "dev", tokenizer, 4, False)
    with pytest.raises(ConfigError, match="is a qa corpus; pass --task answer"):
        train(answering, tmp_path / "run", bert_tiny(num_labels=2, token_classifier=True),
              train_config(task="tag"))
    for task in ("tag", "classify"):       # the command line names it too, before reading
        assert main(["train", "--data", str(answering), "--out", str(tmp_path / "cli"),
                     "--arch", "encoder", "--task", task, "--max-steps", "1"]) != 0
        assert "is a qa corpus; pass --task answer" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="task 'answer' needs ModelConfig."
                                          "question_answering=True"):
        train(answering, tmp_path / "run", bert_tiny(), train_config(task="answer"))
