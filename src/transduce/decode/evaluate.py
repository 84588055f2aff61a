"""Score a model on a corpus split.

Translation, the way the field does: sacreBLEU (13a) and chrF on detokenised text,
printed with the signature, and a second reference when the data has one
({split}.ref2, written by `transduce data bible` from the World English Bible).

A language model (arch "decoder"), by perplexity: each line of a text split is scored on
its own as training's line layout reads it, [bos] + ids predicting ids + [eos], so the
likelihood covers every piece of the line and its eos. Per piece: exp(total NLL /
pieces). Per word: exp(total NLL / words), with words = len(line.split()) + 1 per line,
the eos counted as one word (the usual convention, so that a per-word figure does not
depend on the vocabulary and still charges the model for ending the line).

A classifier (arch "encoder" with a classification head), by accuracy and macro-F1 (the
unweighted mean of the classes' F1) on a labelled split ({split}.tsv).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import sacrebleu
import torch
import torch.nn.functional as F
from torch import Tensor

from transduce import atomic
from transduce.data.batching import TokenBatcher
from transduce.data.corpus import CorpusError, language_pair, read_lines, read_text_split, \
    split_files
from transduce.data.labelled import label_indices, labelled_file, read_labelled
from transduce.data.squad import qa_file, read_squad, squad_scores
from transduce.data.tagged import read_tagged, tagged_file
from transduce.data.tokenizer import BOS_ID, EOS_ID, TextTokenizer
from transduce.decode.encode import SentenceEncoder
from transduce.decode.onnx_lm_engine import OnnxLanguageModel
from transduce.decode.tagging import entity_scores
from transduce.decode.translate import Translator
from transduce.errors import TransduceWarning
from transduce.model import DecoderOnly

# What each evaluation writes beside OUT (the prefix): the command line checks them all
# before a split is scored.
SUFFIXES = {"translation": (".hyp", ".json"), "classification": (".tsv", ".json"),
            "tagging": (".conll", ".json"), "qa": (".answers.json", ".json"),
            "language model": (".json",)}


def written_files(out_prefix: Path, kind: str) -> list[Path]:
    """The files an evaluation of `kind` writes for OUT, in SUFFIXES' order."""
    return [out_prefix.with_suffix(suffix) for suffix in SUFFIXES[kind]]


def evaluate_split(translator: Translator, data_dir: Path, split: str, out_prefix: Path, *,
                   beam: int = 4, alpha: float = 0.6, batch_tokens: int = 4096,
                   batch_sentences: int = 0, progress=None, source_lang: str | None = None,
                   target_lang: str | None = None, no_doubles: bool = False) -> dict:
    """Translate every line of the split's source, score against its references, and
    write OUT.hyp (one line per source line) and OUT.json (scores, signatures, timing).
    source_lang, target_lang: a multilingual model's pair, no_doubles
    (Translator.translate)."""
    way = translator.direction(source_lang, target_lang)
    if not way.languages:       # a multilingual model's codes are not the corpus's names
        _check_language_pair(translator, data_dir)
    source_path, reference_path = split_files(data_dir, split)
    sources, references = read_lines(source_path), read_lines(reference_path)
    second = data_dir / f"{split}.ref2"
    references2 = read_lines(second) if second.is_file() else None
    for path, lines in ((reference_path, references), (second, references2)):
        if lines is not None and len(lines) != len(sources):
            raise CorpusError(f"{path} has {len(lines)} lines but {source_path} has "
                              f"{len(sources)}: references must be line-aligned")
    start = time.perf_counter()
    hypotheses = translator.translate(sources, beam=beam, alpha=alpha, batch_tokens=batch_tokens,
                                      batch_sentences=batch_sentences, progress=progress,
                                      source_lang=source_lang, target_lang=target_lang,
                                      no_doubles=no_doubles)
    seconds = time.perf_counter() - start
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    result = {
        "split": split, "sentences": len(sources), "beam": beam, "alpha": alpha,
        **({"no_doubles": True} if no_doubles else {}),
        **({"languages": dict(zip(("source", "target"), way.languages))}
           if way.languages else {}),
        "dtype": translator.dtype,
        "bleu": bleu.corpus_score(hypotheses, [references]).score,
        "chrf": chrf.corpus_score(hypotheses, [references]).score,
        "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature()),
        "seconds": seconds, "sentences_per_second": len(sources) / seconds,
    }
    if references2 is not None:
        result["bleu_ref2"] = sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references2]).score
        two = sacrebleu.metrics.BLEU()
        result["bleu_two_references"] = two.corpus_score(hypotheses, [references, references2]).score
    hypothesis_file, json_file = written_files(out_prefix, "translation")
    result["hypotheses"] = str(atomic.write_text(hypothesis_file,
                                                 "".join(h + "\n" for h in hypotheses)))
    atomic.write_text(json_file, json.dumps(result, indent=2) + "\n")
    return result


