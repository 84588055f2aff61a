"""Lines in, labels or vectors out: an encoder-only model (BERT) classifying and embedding.

    encoder = SentenceEncoder.load("runs/genre/ema")
    encoder.classify(["And Jesus wept."])      # -> [Prediction("gospels and Acts", 0.93, {...})]
    nli.classify(premises, pairs=hypotheses)   # pairs: [CLS] premise [SEP] hypothesis [SEP]
    encoder.embed(lines, normalize=True)      # -> (N, C) float32 numpy array
    encoder.embed(lines, pooling="cls")       # [CLS]'s state (BGE's way) rather than the mean

Each line is read as [CLS] line [SEP] (the tokenizer's bos and eos), segment 0, a pair
as [CLS] A [SEP] B [SEP] with B in segment 1 (RoBERTa's: <s> A </s></s> B </s>, all
segment 0), as training builds them (data/masking.py: encoder_item). Lines are sorted
by length and batched by tokens, N lines in give N results out in order. A line or pair
longer than the model reads is truncated with a warning naming it (a pair as the
tokenizers library's "longest_first" cuts one: masking.crop_pair).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch

from transduce import checkpoint
from transduce.checkpoint import POOLINGS
from transduce.config import ConfigError
from transduce.data.masking import crop_pair, encoder_item
from transduce.data.tokenizer import TextTokenizer
from transduce.decode.inputs import PromptIds, TextError, checked_texts, ids_problem
from transduce.decode.onnx_encoder_engine import OnnxSentenceEncoder
from transduce.decode.onnx_engine import check_onnx_settings, runs_on_onnxruntime
from transduce.decode.options import DecodeDtype, Engine, decoding_dtype, pass_batch_tokens
from transduce.decode.answering import MAX_ANSWER_PIECES, STRIDE, Answer, SpanItem, \
    answers_of, best_spans, span_items
from transduce.decode.tagging import TaggedWord, tag_items
from transduce.decode.translate import length_sorted_batches
from transduce.errors import LineTruncated
from transduce.model import EncoderOnly, load_model
from transduce.model.packed import decoding_copy


Line = Union[str, PromptIds]      # a text, or token ids read as they are
# ONNX Runtime keeps its buffers and runs large batches faster: 1.16x in int8 at 4,096
# tokens than at 512 (bench/encode.py, Zen 4). PyTorch's: options.pass_batch_tokens.
ONNX_BATCH_TOKENS = 4096


def embedding_defaults(recorded: dict | None) -> dict:
    """{"pooling", "normalize"} of embed() when not given: the checkpoint's record, else
    the mean, not normalised."""
    return dict(recorded or {"pooling": "mean", "normalize": False})


@dataclass
class Ranked:
    """A document as rerank places it."""

    index: int          # its place in the documents given
    score: float        # the model's output, a logit
    relevance: float    # its sigmoid, in (0, 1): the relevance score rerank APIs give


def ranked(scores: np.ndarray, top_n: int | None = None) -> list[Ranked]:
    """Documents' scores (N,) -> the top_n (None: all) as Ranked, the highest first (a
    tie in the order given)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    return [Ranked(i, float(scores[i]), 0.5 * (1 + math.tanh(float(scores[i]) / 2)))
            for i in order]                     # tanh: the sigmoid, without overflow


@dataclass
class Prediction:
    label: str
    probability: float
    probabilities: dict[str, float]     # every class, in the classifier's order


