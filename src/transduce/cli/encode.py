"""`transduce classify | tag | answer | score | rerank | embed`: an encoder-only model over
lines of text.

Lines come from --input or standard input; N lines in give N results out, in order.
classify writes `label<TAB>probability` per line (--all: every class's probability;
--pairs: each line is `text<TAB>second text`, for a classifier of pairs); tag, for a
token classifier, writes each line's words with their tags (--format conll: `word<TAB>tag
<TAB>probability` a line, a blank line after each input line; tags: the tags of a line's
words on one line; entities: a line's BIO entities, `KIND<TAB>text` pairs tab-separated,
an empty line for none); answer, for a question answerer, reads `question<TAB>context`
lines and writes the best answer's `text<TAB>score<TAB>start<TAB>end` (the answer's
characters in the context; --top N: N answers' fields on the line, best first; an empty
line for a context of no words; --no-answer: the empty answer competes, an empty text at
0, 0); score, for a
model of one output (a cross-encoder, a regression head), writes its value per line
(--pairs likewise); rerank writes the lines as documents ranked by relevance to --query,
`line<TAB>relevance<TAB>document`, the most relevant first; embed writes an
(N, d_model) float32 .npy file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transduce.cli.outputs import check_output_file
from transduce.cli.options import add_engine_option, positive_int
from transduce.cli.reporting import one_line_warnings
from transduce.config import Dtype, choices


def register(commands) -> None:
    classify = commands.add_parser("classify", help="label lines with a fine-tuned encoder")
    _add_common(classify)
    classify.add_argument("--output", type=Path, default=None, help="default: standard output")
    classify.add_argument("--all", action="store_true",
                          help="every class's probability, label=probability, tab-separated")
    classify.add_argument("--pairs", action="store_true",
                          help="each line is a pair, `text<TAB>second text` (a classifier "
                               "fine-tuned on pairs: entailment, paraphrase)")
    classify.set_defaults(handler=classify_command)

    tag = commands.add_parser("tag", help="tag each word of lines with a token classifier "
                                          "(named entities, parts of speech)")
    _add_common(tag)
    tag.add_argument("--output", type=Path, default=None, help="default: standard output")
    tag.add_argument("--format", choices=["conll", "tags", "entities"], default="conll",
                     help="conll: word<TAB>tag<TAB>probability a line, a blank line after "
                          "each input line; tags: each line's tags on one line; entities: "
                          "each line's BIO entities as KIND<TAB>text, tab-separated")
    tag.set_defaults(handler=tag_command)

    answer = commands.add_parser("answer", help="answer questions from their contexts with "
                                                "an extractive question answerer")
    _add_common(answer)
    answer.add_argument("--output", type=Path, default=None, help="default: standard output")
    answer.add_argument("--top", type=positive_int, default=1,
                        help="the best N answers of each line, best first (default: 1)")
    answer.add_argument("--max-answer-pieces", type=positive_int, default=None,
                        help="the longest answer, in pieces (default: 30, BERT's)")
    answer.add_argument("--no-answer", action="store_true",
                        help="the empty answer competes with the spans (a model trained on "
                             "unanswerable questions, SQuAD 2.0's): an empty text field")
    answer.set_defaults(handler=answer_command)

    score = commands.add_parser("score", help="a cross-encoder's (or regression head's) "
                                              "value for each line or pair")
    _add_common(score)
    score.add_argument("--output", type=Path, default=None, help="default: standard output")
    score.add_argument("--pairs", action="store_true",
                       help="each line is a pair, `text<TAB>second text` (a query and a "
                            "document, for a cross-encoder)")
    score.set_defaults(handler=score_command)

    rerank = commands.add_parser("rerank", help="lines ranked by a cross-encoder's relevance "
                                                "to a query")
    _add_common(rerank)
    rerank.add_argument("--query", required=True, help="the text the lines are ranked against")
    rerank.add_argument("--top", type=positive_int, default=None,
                        help="the most relevant N lines (default: all)")
    rerank.add_argument("--output", type=Path, default=None, help="default: standard output")
    rerank.set_defaults(handler=rerank_command)

    embed = commands.add_parser("embed", help="sentence vectors: the last hidden states pooled")
    _add_common(embed)
    embed.add_argument("--out", type=Path, required=True, help=".npy file to write (N, d_model)")
    embed.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                       help="L2-normalise each vector (default: as the checkpoint records, "
                            "an imported sentence-transformers model's way; else not)")
    embed.add_argument("--pooling", choices=["mean", "cls"], default=None,
                       help="mean of the hidden states over the tokens, or [CLS]'s state "
                            "(default: as the checkpoint records; else mean)")
    embed.set_defaults(handler=embed_command)


def _add_common(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", type=Path, required=True,
                         help="checkpoint, run directory or ONNX export")
    command.add_argument("--input", type=Path, default=None, help="default: standard input")
    command.add_argument("--batch-tokens", type=positive_int, default=None,
                         help="tokens per batch, counting padding (default: 512 on a CPU, "
                              "whose caches small batches stay in; 4096 for ONNX Runtime)")
    command.add_argument("--dtype", default="float32", choices=choices(Dtype))
    add_engine_option(command)


def _read_input(args: argparse.Namespace) -> list[str]:
    """All input lines; invalid UTF-8 names the file (or <stdin>) and line."""
    from transduce.data.corpus import read_lines
    from transduce.decode.streaming import line_batches

    if args.input is not None:
        return read_lines(args.input, allow_empty=True)
    return [line for batch in line_batches(sys.stdin.fileno(), max_lines=1 << 16)
            for line in batch]


def classify_command(args: argparse.Namespace) -> int:
    encoder, lines, seconds = _encoder_and_lines(args)
    with one_line_warnings(args.input):
        predictions = encoder.classify(lines, pairs=seconds, batch_tokens=args.batch_tokens)
    if args.all:
        text = "".join("\t".join(f"{label}={p:.4f}" for label, p in pred.probabilities.items())
                       + "\n" for pred in predictions)
    else:
        text = "".join(f"{pred.label}\t{pred.probability:.4f}\n" for pred in predictions)
    _write(args.output, text)
    return 0


def tag_command(args: argparse.Namespace) -> int:
    from transduce.decode.tagging import entities

    encoder, lines, _ = _encoder_and_lines(args)
    with one_line_warnings(args.input):
        tagged = encoder.tag(lines, batch_tokens=args.batch_tokens)
    if args.format == "conll":
        text = "".join("".join(f"{t.word}\t{t.tag}\t{t.probability:.4f}\n" for t in words)
                       + "\n" for words in tagged)
    elif args.format == "tags":
        text = "".join(" ".join(t.tag for t in words) + "\n" for words in tagged)
    else:
        text = "".join("\t".join(f"{e.kind}\t{e.text}" for e in entities(
            [t.word for t in words], [t.tag for t in words])) + "\n" for words in tagged)
    _write(args.output, text)
    return 0


def answer_command(args: argparse.Namespace) -> int:
    from transduce.decode.answering import MAX_ANSWER_PIECES

    encoder, lines, _ = _encoder_and_lines(args)
    questions, contexts = _split_pairs(lines, args.input,
                                       "answer reads `question<TAB>context` lines")
    found = encoder.answer(questions, contexts, top_k=args.top,
                           max_answer_pieces=args.max_answer_pieces or MAX_ANSWER_PIECES,
                           no_answer=args.no_answer, batch_tokens=args.batch_tokens)
    _write(args.output, "".join("\t".join(f"{a.text}\t{a.score:.4f}\t{a.start}\t{a.end}"
                                          for a in answers) + "\n" for answers in found))
    return 0


def score_command(args: argparse.Namespace) -> int:
    encoder, lines, seconds = _encoder_and_lines(args)
    with one_line_warnings(args.input):
        scores = encoder.score(lines, pairs=seconds, batch_tokens=args.batch_tokens)
    _write(args.output, "".join(f"{value:.6f}\n" for value in scores))
    return 0


def rerank_command(args: argparse.Namespace) -> int:
    encoder, documents, _ = _encoder_and_lines(args)
    found = encoder.rerank(args.query, documents, top_n=args.top,
                           batch_tokens=args.batch_tokens)
    _write(args.output, "".join(f"{r.index + 1}\t{r.relevance:.4f}\t{documents[r.index]}\n"
                                for r in found))
    return 0


def _encoder_and_lines(args: argparse.Namespace):
    """The --output checked, the model loaded and the input read -> (SentenceEncoder,
    lines, their second texts with --pairs, else None)."""
    from transduce.decode.encode import SentenceEncoder

    if args.output is not None:
        check_output_file(args.output, "--output")
    encoder = SentenceEncoder.load(args.model, dtype=args.dtype, engine=args.engine)
    lines, seconds = _read_input(args), None
    if getattr(args, "pairs", False):
        lines, seconds = _split_pairs(lines, args.input)
    return encoder, lines, seconds


def _write(output: Path | None, text: str) -> None:
    """text to standard output, or to the --output file whole."""
    from transduce import atomic

    if output is None:
        sys.stdout.write(text)
    else:
        atomic.write_text(output, text)


def _split_pairs(lines: list[str], path: Path | None,
                 reader: str = "--pairs reads `text<TAB>second text` lines"
                 ) -> tuple[list[str], list[str]]:
    """`text<TAB>second text` lines -> (texts, second texts); a line without exactly
    one tab is named by file (or <stdin>) and line, and `reader` says what is read."""
    from transduce.decode.inputs import TextError

    texts, seconds = [], []
    for number, line in enumerate(lines, start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise TextError(f"{path or '<stdin>'}:{number}: {len(fields) - 1} tabs; {reader}")
        texts.append(fields[0])
        seconds.append(fields[1])
    return texts, seconds


def embed_command(args: argparse.Namespace) -> int:
    import numpy as np

    from transduce import atomic
    from transduce.decode.encode import SentenceEncoder

    check_output_file(args.out, "--out")
    encoder = SentenceEncoder.load(args.model, dtype=args.dtype, engine=args.engine)
    with one_line_warnings(args.input):
        vectors = encoder.embed(_read_input(args), normalize=args.normalize,
                                pooling=args.pooling, batch_tokens=args.batch_tokens)
    settings = {**encoder.embedding_defaults,
                **{k: v for k, v in (("pooling", args.pooling), ("normalize", args.normalize))
                   if v is not None}}
    with atomic.atomic_file(args.out) as temporary, open(temporary, "wb") as handle:
        np.save(handle, vectors)
    print(f"wrote {args.out}: {vectors.shape[0]} vectors of {vectors.shape[1]} "
          f"({settings['pooling']} pooling, "
          f"{'L2-normalised' if settings['normalize'] else 'not normalised'})", file=sys.stderr)
    return 0
