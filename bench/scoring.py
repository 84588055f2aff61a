"""Scoring speed (Generator.token_logprobs: each token's log-probability and the likeliest
in its place, what /v1/completions answers evaluation harnesses with) by the tokens a
batch holds, on the CPU: the same sequences and weights, every batch size interleaved.

A language model of a preset's shape (default gpt2's, 124M parameters, 50,257 ids) with
random weights scores --sequences sequences of 20 to 120 random tokens, as decoding
copies run it (packed float32, bfloat16 or int8), in batches of each --batch-tokens
(padding counted). Counted: tokens scored per second of the whole call; the scores of
every batch size are compared with the first's (largest difference).

    python bench/scoring.py [--preset gpt2] [--dtype float32] [--batch-tokens 4096 1024 512 256]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce.config import preset  # noqa: E402
from transduce.decode.token_logprobs import token_logprobs  # noqa: E402
from transduce.model import build_model  # noqa: E402
from transduce.model.packed import decoding_copy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--sequences", type=int, default=96)
    parser.add_argument("--top", type=int, default=1)
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=[4096, 1024, 512, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("bench/results/scoring-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(preset(args.preset)).eval()
    model = decoding_copy(model, getattr(torch, args.dtype), "cpu", in_place=True)
    vocab = model.config.tgt_vocab_size
    rng = random.Random(0)
    sequences = [[rng.randrange(4, vocab) for _ in range(rng.randint(20, 120))]
                 for _ in range(args.sequences)]
    scored: dict[int, list] = {}

    def case(batch_tokens: int):
        def run():
            scored[batch_tokens] = token_logprobs(model, sequences, args.top,
                                                  batch_tokens=batch_tokens)
        return run

    started = time.time()
    times = time_interleaved({b: case(b) for b in args.batch_tokens}, args.repeats)
    tokens = sum(len(s) - 1 for s in sequences)
    first = scored[args.batch_tokens[0]]
    cases = {}
    for batch_tokens, seconds in times.items():
        median = statistics.median(seconds)
        difference = max(abs(a - b) for x, y in zip(first, scored[batch_tokens])
                         for a, b in zip(x.logprobs, y.logprobs))
        cases[str(batch_tokens)] = {"seconds": median, "tokens_per_s": tokens / median,
                                    "all_seconds": seconds,
                                    "largest_difference_from_first": difference}
        print(f"batches of {batch_tokens} tokens: {tokens / median:.0f} tokens/s "
              f"(largest difference {difference:.1e})")
    result = {"machine": machine_info(args.threads),
              "settings": vars(args) | {"out": str(args.out)}, "tokens_scored": tokens,
              "cases": cases, "seconds": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
