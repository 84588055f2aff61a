"""Tagging speed of a token classifier (named entities): our SentenceEncoder.tag in PyTorch
and on our ONNX export (ONNX Runtime), against transformers' BertForTokenClassification,
on the same weights.

A BertForTokenClassification of bert-base's shape (12 layers of 768, 12 heads, 3072,
30,522 tokens; `--layers` etc. to change it) and CoNLL-2003's 9 tags is built by
transformers from a random config with a WordPiece vocabulary of whole words, saved with
save_pretrained and imported with `transduce import hf-bert`; `transduce export onnx` of
the import is the third peer. --lines lines of 8 to --max-words random words each are
tagged: each word's tag is the argmax at its first piece. transformers' side tokenizes
the words (is_split_into_words), runs the model over the same length-sorted batches of
at most --batch-tokens tokens (padding counted) that ours runs, and picks each word's
first piece by word_ids(); float32, on the same threads, interleaved over --repeats
rounds. Counted: words per second of the whole call; each peer's tags are compared with
ours (the fraction that agree) and its probabilities (largest difference).

    python bench/tag.py [--lines 512] [--repeats 3] [--out bench/results/tag-cpu.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from encode import add_model_arguments, random_lines, write_vocabulary  # noqa: E402
from measure import time_keeping_results, write_peers_result  # noqa: E402
from transduce.decode.encode import SentenceEncoder  # noqa: E402
from transduce.decode.tagging import tag_items  # noqa: E402
from transduce.decode.translate import length_sorted_batches  # noqa: E402
from transduce.export.onnx import export_onnx  # noqa: E402
from transduce.importers import import_bert  # noqa: E402

TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


def build_hf_model(args: argparse.Namespace, directory: Path):
    """A random BertForTokenClassification saved where our importer reads it, with a
    vocabulary of whole words w0, w1, ... (one token each)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.BertForTokenClassification(transformers.BertConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=args.d_ff,
        max_position_embeddings=512, id2label=dict(enumerate(TAGS)),
        label2id={tag: i for i, tag in enumerate(TAGS)})).eval()
    model.save_pretrained(directory)
    return model, write_vocabulary(directory, args.vocab)


def hf_tagger(model, directory: Path, lines: list[str], batches: list[list[int]]):
    """transformers' side: BertTokenizerFast over each line's words, the model over our
    batches, each word's first piece -> a call that returns each line's (tags,
    probabilities)."""
    import transformers

    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory))

    def tag() -> list[tuple[list[str], np.ndarray]]:
        result: list = [None] * len(lines)
        for indices in batches:
            words = [lines[i].split() for i in indices]
            inputs = tokenizer(words, is_split_into_words=True, padding=True,
                               return_tensors="pt")
            with torch.inference_mode():
                probabilities = model(**inputs).logits.softmax(-1).numpy()     # (B, T, K)
            for row, index in enumerate(indices):
                word_ids = inputs.word_ids(row)
                firsts = [word_ids.index(w) for w in range(len(words[row]))]
                chosen = probabilities[row, firsts]
                result[index] = ([TAGS[k] for k in chosen.argmax(-1)], chosen.max(-1))
        return result

    return tag


def ours_as_pairs(encoder: SentenceEncoder, lines: list[str], batch_tokens: int):
    def tag() -> list[tuple[list[str], np.ndarray]]:
        return [([w.tag for w in line], np.array([w.probability for w in line]))
                for line in encoder.tag(lines, batch_tokens=batch_tokens)]
    return tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("bench/results/tag-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        hf, words = build_hf_model(args, scratch / "hf")
        lines = random_lines(words, args.lines, args.max_words)
        ours = SentenceEncoder.load(import_bert(scratch / "hf", scratch / "ours"))
        onnx = SentenceEncoder.load(export_onnx(scratch / "ours", scratch / "onnx"))
        items = tag_items(ours.tokenizer, [line.split() for line in lines],
                          ours.model.config.max_positions)
        assert len(items) == len(lines)          # no line is cut into chunks here
        batches = [list(b) for b in length_sorted_batches([i.ids for i in items],
                                                          args.batch_tokens)]
        calls = {"ours": ours_as_pairs(ours, lines, args.batch_tokens),
                 "onnxruntime": ours_as_pairs(onnx, lines, args.batch_tokens),
                 "transformers": hf_tagger(hf, scratch / "hf", lines, batches)}
        started = time.time()
        times, tagged = time_keeping_results(calls, args.repeats)
    count = sum(len(line.split()) for line in lines)
    tokens = sum(len(item.ids) for item in items)
    peers = {}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        agree = sum(a == b for (theirs, _), (mine, _) in zip(tagged[name], tagged["ours"])
                    for a, b in zip(theirs, mine)) / count
        largest = max(float(np.abs(p - q).max())
                      for (_, p), (_, q) in zip(tagged[name], tagged["ours"]))
        peers[name] = {"seconds": median, "words_per_s": count / median,
                       "tokens_per_s": tokens / median, "all_seconds": seconds,
                       "tags_agreeing_with_ours": agree,
                       "largest_probability_difference_from_ours": largest}
        print(f"{name}: {count / median:.0f} words/s ({tokens / median:.0f} tokens/s; "
              f"{100 * agree:.2f}% of tags as ours, probabilities within {largest:.1e})")
    write_peers_result(args, peers, "words_per_s", started, words=count, tokens=tokens,
                       batches=len(batches))


if __name__ == "__main__":
    main()
