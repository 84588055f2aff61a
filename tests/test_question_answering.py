"""Extractive question answering: imported *ForQuestionAnswering models (BERT, RoBERTa,
DistilBERT) answer as transformers' model's start and end logits say, a long context read
in overlapping windows, through PyTorch and ONNX Runtime; `export hf` writes them back;
`transduce answer`; the spans' search; and what the other commands refuse."""

import numpy as np
import pytest
import torch

from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.answer_windows import context_words, windows
from transduce.decode.answering import answers_of, best_spans, span_items
from transduce.decode.encode import SentenceEncoder
from transduce.model import load_model
from tests.encoder_heads import CLASSES, IMPORTERS, SEGMENTED, imported_head
from tests.test_import_bert import vocab  # noqa: F401 - a fixture
from tests.test_import_roberta import roberta_vocab  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")

QUESTIONS = ["who jump over the dog", "where", "what the fox want", "who run"]
CONTEXTS = ["the quick brown fox jump over the lazy dog", "hello world", "",
            "the dog want the cafe and the fox run over the lazy world and the quick brown "
            "fox want the dog to run the end"]


@pytest.fixture(scope="module", params=list(IMPORTERS))
def imported(request, vocab, roberta_vocab, tmp_path_factory):  # noqa: F811
    """(family, transformers' question answerer, its tokenizer, our import's path): 24
    positions, so that the long context is read in windows."""
    family = request.param
    tokenizer_dir = roberta_vocab / "json" if family == "roberta" else vocab / "uncased" / "json"
    hf, fast, out = imported_head(family, "QuestionAnswering",
                                  tmp_path_factory.mktemp(f"answerer-{family}"),
                                  tokenizer_dir, 24)
    return family, hf, fast, out


def reference(hf, fast, question, words, spans, max_pieces=30):
    """transformers' best span over windows `spans` of the context's pieces (as its
    tokenizer pieces the whole context), each read as a pair: the softmax of the start
    and of the end logits over [CLS] and the window's context tokens, the best product of
    a start and a later end in the context, and the least product of [CLS]'s two ->
    (first word, last word, score, no-answer score)."""
    context_ids = fast(" ".join(words), add_special_tokens=False)
    owners = context_ids.word_ids()
    question_ids = fast(question, add_special_tokens=False)["input_ids"]
    best, null = (None, None, -1.0), 1.0
    for a, b in spans:
        separators = [fast.sep_token_id] * (1 + (hf.config.model_type == "roberta"))
        ids = [fast.cls_token_id, *question_ids, *separators,     # RoBERTa's </s></s>
               *context_ids["input_ids"][a:b], fast.sep_token_id]
        first = 1 + len(question_ids) + len(separators)
        segments = [0] * first + [1] * (len(ids) - first)
        inputs = {"input_ids": torch.tensor([ids])}
        if "token_type_ids" in fast.model_input_names and hf.config.model_type in SEGMENTED:
            inputs["token_type_ids"] = torch.tensor([segments])
        with torch.no_grad():
            result = hf(**inputs)
        start, end = (torch.cat([logits[0, :1], logits[0, first:first + b - a]]).softmax(-1)
                      for logits in (result.start_logits, result.end_logits))
        null = min(null, float(start[0] * end[0]))
        start, end = start[1:], end[1:]
        for i in range(b - a):
            for j in range(i, min(b - a, i + max_pieces)):
                score = float(start[i] * end[j])
                if score > best[2]:
                    best = (owners[a + i], owners[a + j], score)
    return (*best, null)


def test_imported_question_answerers_answer_as_transformers(imported, tmp_path):
    """The best answer's words and score, for short contexts and one read in windows,
    in PyTorch and through the ONNX export (each token's start and end logits)."""
    pytest.importorskip("onnxruntime")
    from transduce.decode.onnx_encoder_engine import OnnxSentenceEncoder
    from transduce.export.onnx import export_onnx

    family, hf, fast, out = imported
    model = load_model(out)
    assert model.config.question_answering and model.labels == ["start", "end"]
    tokenizer = SentenceEncoder.load(out).tokenizer
    one_segment = model.config.type_vocab_size == 1
    items, _ = span_items(tokenizer, QUESTIONS, CONTEXTS, model.config.max_positions,
                          one_segment, stride=4)
    assert sum(item.pair == 3 for item in items) > 2         # the long one: in windows
    for engine in (model, OnnxSentenceEncoder(export_onnx(out, tmp_path / "onnx"))):
        encoder = SentenceEncoder(engine, tokenizer)
        found = encoder.answer(QUESTIONS, CONTEXTS, stride=4)
        abstaining = encoder.answer(QUESTIONS, CONTEXTS, stride=4, no_answer=True, top_k=10**6)
        for question, context, answers, pair in zip(QUESTIONS, CONTEXTS, found, range(4)):
            if not context:
                assert answers == [] and abstaining[pair] == []
                continue
            words = context.split()
            room = model.config.max_positions - 3 - one_segment - \
                len(fast(question, add_special_tokens=False)["input_ids"])
            pieces = len(fast(context, add_special_tokens=False)["input_ids"])
            first, last, score, null = reference(hf, fast, question, words,
                                                 windows(pieces, room, 4))
            (answer,) = answers
            assert answer.text == " ".join(words[first:last + 1]), (family, question)
            assert context[answer.start:answer.end] == answer.text
            assert answer.score == pytest.approx(score, abs=1e-5)
            (empty,) = [a for a in abstaining[pair] if not a.text]    # among the spans
            assert (empty.start, empty.end) == (0, 0)
            assert empty.score == pytest.approx(null, abs=1e-5)
            assert abstaining[pair][0].score == pytest.approx(max(score, null), abs=1e-5)


