"""Continuous generation's prefill: prompts that join a running batch together, prefilled
in groups of near lengths (decode/continuous_generation.py, length_groups) against one
left-padded pass over all of them (what it did before: PREFILL_SLACK infinite gives
exactly that pass), interleaved in one process, the same prompts and weights.

Scenarios (token ids drawn at random, bos included): one long prompt joining with short
ones, lengths spread evenly between a short and a long one, and prompts of one length
(one group either way). Counted: seconds per `add` of all the scenario's prompts to a
new ContinuousGeneration (construction included alike), and the positions each way
computes (rows x padded width, summed over its passes).

    python bench/prefill.py [--dtype auto] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce.config import preset  # noqa: E402
from transduce.data.tokenizer import Tokenizer  # noqa: E402
from transduce.decode import continuous_generation  # noqa: E402
from transduce.decode.continuous_generation import ContinuousGeneration, \
    length_groups  # noqa: E402
from transduce.decode.generate import Generator  # noqa: E402
from transduce.model import build_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = {"one long among short": [384] + [16] * 15,
             "spread": [16 + round(i * (384 - 16) / 15) for i in range(16)],
             "one length": [64] * 16}


def positions(lengths: list[int], grouped: bool) -> int:
    """Positions a prefill computes: each pass's rows x its longest prompt but one."""
    groups = length_groups([n - 1 for n in lengths]) if grouped else [range(len(lengths))]
    return sum(len(group) * max(lengths[i] - 1 for i in group) for group in groups)


def adding(generator: Generator, prompts: list[list[int]], grouped: bool):
    """A call that adds the prompts to a new generation, prefilled one way or the other."""
    slack = continuous_generation.PREFILL_SLACK if grouped else float("inf")

    def call() -> None:
        saved = continuous_generation.PREFILL_SLACK
        continuous_generation.PREFILL_SLACK = slack
        try:
            ContinuousGeneration(generator).add(prompts, list(range(len(prompts))))
        finally:
            continuous_generation.PREFILL_SLACK = saved
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=Path, default=REPO / "data" / "bible" / "spm.model")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / "prefill-cpu.json")
    args = parser.parse_args()
    tokenizer = Tokenizer(args.vocab)
    torch.manual_seed(0)
    model = build_model(preset("gpt-small", src_vocab_size=tokenizer.vocab_size,
                               tgt_vocab_size=tokenizer.vocab_size)).eval()
    generator = Generator(model, tokenizer, dtype=args.dtype)
    rng = random.Random(0)
    results = []
    for name, lengths in SCENARIOS.items():
        prompts = [[tokenizer.bos_id] + [rng.randrange(4, tokenizer.vocab_size)
                                         for _ in range(n - 1)] for n in lengths]
        times = time_interleaved({way: adding(generator, prompts, way == "grouped")
                                  for way in ("one pass", "grouped")}, args.repeats)
        medians = {way: statistics.median(seconds) for way, seconds in times.items()}
        row = {"scenario": name, "lengths": lengths,
               "passes": len(length_groups([n - 1 for n in lengths])),
               "positions": {way: positions(lengths, way == "grouped") for way in medians},
               "seconds": times, "median_ms": {w: round(1e3 * t, 2) for w, t in medians.items()},
               "speedup": round(medians["one pass"] / medians["grouped"], 2)}
        results.append(row)
        print(f"{name:>22}: one pass {row['median_ms']['one pass']:8.2f} ms "
              f"({row['positions']['one pass']} positions), grouped "
              f"{row['median_ms']['grouped']:8.2f} ms ({row['positions']['grouped']} "
              f"positions, {row['passes']} passes): {row['speedup']}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "continuous generation's prefill, grouped by length vs one pass",
        "model": "gpt-small (random weights), vocabulary " + str(tokenizer.vocab_size),
        "dtype": str(generator.model.decoder.embed.embedding.weight.dtype),
        "dtype_asked": args.dtype, "repeats": args.repeats,
        "prefill_slack": continuous_generation.PREFILL_SLACK,
        "prefill_spare": continuous_generation.PREFILL_SPARE,
        "machine": machine_info(torch.get_num_threads()), "results": results},
        indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
