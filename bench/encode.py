"""Sentence-embedding speed of an encoder-only model: our SentenceEncoder in PyTorch and
on our ONNX export (ONNX Runtime), against transformers' BertModel, on the same weights.

A BERT of bert-base's shape (12 layers of 768, 12 heads, 3072, 30,522 tokens; `--layers`
etc. to change it; `--family deberta`: a DeBERTa-v3 of that shape, DebertaV2Model, with
its disentangled attention) is built by transformers from a random config with a
WordPiece vocabulary of whole words, saved with save_pretrained and imported with
`transduce import hf-bert` (hf-deberta); `transduce export onnx` of the import is the
third peer. --lines lines of 8 to --max-words random words each are embedded (mean of
the last hidden states over real tokens, as sentence-transformers pools). Every peer
tokenizes its lines and runs the same length-sorted batches of at most --batch-tokens
tokens (padding counted), float32 (and ours in bfloat16 and int8, the types `--dtype
auto` picks on AMX and on other x86 CPUs, int8 through oneDNN's kernel with `--dtypes
int8-onednn`, and the export with `--quantize int8`), on the same threads, interleaved
over --repeats rounds. Counted: lines per second of the whole call; each peer's vectors are
compared with ours (largest difference).

    python bench/encode.py [--lines 512] [--repeats 3] [--out bench/results/encode-cpu.json]
        [--dtypes int8] [--family deberta]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import array_peer_records, int8_through_onednn, time_keeping_results, \
    write_peers_result  # noqa: E402
from transduce.decode.encode import SentenceEncoder  # noqa: E402
from transduce.decode.translate import length_sorted_batches  # noqa: E402
from transduce.export.onnx import export_onnx  # noqa: E402
from transduce.importers import import_bert, import_deberta  # noqa: E402

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ONEDNN_INT8 = "int8-onednn"      # the int8 copy through oneDNN's kernel: the VNNI kernel's peer


# --family: the transformers model built, and our importer of it.
FAMILIES = {"bert": ("BertModel", import_bert), "deberta": ("DebertaV2Model", import_deberta)}
# DeBERTa-v3's disentangled attention (its released config.json's values).
DEBERTA_V3 = dict(relative_attention=True, position_buckets=256, max_relative_positions=-1,
                  position_biased_input=False, pos_att_type=["p2c", "c2p"],
                  share_att_key=True, norm_rel_ebd="layer_norm", type_vocab_size=0,
                  layer_norm_eps=1e-7)


def build_hf_model(args: argparse.Namespace, directory: Path):
    """A random BertModel (DebertaV2Model of DeBERTa-v3's layout: --family deberta) saved
    where our importer reads it, with a vocabulary of whole words w0, w1, ... (one token
    each)."""
    import transformers

    torch.manual_seed(0)
    sizes = dict(vocab_size=args.vocab, hidden_size=args.d_model,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads,
                 intermediate_size=args.d_ff, max_position_embeddings=512)
    config = transformers.DebertaV2Config(**sizes, **DEBERTA_V3) \
        if args.family == "deberta" else transformers.BertConfig(**sizes)
    model = getattr(transformers, FAMILIES[args.family][0])(config).eval()
    model.save_pretrained(directory)
    return model, write_vocabulary(directory, args.vocab)


def write_vocabulary(directory: Path, size: int) -> list[str]:
    """A WordPiece vocabulary.txt of `size` entries, BERT's specials and whole words w0,
    w1, ... (one token each), lowercased -> the words."""
    words = [f"w{i}" for i in range(size - len(SPECIAL))]
    (directory / "vocab.txt").write_text("\n".join(SPECIAL + words) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return words


def random_lines(words: list[str], count: int, max_words: int) -> list[str]:
    """`count` lines of 8 to max_words words drawn from `words` (the same for a seed)."""
    rng = random.Random(0)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, max_words)))
            for _ in range(count)]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape (bert-base's by default), the lines, the batches, the rounds and
    the threads: what the encoder benchmarks share."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-ff", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--lines", type=int, default=512)
    parser.add_argument("--max-words", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())


def hf_embedder(model, directory: Path, lines: list[str], batches: list[list[int]]):
    """transformers' side: BertTokenizerFast, then the model and the same mean pooling,
    over our batches -> a call that returns the (N, C) vectors."""
    import transformers

    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory))

    def embed() -> np.ndarray:
        vectors = np.zeros((len(lines), model.config.hidden_size), dtype=np.float32)
        for indices in batches:
            inputs = tokenizer([lines[i] for i in indices], padding=True, return_tensors="pt")
            with torch.inference_mode():
                hidden = model(**inputs).last_hidden_state                   # (B, T, C)
            real = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            vectors[indices] = ((hidden * real).sum(1) / real.sum(1)).numpy()
        return vectors

    return embed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "int8"],
                        choices=["bfloat16", "int8", ONEDNN_INT8],
                        help="ours in these types too (leave bfloat16 out on a CPU without "
                             f"bfloat16 units, where it multiplies some 30x slower; "
                             f"{ONEDNN_INT8}: int8 through oneDNN's kernel, where the int8 "
                             "VNNI kernel would run)")
    parser.add_argument("--family", choices=list(FAMILIES), default="bert",
                        help="the model's layout: BERT's, or DeBERTa-v3's disentangled "
                             "attention (DebertaV2Model)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/encode-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        hf, words = build_hf_model(args, scratch / "hf")
        lines = random_lines(words, args.lines, args.max_words)
        importer = FAMILIES[args.family][1]
        encoders = {"ours": SentenceEncoder.load(importer(scratch / "hf", scratch / "ours"))}
        for dtype in args.dtypes:
            with int8_through_onednn(dtype == ONEDNN_INT8):
                encoders[f"ours {dtype}"] = SentenceEncoder.load(
                    scratch / "ours", dtype="int8" if dtype == ONEDNN_INT8 else dtype)
        for name, quantize in (("onnxruntime", None), ("onnxruntime int8", "int8")):
            encoders[name] = SentenceEncoder.load(export_onnx(
                scratch / "ours", scratch / name.replace(" ", "-"), quantize))
        t = encoders["ours"].tokenizer
        ids = [[t.bos_id, *row, t.eos_id] for row in t.encode(lines)]      # [CLS] ... [SEP]
        batches = [list(b) for b in length_sorted_batches(ids, args.batch_tokens)]
        calls = {"transformers": hf_embedder(hf, scratch / "hf", lines, batches),
                 **{name: lambda e=encoder: e.embed(lines, batch_tokens=args.batch_tokens)
                    for name, encoder in encoders.items()}}
        started = time.time()
        times, vectors = time_keeping_results(calls, args.repeats)
    tokens = sum(len(row) for row in ids)
    peers = array_peer_records(times, vectors, args.lines, "lines", tokens)
    write_peers_result(args, peers, "lines_per_s", started, tokens=tokens,
                       batches=len(batches))


if __name__ == "__main__":
    main()
