"""Question-answering speed of an extractive answerer: our SentenceEncoder.answer in
PyTorch and on our ONNX export (ONNX Runtime), against transformers'
BertForQuestionAnswering with the question-answering pipeline's windows and span
search, on the same weights.

A BertForQuestionAnswering of bert-base's shape (12 layers of 768, 12 heads, 3072,
30,522 tokens, 512 positions; `--layers` etc. to change it) is built by transformers
from a random config with a WordPiece vocabulary of whole words, saved with
save_pretrained and imported with `transduce import hf-bert`; `transduce export onnx` of
the import is the third peer. --questions questions of 4 to 12 random words are each
answered from a context of --min-context-words to --max-context-words random words (a
long one read in windows of 512 positions sharing 128 tokens). transformers 5 has no
question-answering pipeline, so its side is what version 4's did: the fast tokenizer's
windows (truncation "only_second", return_overflowing_tokens, stride 128, offsets), the
model over the same length-sorted batches of at most --batch-tokens tokens (padding
counted) that ours runs, then in each window the softmax of the start and end logits
over [CLS] and the context, every span of at most 30 tokens scored p_start x p_end (the
outer product), the best over the windows, read back by its characters' offsets.
float32, on the same threads, interleaved over --repeats rounds. Counted: questions per
second of the whole call (tokenizing included); each peer's answers are compared with
ours (the fraction of the same text, and the largest score difference).

    python bench/answer.py [--questions 128] [--repeats 3] [--out bench/results/answer-cpu.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from encode import add_model_arguments, write_vocabulary  # noqa: E402
from measure import time_keeping_results, write_peers_result  # noqa: E402
from transduce.decode.answering import MAX_ANSWER_PIECES, span_items  # noqa: E402
from transduce.decode.encode import SentenceEncoder  # noqa: E402
from transduce.decode.translate import length_sorted_batches  # noqa: E402
from transduce.data.answer_windows import STRIDE  # noqa: E402
from transduce.export.onnx import export_onnx  # noqa: E402
from transduce.importers import import_bert  # noqa: E402

POSITIONS = 512


def build_hf_model(args: argparse.Namespace, directory: Path):
    """A random BertForQuestionAnswering saved where our importer reads it, with a
    vocabulary of whole words w0, w1, ... (one token each)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(transformers.BertConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=args.d_ff,
        max_position_embeddings=POSITIONS)).eval()
    model.save_pretrained(directory)
    return model, write_vocabulary(directory, args.vocab)


def random_pairs(words: list[str], args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """--questions questions of 4 to 12 words and their contexts (the same for a seed)."""
    rng = random.Random(0)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    pairs = [(text(4, 12), text(args.min_context_words, args.max_context_words))
             for _ in range(args.questions)]
    return [q for q, _ in pairs], [c for _, c in pairs]


def best_window_span(start: np.ndarray, end: np.ndarray, context: list[int]
                     ) -> tuple[int, int, float]:
    """transformers 4's span search in one window: softmax over [CLS] (0) and the context
    tokens, every span of at most MAX_ANSWER_PIECES context tokens by the outer product
    -> (first token, last token, p_start x p_end)."""
    kept = [0, *context]
    p_start, p_end = (np.exp(x[kept] - x[kept].max()) for x in (start, end))
    p_start, p_end = p_start / p_start.sum(), p_end / p_end.sum()
    scores = np.tril(np.triu(np.outer(p_start[1:], p_end[1:])), MAX_ANSWER_PIECES - 1)
    i, j = np.unravel_index(int(scores.argmax()), scores.shape)
    return context[i], context[j], float(scores[i, j])


def hf_answerer(model, directory: Path, questions: list[str], contexts: list[str],
                batches: list[list[int]]):
    """transformers' side over our batches of windows -> a call that returns each
    question's (answer text, score)."""
    import transformers

    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory))

    def answer() -> list[tuple[str, float]]:
        windows = tokenizer(questions, contexts, truncation="only_second",
                            max_length=POSITIONS, stride=STRIDE,
                            return_overflowing_tokens=True, return_offsets_mapping=True)
        assert len(windows["input_ids"]) == sum(map(len, batches))     # ours, in order
        best = [("", -1.0)] * len(questions)
        for indices in batches:
            ids = [windows["input_ids"][w] for w in indices]
            width = max(map(len, ids))
            inputs = {name: torch.tensor([windows[name][w] + [0] * (width - len(windows[name][w]))
                                          for w in indices])      # right-padded with 0
                      for name in ("input_ids", "token_type_ids", "attention_mask")}
            with torch.inference_mode():
                found = model(**inputs)
            for row, w in enumerate(indices):
                pair = windows["overflow_to_sample_mapping"][w]
                context = [t for t, s in enumerate(windows.sequence_ids(w)) if s == 1]
                i, j, score = best_window_span(found.start_logits[row].numpy(),
                                               found.end_logits[row].numpy(), context)
                if score > best[pair][1]:
                    offsets = windows["offset_mapping"][w]
                    best[pair] = (contexts[pair][offsets[i][0]:offsets[j][1]], score)
        return best

    return answer


def ours_as_pairs(encoder: SentenceEncoder, questions: list[str], contexts: list[str],
                  batch_tokens: int):
    def answer() -> list[tuple[str, float]]:
        return [(found[0].text, found[0].score) for found in encoder.answer(
            questions, contexts, batch_tokens=batch_tokens)]
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--min-context-words", type=int, default=100)
    parser.add_argument("--max-context-words", type=int, default=700)
    parser.add_argument("--out", type=Path, default=Path("bench/results/answer-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        hf, words = build_hf_model(args, scratch / "hf")
        questions, contexts = random_pairs(words, args)
        ours = SentenceEncoder.load(import_bert(scratch / "hf", scratch / "ours"))
        onnx = SentenceEncoder.load(export_onnx(scratch / "ours", scratch / "onnx"))
        items, _ = span_items(ours.tokenizer, questions, contexts, POSITIONS, False)
        batches = [list(b) for b in length_sorted_batches([i.ids for i in items],
                                                          args.batch_tokens)]
        calls = {"ours": ours_as_pairs(ours, questions, contexts, args.batch_tokens),
                 "onnxruntime": ours_as_pairs(onnx, questions, contexts, args.batch_tokens),
                 "transformers": hf_answerer(hf, scratch / "hf", questions, contexts, batches)}
        started = time.time()
        times, answered = time_keeping_results(calls, args.repeats)
    tokens = sum(len(item.ids) for item in items)
    peers = {}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        agree = sum(a == b for (a, _), (b, _) in zip(answered[name], answered["ours"]))
        largest = max(abs(p - q) for (_, p), (_, q) in zip(answered[name], answered["ours"]))
        peers[name] = {"seconds": median, "questions_per_s": len(questions) / median,
                       "tokens_per_s": tokens / median, "all_seconds": seconds,
                       "answers_agreeing_with_ours": agree / len(questions),
                       "largest_score_difference_from_ours": largest}
        print(f"{name}: {len(questions) / median:.2f} questions/s ({tokens / median:.0f} "
              f"tokens/s; {agree} of {len(questions)} answers as ours, scores within "
              f"{largest:.1e})")
    settings = {name: value for name, value in vars(args).items()
                if name not in ("lines", "max_words")}
    write_peers_result(args, peers, "questions_per_s", started, settings,
                       questions=len(questions), windows=len(items), tokens=tokens,
                       batches=len(batches))


if __name__ == "__main__":
    main()
