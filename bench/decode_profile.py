"""Where a decoding step's time goes: our decoder (float32, the bfloat16 copy and the
int8 one) on a corpus split, greedy and beam 4, in batches of --batch-sentences lines
sorted by length, under PyTorch's profiler.

Each setting translates the lines once unprofiled (sentences/s) and once profiled. The
profiled wall time is split into the operators' own time by kind (oneDNN's packed and
int8 matrix products, fused attention, the search's log-softmax and top-k, cache and beam
reorders, layer norm, other operators) and what is left: Python between the operators
(the step loop, the search's bookkeeping, dispatch). Shares, not absolute times: the
profiler adds its own cost to every operator.

    python bench/decode_profile.py --model runs/small/ema --data data/bible
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info  # noqa: E402
from transduce.data.corpus import read_lines, split_files  # noqa: E402
from transduce.decode.translate import Translator  # noqa: E402
from transduce.runtime import keep_freed_memory  # noqa: E402

KINDS = {
    "matrix products": ("mkldnn::_linear_pointwise", "onednn::qlinear_pointwise", "aten::addmm",
                        "aten::mm", "aten::bmm", "transduce::int8_vnni_linear",
                        "transduce::int8_rows_linear"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "transduce::one_query_attention"),
    "log-softmax, top-k": ("aten::_log_softmax", "aten::topk", "aten::amax", "aten::sort",
                           "transduce::beam_extensions"),
    "cache and beam reorders": ("aten::index_copy_", "aten::index_select", "aten::copy_",
                                "aten::gather", "aten::index"),
    "layer norm": ("aten::native_layer_norm",),
}


def breakdown(translator: Translator, lines: list[str], beam: int, batch: int) -> dict:
    """-> sentences/s unprofiled, and each kind's share of the profiled wall time."""
    translator.translate(lines[:2 * batch], beam=beam, batch_sentences=batch)   # warm-up
    start = time.perf_counter()
    translator.translate(lines, beam=beam, batch_sentences=batch)
    sentences_per_s = len(lines) / (time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        translator.translate(lines, beam=beam, batch_sentences=batch)
        wall = time.perf_counter() - start
    own = {event.key: event.self_cpu_time_total / 1e6 for event in prof.key_averages()}
    shares = {kind: sum(own.get(name, 0.0) for name in names) / wall
              for kind, names in KINDS.items()}
    shares["other operators"] = sum(own.values()) / wall - sum(shares.values())
    shares["Python between operators"] = 1.0 - sum(own.values()) / wall
    return {"sentences_per_s": sentences_per_s, "shares": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--lines", type=int, default=250,
                        help="every k-th line of the split, so that all lengths are in")
    parser.add_argument("--batch-sentences", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"],
                        choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results"
                        / "decode-profile-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()     # what `transduce translate` does for its process, as bench/decode.py
    source, _ = split_files(args.data, args.split)
    every = read_lines(source)
    lines = every[::max(1, len(every) // args.lines)][:args.lines]
    rows = []
    for dtype in args.dtypes:
        translator = Translator.load(args.model, dtype=dtype)
        for beam in (1, 4):
            row = {"decoder": f"ours {dtype}", "beam": beam,
                   **breakdown(translator, lines, beam, args.batch_sentences)}
            rows.append(row)
            shares = "  ".join(f"{kind} {100 * share:.0f}%" for kind, share in row["shares"].items())
            print(f"{row['decoder']:14s} beam {beam}: {row['sentences_per_s']:6.1f} sentences/s  "
                  f"{shares}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "decode profile", "model": str(args.model),
                                    "split": args.split, "sentences": len(lines),
                                    "batch_sentences": args.batch_sentences,
                                    "machine": machine_info(args.threads), "rows": rows},
                                   indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
