"""Classifying long documents with a ModernBERT: our SentenceEncoder in PyTorch and on our
ONNX export (ONNX Runtime), against transformers' ModernBertForSequenceClassification,
on the same weights.

A ModernBERT of ModernBERT-base's shape (22 layers of 768, 12 heads, a GeGLU of 1,152,
every third layer full and the others sliding over 64 tokens each side; `--layers` etc.
to change it) is built by transformers from a random config, saved with save_pretrained
and imported with `transduce import hf-modernbert`; `transduce export onnx` of the import
is the third peer. Its tokenizer is a WordPiece vocabulary of whole words (one token
each), which transformers' BertTokenizerFast and ours read alike. --documents documents
of --shortest to --longest random words are classified (three classes; the softmax of
the logits). Every peer tokenizes its documents and runs the same length-sorted batches
of at most --batch-tokens tokens (padding counted), float32, on the same threads,
interleaved over --repeats rounds. Counted: documents and tokens per second of the whole
call; each peer's probabilities are compared with ours (largest difference).

Ours runs a sliding layer's attention over blocks of the band (attention/local.py), in
time linear in the length; transformers' SDPA path masks the whole square; our ONNX
export computes the band's scores as a masked square too (the naive kernel's form).

    python bench/long_documents.py [--documents 12] [--repeats 3]
        [--out bench/results/long-documents-cpu.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from encode import write_vocabulary  # noqa: E402
from measure import array_peer_records, time_keeping_results, \
    write_peers_result  # noqa: E402
from transduce.decode.encode import SentenceEncoder  # noqa: E402
from transduce.decode.translate import length_sorted_batches  # noqa: E402
from transduce.export.onnx import export_onnx  # noqa: E402
from transduce.importers import import_modernbert  # noqa: E402

CLASSES = 3


def build_hf_model(args: argparse.Namespace, directory: Path):
    """A random ModernBertForSequenceClassification saved where our importer reads it,
    with a vocabulary of whole words -> (model, the words)."""
    import transformers

    directory.mkdir(parents=True)
    words = write_vocabulary(directory, args.vocab)        # [PAD] 0, [CLS] 2, [SEP] 3
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=args.d_ff,
        local_attention=2 * args.window, max_position_embeddings=8192, num_labels=CLASSES,
        pad_token_id=0, cls_token_id=2, bos_token_id=2, sep_token_id=3, eos_token_id=3)
    model = transformers.ModernBertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    return model, words


def documents(words: list[str], count: int, shortest: int, longest: int) -> list[str]:
    """`count` documents of shortest to longest words from `words` (the same for a seed)."""
    rng = random.Random(0)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(shortest, longest)))
            for _ in range(count)]


def hf_classifier(model, directory: Path, lines: list[str], batches: list[list[int]]):
    """transformers' side: BertTokenizerFast, then the classifier and a softmax, over our
    batches -> a call that returns the (N, classes) probabilities."""
    import transformers

    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory))

    def classify() -> np.ndarray:
        probabilities = np.zeros((len(lines), CLASSES), dtype=np.float32)
        for indices in batches:
            inputs = tokenizer([lines[i] for i in indices], padding=True, return_tensors="pt",
                               return_token_type_ids=False)
            with torch.inference_mode():
                logits = model(**inputs).logits
            probabilities[indices] = logits.float().softmax(-1).numpy()
        return probabilities

    return classify


def our_classifier(encoder: SentenceEncoder, lines: list[str], batch_tokens: int):
    def classify() -> np.ndarray:
        return np.array([list(p.probabilities.values())
                         for p in encoder.classify(lines, batch_tokens=batch_tokens)],
                        dtype=np.float32)

    return classify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-ff", type=int, default=1152)
    parser.add_argument("--window", type=int, default=64, help="tokens on each side")
    parser.add_argument("--vocab", type=int, default=50368)
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--shortest", type=int, default=512)
    parser.add_argument("--longest", type=int, default=4094)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path,
                        default=Path("bench/results/long-documents-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        hf, words = build_hf_model(args, scratch / "hf")
        lines = documents(words, args.documents, args.shortest, args.longest)
        ours = SentenceEncoder.load(import_modernbert(scratch / "hf", scratch / "ours"))
        onnx = SentenceEncoder.load(export_onnx(scratch / "ours", scratch / "onnx"))
        t = ours.tokenizer
        ids = [[t.bos_id, *row, t.eos_id] for row in t.encode(lines)]      # [CLS] ... [SEP]
        batches = [list(b) for b in length_sorted_batches(ids, args.batch_tokens)]
        calls = {"transformers": hf_classifier(hf, scratch / "hf", lines, batches),
                 "ours": our_classifier(ours, lines, args.batch_tokens),
                 "onnxruntime": our_classifier(onnx, lines, args.batch_tokens)}
        started = time.time()
        times, probabilities = time_keeping_results(calls, args.repeats)
    tokens = sum(len(row) for row in ids)
    peers = array_peer_records(times, probabilities, args.documents, "documents", tokens)
    write_peers_result(args, peers, "documents_per_s", started, tokens=tokens,
                       batches=len(batches))


if __name__ == "__main__":
    main()
