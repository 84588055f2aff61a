"""Training on packed rows against length-sorted batches, on this machine's CPU.

Our `small` model (as bench/train.py builds it, in the dtype `transduce train` picks
here) trains on the Bible corpus from the same initial weights in each peer: "sorted"
on TokenBatcher's length-sorted batches of --max-tokens, "packed L" on rows of L tokens
packed with whole pairs (data/packing.py) at the same budget. Each peer steps through its
own first --steps batches of epoch 0 (warm-up), then the peers alternate timed rounds.
All count target tokens that are not padding per second of forward, backward and
optimizer step, and the share of padding in their batches. Writes JSON with the CPU's
description and flags.

    python bench/packing.py --data data/bible [--max-tokens 4096] [--pack-lengths 128 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import machine_info  # noqa: E402
from train import LR, SMOOTHING, batches, packed_batches  # noqa: E402
from transduce.config import preset  # noqa: E402
from transduce.data.tokenizer import PAD_ID  # noqa: E402
from transduce.model import Transformer  # noqa: E402
from transduce.runtime import keep_freed_memory, training_dtype  # noqa: E402
from transduce.train.loss import projected_label_smoothed_nll  # noqa: E402


def stepper(vocab: int, dtype: torch.dtype | None):
    """A fresh model (seed 0) and its training step on a batch -> target tokens."""
    torch.manual_seed(0)
    model = Transformer(preset("small", src_vocab_size=vocab, tgt_vocab_size=vocab)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.98), eps=1e-9,
                                 fused=True)

    def step(batch) -> int:
        tokens = batch.num_tgt_tokens
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            hidden = model(batch.src, batch.tgt_in, project=False, segments=batch.segments)
            loss = projected_label_smoothed_nll(hidden, model.output_proj.weight,
                                                batch.tgt_out, SMOOTHING, PAD_ID)[0]
            (loss / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens
    return step


def padding(chosen: list) -> float:
    """Share of padding among the batches' source and target positions."""
    real = sum(int((b.src != PAD_ID).sum() + (b.tgt_in != PAD_ID).sum()) for b in chosen)
    return 1.0 - real / sum(b.src.numel() + b.tgt_in.numel() for b in chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--pack-lengths", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--steps", type=int, default=8, help="batches per round and peer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "packing-cpu.json")
    args = parser.parse_args()
    keep_freed_memory()   # what `transduce train` does
    dtype = torch.bfloat16 if training_dtype("auto", torch.device("cpu")) == "bfloat16" else None
    sorted_batches, vocab = batches(args.data, args.max_tokens, args.steps)
    data = {"sorted": sorted_batches}
    for length in args.pack_lengths:
        data[f"packed {length}"] = packed_batches(args.data, args.max_tokens, args.steps, length)[0]
    steps = {peer: stepper(vocab, dtype) for peer in data}
    for peer, chosen in data.items():
        for batch in chosen:
            steps[peer](batch)
    seconds: dict[str, list[float]] = {peer: [] for peer in data}
    for _ in range(args.rounds):
        for peer, chosen in data.items():
            start = time.perf_counter()
            for batch in chosen:
                steps[peer](batch)
            seconds[peer].append(time.perf_counter() - start)
    rows = []
    for peer, chosen in data.items():
        tokens = sum(b.num_tgt_tokens for b in chosen)
        rows.append({"peer": peer, "seconds": seconds[peer], "target_tokens_per_round": tokens,
                     "target_tokens_per_s": tokens / statistics.median(seconds[peer]),
                     "padding": padding(chosen), "batch_shape": list(chosen[0].src.shape)})
    base = rows[0]["target_tokens_per_s"]
    for row in rows:
        row["vs_sorted"] = row["target_tokens_per_s"] / base
        print(f"{row['peer']:12s} {row['target_tokens_per_s']:9,.0f} target tokens/s "
              f"{row['vs_sorted']:5.2f}x  padding {100 * row['padding']:4.1f}%")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "packing", "max_tokens": args.max_tokens,
                                    "dtype": str(dtype or torch.float32), "rounds": args.rounds,
                                    "steps_per_round": args.steps,
                                    "machine": machine_info(torch.get_num_threads()),
                                    "rows": rows}, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