class SentenceEncoder:
    """An encoder-only model with its tokenizer, ready to classify or embed lines."""

    def __init__(self, model: EncoderOnly | OnnxSentenceEncoder, tokenizer: TextTokenizer,
                 device: torch.device | str = "cpu", dtype: DecodeDtype = "float32", *,
                 in_place: bool = False):
        """A PyTorch model is run by a copy in `dtype` whose Linear weights are packed for
        oneDNN (model/packed.py); the model passed in is left as it is, unless in_place
        (see Translator). An
        OnnxSentenceEncoder (an ONNX export) runs as exported, on the CPU."""
        if isinstance(model, OnnxSentenceEncoder):
            check_onnx_settings(dtype, None, device)
            self.labels, self.model = model.labels, model
            self.classifier_inputs = model.classifier_inputs
            self.embedding_defaults = embedding_defaults(model.sentence_embedding)
            self.tokenizer, self.device, self.dtype = tokenizer, torch.device("cpu"), "float32"
            self.batch_tokens = ONNX_BATCH_TOKENS
            return
        if not isinstance(model, EncoderOnly):
            raise ConfigError(f"classify and embed need an encoder-only model (arch "
                              f"'encoder'); this one is arch={model.config.arch!r}")
        dtype = decoding_dtype(dtype, device)
        self.labels = model.labels
        self.classifier_inputs = getattr(model, "classifier_inputs", None)
        self.embedding_defaults = embedding_defaults(model.sentence_embedding)
        self.model = decoding_copy(model, getattr(torch, dtype), device, in_place=in_place)
        self.tokenizer, self.device, self.dtype = tokenizer, torch.device(device), dtype
        self.batch_tokens = pass_batch_tokens(self.device)

    @classmethod
    def load(cls, path: Path | str, device: torch.device | str = "cpu",
             dtype: DecodeDtype = "float32", engine: Engine = "auto") -> "SentenceEncoder":
        """A checkpoint directory, a run directory (its latest checkpoint), or an ONNX
        export (engine "auto" runs it with ONNX Runtime, as Translator.load does)."""
        if runs_on_onnxruntime(path, engine):
            return cls(OnnxSentenceEncoder(path), checkpoint.load_tokenizer(Path(path)), device,
                       dtype)
        directory = checkpoint.resolve(Path(path))
        return cls(load_model(directory, device), checkpoint.load_tokenizer(directory), device,
                   dtype, in_place=True)

    def classify(self, lines: Sequence[Line], *, pairs: Sequence[str] | None = None,
                 batch_tokens: int | None = None, first_line_number: int = 1
                 ) -> list[Prediction]:
        """The most probable class of each line (or of each pair: line i and pairs[i],
        for a classifier fine-tuned on pairs), with every class's probability."""
        if self.scores:
            raise ConfigError("this model has one output (a cross-encoder's relevance, or a "
                              "regression head's value), not classes: score or rerank with "
                              "it (`transduce score`, `transduce rerank`, /v1/rerank)")
        if self.tags:
            raise ConfigError("this model's head labels each token, not the text: tag with "
                              "it (`transduce tag`, SentenceEncoder.tag, /v1/tag)")
        if self.answers:
            raise ConfigError("this model's head answers questions: answer with it "
                              "(`transduce answer`, SentenceEncoder.answer, /v1/answer)")
        if not self.classifies:
            raise ConfigError("this model has no classification head: fine-tune it with "
                              "`transduce train --task classify --init MODEL`")
        self.check_inputs(pairs is not None)
        names = self.labels or [str(i) for i in range(self.model.config.num_labels)]
        probabilities = np.zeros((len(lines), len(names)), dtype=np.float32)
        for indices, ids, segments in self._batches(lines, batch_tokens, first_line_number,
                                                    pairs):
            logits = self._class_logits(ids, segments).float()                 # (B, K)
            probabilities[indices] = logits.softmax(dim=-1).cpu().numpy()
        return [Prediction(names[int(row.argmax())], float(row.max()),
                           dict(zip(names, map(float, row)))) for row in probabilities]

    def score(self, lines: Sequence[Line], *, pairs: Sequence[str] | None = None,
              batch_tokens: int | None = None, first_line_number: int = 1,
              warn: bool = True) -> np.ndarray:
        """The model's one output for each line (or pair: line i and pairs[i]), a
        cross-encoder's relevance logit or a regression head's value -> (N,) float32.
        warn: of each pair cut to fit the model (False: cut quietly, as a reranker cuts
        long documents)."""
        if not self.scores:
            raise ConfigError(self._not_a_scorer())
        self.check_inputs(pairs is not None)
        scores = np.zeros(len(lines), dtype=np.float32)
        for indices, ids, segments in self._batches(lines, batch_tokens, first_line_number,
                                                    pairs, warn=warn):
            scores[indices] = self._class_logits(ids, segments).float()[:, 0].cpu().numpy()
        return scores

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
               batch_tokens: int | None = None) -> list[Ranked]:
        """The documents (or the top_n of them), the most relevant to the query first, as
        a cross-encoder ranks them: each read in a pair with the query, [CLS] query [SEP]
        document [SEP], a long pair cut as the tokenizers library cuts one, without a
        warning (a reranker judges a long document by its start)."""
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)
                                  or top_n < 1):
            raise ConfigError(f"top_n={top_n!r}: must be a positive integer (or None: all)")
        (query,) = checked_texts([query], "query")
        documents = checked_texts(documents, "document")
        scores = self.score([query] * len(documents), pairs=documents,
                            batch_tokens=batch_tokens, warn=False)
        return ranked(scores, top_n)

    def embed(self, lines: Sequence[Line], *, normalize: bool | None = None,
              pooling: str | None = None, batch_tokens: int | None = None,
              first_line_number: int = 1) -> np.ndarray:
        """Each line's last hidden states pooled, "mean" over its tokens ([CLS] and [SEP]
        included, padding not) or "cls" ([CLS]'s), L2-normalised if asked -> (N, C)
        float32. None: as the checkpoint records (an imported sentence-transformers
        model's way), else mean and not normalised (embedding_defaults)."""
        pooling = self.embedding_defaults["pooling"] if pooling is None else pooling
        normalize = self.embedding_defaults["normalize"] if normalize is None else normalize
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling={pooling!r}: choose one of {', '.join(POOLINGS)}")
        vectors = np.zeros((len(lines), self.model.config.d_model), dtype=np.float32)
        for indices, ids, _ in self._batches(lines, batch_tokens, first_line_number):
            pooled = self._embeddings(ids, pooling).float()                    # (B, C)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            vectors[indices] = pooled.cpu().numpy()
        return vectors

    def tag(self, lines: Sequence[str], *, batch_tokens: int | None = None,
            first_line_number: int = 1) -> list[list[TaggedWord]]:
        """Each line's words (split at whitespace) with the tag of each, and its
        probability, by a token classifier (decode/tagging.py says how words meet
        pieces); a line of no words gets []."""
        if not self.tags:
            raise ConfigError("this model has no token-classification head: fine-tune it "
                              "with `transduce train --task tag --init MODEL`")
        lines = checked_texts(lines, "line", first_line_number)
        words = [line.split() for line in lines]
        items = tag_items(self.tokenizer, words, self.model.config.max_positions)
        names = self.labels or [str(i) for i in range(self.model.config.num_labels)]
        tags: list[list[TaggedWord | None]] = [[None] * len(w) for w in words]
        for indices, ids, _ in self._item_batches([item.ids for item in items], batch_tokens):
            probabilities = self._tag_logits(ids).float().softmax(dim=-1).cpu().numpy()
            for row, index in enumerate(indices):
                item = items[index]
                for word, position in zip(range(item.start, item.end), item.firsts):
                    chosen = probabilities[row, position]
                    tags[item.line][word] = TaggedWord(words[item.line][word],
                                                       names[int(chosen.argmax())],
                                                       float(chosen.max()))
        return tags

    def answer(self, questions: Sequence[str], contexts: Sequence[str], *, top_k: int = 1,
               max_answer_pieces: int = MAX_ANSWER_PIECES, stride: int = STRIDE,
               no_answer: bool = False, batch_tokens: int | None = None
               ) -> list[list[Answer]]:
        """The best `top_k` answers to each question in its context (question i reads
        contexts[i]), by a question answerer: spans of the context's words, with their
        character offsets and scores (decode/answering.py says how they are found); a
        context of no words gets []. no_answer: the empty answer (text "", start and end
        0) competes with the spans, for a model trained on unanswerable questions."""
        if not self.answers:
            raise ConfigError("this model has no question-answering head: train one "
                              "(`transduce train --task answer --init MODEL`) or import "
                              "one (`transduce import hf-bert` of a ...ForQuestionAnswering "
                              "directory)")
        questions = checked_texts(questions, "question")
        contexts = checked_texts(contexts, "context")
        if len(questions) != len(contexts):
            raise ConfigError(f"{len(questions)} questions but {len(contexts)} contexts: "
                              f"each question is answered from its own context")
        for name, value in (("top_k", top_k), ("max_answer_pieces", max_answer_pieces),
                            ("stride", stride)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        config = self.model.config
        try:
            items, words = span_items(self.tokenizer, questions, contexts,
                                      config.max_positions, config.type_vocab_size == 1,
                                      stride)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        found, nulls = self._found_spans(items, len(questions), max_answer_pieces,
                                         batch_tokens)
        return [answers_of(spans, context, context_words, top_k,
                           null if no_answer and spans else None)
                for spans, context, context_words, null in zip(found, contexts, words, nulls)]

    def _found_spans(self, items: list[SpanItem], pairs: int, max_answer_pieces: int,
                     batch_tokens: int | None
                     ) -> tuple[list[list[tuple[float, int, int]]], list[float]]:
        """Each pair's windows' best spans (score, first word, last word), and the least
        of its windows' no-answer scores."""
        found: list[list[tuple[float, int, int]]] = [[] for _ in range(pairs)]
        nulls = [1.0] * pairs
        batches = self._item_batches([item.ids for item in items], batch_tokens,
                                     [item.segments for item in items])
        for indices, ids, segments in batches:
            logits = self._span_logits(ids, segments).float().cpu().numpy()   # (B, T, 2)
            for row, index in enumerate(indices):
                item = items[index]
                read = np.concatenate([logits[row, :1], logits[row, item.first:item.first
                                                               + len(item.words)]])  # (1+L, 2)
                spans, null = best_spans(read[:, 0], read[:, 1], max_answer_pieces)
                nulls[item.pair] = min(nulls[item.pair], null)
                found[item.pair].extend((score, int(item.words[i]), int(item.words[j]))
                                        for i, j, score in spans)   # words: answers_of
        return found, nulls

    @property
    def answers(self) -> bool:
        """Whether the model's head answers questions (answer needs one)."""
        return self.model.config.question_answering

    @torch.inference_mode()
    def _span_logits(self, ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """ids, segments (B, T) -> (B, T, 2), from either engine."""
        if isinstance(self.model, OnnxSentenceEncoder):
            return self.model.token_logits(ids, segments)
        return self.model.span_logits(self.model(ids, segments))

    @property
    def tags(self) -> bool:
        """Whether the model's head labels each token (tag needs one)."""
        return self.model.config.token_classifier and self.model.config.num_labels > 0

    @torch.inference_mode()
    def _tag_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> (B, T, num_labels), from either engine."""
        if isinstance(self.model, OnnxSentenceEncoder):
            return self.model.token_logits(ids)
        return self.model.tag_logits(self.model(ids))

    def _item_batches(self, items: Sequence[np.ndarray], batch_tokens: int | None,
                      segments: Sequence[np.ndarray] | None = None):
        """(indices of the items, their ids and segments (B, T) right-padded, 0 where
        none are given) by length, batch_tokens at most (None: self.batch_tokens)."""
        for indices in length_sorted_batches(items, self._batch_tokens(batch_tokens)):
            width = max(len(items[i]) for i in indices)
            batch = torch.full((len(indices), width), self.model.config.pad_id, dtype=torch.long)
            types = torch.zeros((len(indices), width), dtype=torch.long)
            for row, index in enumerate(indices):
                batch[row, :len(items[index])] = torch.from_numpy(items[index])
                if segments is not None:
                    types[row, :len(items[index])] = torch.from_numpy(segments[index])
            yield np.asarray(indices), batch.to(self.device), types.to(self.device)

    def check_inputs(self, pairs: bool) -> None:
        """A ConfigError if the classifier records that it was fine-tuned on the other
        kind of input: its classes mean nothing for single texts if it learned them on
        pairs, and the other way round (an unrecorded one takes either)."""
        if self.classifier_inputs == "pairs" and not pairs:
            raise ConfigError("this classifier was fine-tuned on pairs of texts: give each "
                              "text its second text (--pairs FILE on the command line, "
                              "pairs= in Python, \"text_pairs\" in a request)")
        if self.classifier_inputs == "texts" and pairs:
            raise ConfigError("this classifier was fine-tuned on single texts, not pairs: "
                              "classify the texts without second texts")

    @property
    def classifies(self) -> bool:
        """Whether the model has a classification head of classes (classify needs one)."""
        return self.model.config.num_labels > 1 and not self._reads_tokens

    @property
    def scores(self) -> bool:
        """Whether the model's head has one output (score and rerank need one): a
        cross-encoder (ms-marco-MiniLM, bge-reranker) or a regression head (STS-B)."""
        return self.model.config.num_labels == 1 and not self._reads_tokens

    @property
    def _reads_tokens(self) -> bool:
        """Whether the model's head reads each token (a tagger's, a question answerer's)."""
        return self.model.config.token_classifier or self.model.config.question_answering

    def _not_a_scorer(self) -> str:
        count = self.model.config.num_labels
        has = "a token-classification head: tag with it" if self.tags else \
            f"{count} classes: classify with it" if count else "no head"
        return f"score and rerank need a model with one output (a cross-encoder or a " \
               f"regression head); this one has {has}"

    @torch.inference_mode()
    def _class_logits(self, ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """ids, segments (B, T) -> (B, num_labels), from either engine."""
        if isinstance(self.model, OnnxSentenceEncoder):
            return self.model.class_logits(ids, segments)
        return self.model.classify_logits(self.model.pool(self.model(ids, segments), ids))

    @torch.inference_mode()
    def _embeddings(self, ids: torch.Tensor, pooling: str) -> torch.Tensor:
        """ids (B, T) -> the pooled hidden states (B, C), from either engine."""
        if isinstance(self.model, OnnxSentenceEncoder):
            return self.model.embeddings(ids, pooling)
        return self.model.sentence_embeddings(ids, pooling=pooling)

    def _batches(self, lines: Sequence[str], batch_tokens: int | None, first_line_number: int,
                 pairs: Sequence[str] | None = None, *, warn: bool = True):
        """(indices of the lines, their ids and segments (B, T) right-padded) by length,
        batch_tokens at most (None: self.batch_tokens); pairs: each line's second text,
        or None; warn: of each pair cut to fit."""
        batch_tokens = self._batch_tokens(batch_tokens)
        items = self._items(lines, first_line_number) if pairs is None else \
            self._pair_items(lines, pairs, first_line_number, warn)
        for indices in length_sorted_batches([ids for ids, _ in items], batch_tokens):
            width = max(len(items[i][0]) for i in indices)
            batch = torch.full((len(indices), width), self.model.config.pad_id, dtype=torch.long)
            segments = torch.zeros((len(indices), width), dtype=torch.long)
            for row, index in enumerate(indices):
                ids, segment = items[index]
                batch[row, :len(ids)], segments[row, :len(ids)] = (torch.from_numpy(ids),
                                                                   torch.from_numpy(segment))
            yield np.asarray(indices), batch.to(self.device), segments.to(self.device)

    def _batch_tokens(self, batch_tokens: int | None) -> int:
        """A batch's tokens, checked (None: self.batch_tokens)."""
        batch_tokens = self.batch_tokens if batch_tokens is None else batch_tokens
        if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
            raise ConfigError(f"batch_tokens={batch_tokens!r}: must be a positive integer "
                              f"(tokens per batch, padding counted)")
        return batch_tokens

    def item_ids(self, lines: Sequence[Line], first_line_number: int = 1) -> list[list[int]]:
        """Each line's ids as classify and embed read it, whole (not cropped to the
        model's positions): [CLS] line [SEP], or PromptIds as they are (a PromptIds
        holding ids the model lacks is a TextError naming the line)."""
        t = self.tokenizer
        lines = checked_texts(lines, "line", first_line_number, ids_too=True)
        texts = iter(t.encode([line.strip() for line in lines
                               if not isinstance(line, PromptIds)]))
        items = []
        for number, line in enumerate(lines, start=first_line_number):
            if isinstance(line, PromptIds):
                problem = ids_problem(line, self.model.config.src_vocab_size)
                if problem:
                    raise TextError(f"line {number}: {problem}")
                items.append(PromptIds(line))
            else:
                items.append([t.bos_id, *next(texts), t.eos_id])
        return items

    def item(self, text: str, pair: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One text's ids and segments (1, T) on the device, as classify reads it: [CLS]
        text [SEP], or a pair's [CLS] text [SEP] pair [SEP], cropped to the model's
        positions as classify crops it (with a warning)."""
        ((ids, segments),) = self._items([text], 1) if pair is None else \
            self._pair_items([text], [pair], 1, warn=True)
        return torch.from_numpy(ids)[None].to(self.device), \
            torch.from_numpy(segments)[None].to(self.device)

    def _items(self, lines: Sequence[Line], first_line_number: int
               ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each line's ids and segments (T,), cropped to the model's positions with a
        warning."""
        return [self._cropped(ids, number) for number, ids in
                enumerate(self.item_ids(lines, first_line_number), start=first_line_number)]

    def _pair_items(self, lines: Sequence[str], pairs: Sequence[str], first_line_number: int,
                    warn: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each pair's ids and segments (T,), cropped as the tokenizers library's
        "longest_first" cuts a pair (with a warning, if warn)."""
        t, limit = self.tokenizer, self.model.config.max_positions
        lines = checked_texts(lines, "line", first_line_number)
        pairs = checked_texts(pairs, "second text", first_line_number)
        if len(pairs) != len(lines):
            raise ConfigError(f"{len(lines)} texts but {len(pairs)} second texts: a pair "
                              f"is a text and its second text, one each")
        encoded = t.encode([line.strip() for line in lines])
        seconds = t.encode([text.strip() for text in pairs])
        one_segment = self.model.config.type_vocab_size == 1     # RoBERTa's pairs
        items = []
        for number, (a, b) in enumerate(zip(encoded, seconds), start=first_line_number):
            a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
            kept_a, kept_b = crop_pair(a, b, limit, one_segment)
            if warn and (len(kept_a) < len(a) or len(kept_b) < len(b)):
                _warn_truncated(f"line {number}: {len(a)} + {len(b)} tokens, truncated to "
                                f"the model's limit of {limit} positions")
            ids, segments, _ = encoder_item(kept_a, kept_b, t.bos_id, t.eos_id, one_segment)
            items.append((ids, segments))
        return items

    def _cropped(self, ids: list[int], number: int) -> tuple[np.ndarray, np.ndarray]:
        """One line's ids (item_ids') and segments (T,), cropped to the model's positions
        with a warning: a text keeps its [SEP], PromptIds lose their end."""
        limit = self.model.config.max_positions
        given = isinstance(ids, PromptIds)
        if len(ids) > limit:
            tokens = f"{len(ids)} token ids" if given else f"{len(ids) - 2} tokens"
            _warn_truncated(f"line {number}: {tokens}, truncated to the model's limit of "
                            f"{limit} positions")
            ids = list(ids[:limit]) if given else [*ids[:limit - 1], self.tokenizer.eos_id]
        return np.asarray(ids, dtype=np.int64), np.zeros(len(ids), dtype=np.int64)


def _warn_truncated(message: str) -> None:
    """A LineTruncated warning at the caller's line: the first frame outside this module,
    however deep the call that cut the line."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, LineTruncated, stacklevel=level)