def test_a_question_answerer_exports_to_transformers_and_back(imported, tmp_path, capsys):
    family, hf, fast, out = imported
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    kind = f"{CLASSES[family]}ForQuestionAnswering"
    assert f"{kind}: load it with transformers.AutoModelForQuestionAnswering" in \
        capsys.readouterr().out
    theirs = transformers.AutoModelForQuestionAnswering.from_pretrained(tmp_path / "hf")
    assert type(theirs).__name__ == kind
    ids = fast(QUESTIONS[1], CONTEXTS[1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        got, expected = theirs.eval()(input_ids=ids), hf(input_ids=ids)
    torch.testing.assert_close(got.start_logits, expected.start_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.end_logits, expected.end_logits, atol=1e-5, rtol=1e-5)
    back = load_model(IMPORTERS[family](tmp_path / "hf", tmp_path / "back"))
    assert back.config.question_answering
    assert torch.equal(back.classifier.weight, load_model(out).classifier.weight)


def test_the_command_line_answers_and_the_other_commands_refuse(imported, tmp_path, capsys):
    family, hf, fast, out = imported
    lines = [f"{q}\t{c}" for q, c in zip(QUESTIONS, CONTEXTS)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    found = SentenceEncoder.load(out).answer(QUESTIONS, CONTEXTS, top_k=2)
    assert main(["answer", "--model", str(out), "--input", str(tmp_path / "in.txt"),
                 "--top", "2"]) == 0
    assert capsys.readouterr().out == "".join(
        "\t".join(f"{a.text}\t{a.score:.4f}\t{a.start}\t{a.end}" for a in answers) + "\n"
        for answers in found)
    assert all(len(answers) == 2 for answers, c in zip(found, CONTEXTS) if c)
    (tmp_path / "bad.txt").write_text("a question without its context\n", encoding="utf-8")
    assert main(["answer", "--model", str(out), "--input", str(tmp_path / "bad.txt")]) != 0
    assert "bad.txt:1: 0 tabs; answer reads `question<TAB>context` lines" in \
        capsys.readouterr().err
    with pytest.raises(ConfigError, match="answers questions: answer with it"):
        SentenceEncoder.load(out).classify(["x"])
    with pytest.raises(ConfigError, match="2 questions but 1 contexts"):
        SentenceEncoder.load(out).answer(["a", "b"], ["c"])
    with pytest.raises(ConfigError, match="top_k=0: must be a positive integer"):
        SentenceEncoder.load(out).answer(["a"], ["c"], top_k=0)


def test_training_a_question_answerers_head_as_another_is_refused(imported, tmp_path):
    from transduce.config import TrainConfig
    from transduce.train.encoder import check_encoder_configs

    *_, out = imported
    config = load_model(out).config
    with pytest.raises(ConfigError, match="task 'classify' needs "
                                          "ModelConfig.question_answering=False, got True"):
        check_encoder_configs(config, TrainConfig(task="classify"), "classification", out)
    check_encoder_configs(config, TrainConfig(task="answer"), "qa", out)


def test_windows_overlap_and_cover_every_piece():
    assert windows(10, 4, 2) == [(0, 4), (2, 6), (4, 8), (6, 10)]
    assert windows(3, 4, 2) == [(0, 3)]
    assert windows(0, 4, 2) == []
    assert windows(9, 4, 128) == [(0, 4), (2, 6), (4, 8), (6, 9)]    # at most half


def test_best_spans_keep_order_and_length():
    """[CLS] first (never in a span), then the context's four pieces."""
    start = np.log(np.array([0.2, 0.08, 0.48, 0.16, 0.08]))
    end = np.log(np.array([0.5, 0.25, 0.05, 0.05, 0.15]))
    spans, null = best_spans(start, end, max_pieces=3, count=3)
    assert [(i, j) for i, j, _ in spans] == [(1, 3), (1, 1), (1, 2)]     # never j < i
    assert spans[0][2] == pytest.approx(0.48 * 0.15)
    assert null == pytest.approx(0.2 * 0.5)
    assert all(j - i < 2 for i, j, _ in best_spans(start, end, max_pieces=2, count=9)[0])


def test_answers_are_whole_words_counted_once():
    context = "  Jesus   wept. Then he went"
    words = context_words(context)
    found = [(0.2, 0, 1), (0.5, 0, 1), (0.3, 3, 4), (0.1, 2, 2)]
    answers = answers_of(found, context, words, count=2)
    assert [(a.text, a.score) for a in answers] == [("Jesus   wept.", 0.5), ("he went", 0.3)]
    assert context[answers[0].start:answers[0].end] == "Jesus   wept."
    answers = answers_of(found, context, words, count=2, no_answer=0.4)
    assert [(a.text, a.score) for a in answers] == [("Jesus   wept.", 0.5), ("", 0.4)]