# Logits per chunk when scoring: (rows, V) float32 of 8 MiB, as the training loss's chunks.
SCORE_CHUNK_ELEMENTS = 1 << 21
# The most logits an ONNX export's scoring batch returns at once (256 MiB of float32).
ONNX_LOGITS_ELEMENTS = 1 << 26


@dataclass
class LineScores:
    """Negative log-likelihood (nats) and pieces scored (eos included), per line."""

    nll: np.ndarray        # (N,) float64
    pieces: np.ndarray     # (N,) int64: len(ids) + 1

    @property
    def loss(self) -> float:
        """Mean NLL per piece."""
        return float(self.nll.sum() / self.pieces.sum())


@torch.no_grad()
def score_lines(model: DecoderOnly | OnnxLanguageModel, ids: Sequence[np.ndarray], *,
                max_tokens: int = 4096, device: torch.device | str = "cpu",
                bos_id: int = BOS_ID, eos_id: int = EOS_ID) -> LineScores:
    """The NLL of every line under a decoder-only model (or its ONNX export): [bos] + ids
    -> ids + [eos], each line alone, batched by length (TokenBatcher's batches without a
    source side). Lines must fit the model's max_positions (with their bos). bos_id,
    eos_id: the tokenizer's (an imported one has its own). A PyTorch model is left in
    eval mode."""
    nll = np.zeros(len(ids), dtype=np.float64)
    pieces = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    if not len(ids):
        return LineScores(nll, pieces)
    if isinstance(model, OnnxLanguageModel):   # it returns whole (B, T, V) logits
        vocab = model.config.tgt_vocab_size
        max_tokens = max(min(max_tokens, ONNX_LOGITS_ELEMENTS // vocab), int(pieces.max()) + 1)
    else:
        model.eval()
    batcher = TokenBatcher(None, ids, max_tokens, shuffle=False)
    for indices in batcher.epoch_batches(0):
        tokens = torch.full((len(indices), int(pieces[indices].max()) + 1), eos_id,
                            dtype=torch.long)                              # (B, T + 1)
        for row, index in enumerate(indices):
            tokens[row, 0], tokens[row, 1:pieces[index]] = bos_id, torch.from_numpy(ids[index])
        tokens = tokens.to(device)
        lengths = torch.from_numpy(pieces[indices]).to(device)            # (B,)
        keep = torch.arange(tokens.shape[1] - 1, device=device) < lengths[:, None]  # (B, T)
        token_nll = _batch_nll(model, tokens, keep)                         # (N,)
        rows = torch.arange(len(indices), device=device)[:, None].expand_as(keep)[keep]
        per_line = torch.zeros(len(indices), dtype=torch.float64, device=device)
        per_line.index_add_(0, rows, token_nll.double())                   # (B,)
        nll[indices] = per_line.cpu().numpy()
    return LineScores(nll, pieces)


def _batch_nll(model: DecoderOnly | OnnxLanguageModel, tokens: Tensor, keep: Tensor) -> Tensor:
    """-log p of each kept next token: tokens (B, T + 1), keep (B, T) -> (N,) float32."""
    if isinstance(model, OnnxLanguageModel):
        logits = model.logits(tokens[:, :-1])                               # (B, T, V)
        return F.cross_entropy(logits[keep], tokens[:, 1:][keep], reduction="none")
    hidden = model(tokens[:, :-1], project=False)                          # (B, T, C)
    return _token_nll(hidden[keep], model.logits, model.config.tgt_vocab_size,
                      tokens[:, 1:][keep])


def _check_language_pair(translator: Translator, data_dir: Path) -> None:
    """Warn when the corpus's pair is not the one the checkpoint was trained on (a
    reversed corpus would score near zero with nothing else said)."""
    trained = getattr(translator.model, "languages", None)
    corpus = language_pair(data_dir)
    if trained and corpus and tuple(trained) != corpus:
        warnings.warn(f"the model was trained to translate {trained[0]} -> {trained[1]}, "
                      f"but {data_dir} is {corpus[0]} -> {corpus[1]}", TransduceWarning,
                      stacklevel=3)


def _token_nll(rows: Tensor, project: Callable[[Tensor], Tensor], vocab: int,
               target: Tensor) -> Tensor:
    """-log p(target) of each row: rows (N, C) projected to (N, V) logits a chunk of rows
    at a time, so they never exist at once (project: the model's logits, a decoding
    copy's too) -> (N,) float32."""
    chunk = max(1, SCORE_CHUNK_ELEMENTS // vocab)
    parts = [F.cross_entropy(project(rows[i:i + chunk]).float(), target[i:i + chunk],
                             reduction="none") for i in range(0, rows.shape[0], chunk)]
    return torch.cat(parts) if parts else rows.new_zeros(0, dtype=torch.float32)


def evaluate_language_model(model: DecoderOnly | OnnxLanguageModel, tokenizer: TextTokenizer,
                            data_dir: Path, split: str, out_prefix: Path, *,
                            batch_tokens: int = 4096, device: torch.device | str = "cpu",
                            dtype: str = "float32") -> dict:
    """Perplexity per piece and per word of the lines of a text split ({split}.txt),
    written to OUT.json. Lines longer than the model reads (max_positions, bos
    included) are left out and counted: the figures cover the lines scored. dtype: the
    type `model` (a decoding copy, model/packed.py) decodes in, recorded."""
    corpus = read_text_split(data_dir, split)
    ids = [np.asarray(x, dtype=np.int64) for x in tokenizer.encode(corpus.lines)]
    limit = model.config.max_positions
    fits = [i for i, x in enumerate(ids) if len(x) + 1 <= limit]
    too_long = [corpus.line_numbers[i] for i, x in enumerate(ids) if len(x) + 1 > limit]
    if not fits:
        raise CorpusError(f"{corpus.path}: no line fits the model's {limit} positions "
                          f"(the shortest has {min(len(x) for x in ids) + 1} pieces with its bos)")
    start = time.perf_counter()
    scores = score_lines(model, [ids[i] for i in fits], max_tokens=batch_tokens, device=device,
                         bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    seconds = time.perf_counter() - start
    total, pieces = float(scores.nll.sum()), int(scores.pieces.sum())
    words = sum(len(corpus.lines[i].split()) + 1 for i in fits)
    result = {
        "split": split, "file": str(corpus.path), "dtype": dtype, "lines": len(fits),
        "pieces": pieces,
        "words": words, "nll": total, "loss_per_piece": total / pieces,
        "perplexity_per_piece": math.exp(min(total / pieces, 700.0)),
        "perplexity_per_word": math.exp(min(total / words, 700.0)),
        "words_counted_as": "whitespace-separated words + 1 per line for its eos",
        "empty_lines_skipped": len(corpus.dropped_empty),
        "lines_too_long_skipped": len(too_long), "too_long_line_numbers": too_long[:20],
        "max_positions": limit, "seconds": seconds, "pieces_per_second": pieces / seconds,
    }
    json_file, = written_files(out_prefix, "language model")
    atomic.write_text(json_file, json.dumps(result, indent=2) + "\n")
    return result


def macro_f1(predicted: Tensor, gold: Tensor, num_classes: int) -> float:
    """The unweighted mean over classes of F1 (a class never predicted nor present
    counts 0, as scikit-learn's zero_division=0; classes absent from both are skipped)."""
    scores = []
    for k in range(num_classes):
        tp = int(((predicted == k) & (gold == k)).sum())
        fp = int(((predicted == k) & (gold != k)).sum())
        fn = int(((predicted != k) & (gold == k)).sum())
        if tp + fp + fn == 0:
            continue
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / max(len(scores), 1)


def evaluate_classifier(encoder: SentenceEncoder, data_dir: Path, split: str,
                        out_prefix: Path, *, batch_tokens: int | None = None) -> dict:
    """Accuracy and macro-F1 of a classifier on a labelled split ({split}.tsv), written
    to OUT.json with the predictions to OUT.tsv. A gold label the classifier does not
    know is an error naming file and line."""
    corpus = read_labelled(labelled_file(data_dir, split))
    names = encoder.labels or [str(i) for i in range(encoder.model.config.num_labels)]
    gold = torch.tensor(label_indices(corpus, names))
    start = time.perf_counter()
    predictions = encoder.classify(corpus.texts, pairs=corpus.seconds,
                                   batch_tokens=batch_tokens)
    seconds = time.perf_counter() - start
    predicted = torch.tensor([names.index(p.label) for p in predictions])
    result = {"split": split, "file": str(corpus.path), "lines": len(corpus),
              "accuracy": float((predicted == gold).float().mean()),
              "macro_f1": macro_f1(predicted, gold, len(names)), "classes": names,
              "seconds": seconds, "lines_per_second": len(corpus) / seconds}
    predictions_file, json_file = written_files(out_prefix, "classification")
    atomic.write_text(predictions_file, "".join(
        f"{p.label}\t{p.probability:.4f}\n" for p in predictions))
    atomic.write_text(json_file, json.dumps(result, indent=2) + "\n")
    return result


def evaluate_tagger(encoder: SentenceEncoder, data_dir: Path, split: str, out_prefix: Path,
                    *, batch_tokens: int | None = None) -> dict:
    """Word accuracy and entity precision, recall and F1 (BIO spans, as conlleval counts
    them) of a token classifier on a tagging split ({split}.conll), written to OUT.json
    with `word<TAB>gold<TAB>predicted` lines (a blank one after each sentence) to
    OUT.conll. A gold tag the model does not know is an error naming file and line."""
    corpus = read_tagged(tagged_file(data_dir, split))
    names = set(encoder.labels or [])
    for tags, first in zip(corpus.tags, corpus.line_numbers):
        for offset, tag in enumerate(tags):
            if names and tag not in names:
                raise CorpusError(f"{corpus.path}:{first + offset}: tag {tag!r} is not one "
                                  f"of the model's {len(names)} tags")
    start = time.perf_counter()
    tagged = encoder.tag([" ".join(words) for words in corpus.words],
                         batch_tokens=batch_tokens)
    seconds = time.perf_counter() - start
    predicted = [[word.tag for word in words] for words in tagged]
    right = sum(a == b for guess, gold in zip(predicted, corpus.tags)
                for a, b in zip(guess, gold))
    words = sum(map(len, corpus.tags))
    scores = entity_scores(predicted, corpus.tags)
    result = {"split": split, "file": str(corpus.path), "sentences": len(corpus),
              "words": words, "accuracy": right / words, **scores,
              "tags": encoder.labels, "seconds": seconds,
              "words_per_second": words / seconds}
    predictions_file, json_file = written_files(out_prefix, "tagging")
    atomic.write_text(predictions_file, "".join(
        "".join(f"{word}\t{gold}\t{guess}\n" for word, gold, guess
                in zip(sentence, truth, guesses)) + "\n"
        for sentence, truth, guesses in zip(corpus.words, corpus.tags, predicted)))
    atomic.write_text(json_file, json.dumps(result, indent=2) + "\n")
    return result


def _scores_apart(texts: list[str], questions: list) -> dict:
    """{"has_answer": scores, "no_answer": scores}: SQuAD 2.0's HasAns_ and NoAns_."""
    apart = {}
    for name, answerable in (("has_answer", True), ("no_answer", False)):
        kept = [(t, q) for t, q in zip(texts, questions) if bool(q.answers) == answerable]
        if kept:
            apart[name] = {"questions": len(kept), **squad_scores(*map(list, zip(*kept)))}
    return apart


def evaluate_answerer(encoder: SentenceEncoder, data_dir: Path, split: str, out_prefix: Path,
                      *, batch_tokens: int | None = None) -> dict:
    """SQuAD's exact match and F1 (data/squad.py) of a question answerer's best answers
    on a question-answering split ({split}.json in SQuAD's layout), written to OUT.json
    with the answers by question id (SQuAD's predictions file) to OUT.answers.json. On a
    split of unanswerable questions (SQuAD 2.0's) the empty answer competes with the
    spans (SentenceEncoder.answer's no_answer), and the scores of the answerable and the
    unanswerable questions are given apart too, as SQuAD 2.0's script gives them."""
    questions = read_squad(qa_file(data_dir, split))
    no_answer = any(not q.answers for q in questions)
    start = time.perf_counter()
    found = encoder.answer([q.question for q in questions], [q.context for q in questions],
                           no_answer=no_answer, batch_tokens=batch_tokens)
    seconds = time.perf_counter() - start
    texts = [answers[0].text if answers else "" for answers in found]
    result = {"split": split, "file": str(qa_file(data_dir, split)),
              "questions": len(questions),
              "unanswerable": sum(not q.answers for q in questions), "abstains": no_answer,
              **squad_scores(texts, questions),
              **(_scores_apart(texts, questions) if no_answer else {}),
              "seconds": seconds, "questions_per_second": len(questions) / seconds}
    answers_file, json_file = written_files(out_prefix, "qa")
    atomic.write_text(answers_file, json.dumps(
        {q.id: text for q, text in zip(questions, texts)}, indent=2, ensure_ascii=False) + "\n")
    atomic.write_text(json_file, json.dumps(result, indent=2) + "\n")
    return result
