"""Beam search's choice of extensions: the beam step kernel (decode/beam_step.py) against
PyTorch's operators (search.operator_extensions), the same logits and scores,
interleaved, at --threads threads (two by default, as `transduce translate`).

1. One step's choice alone: A sentences x beam 4 rows of --vocab logits (random, the
   same for both). Counted: microseconds per call, the kernel's extensions checked
   equal to the operators' first.
2. With --model RUN --data DIR: a continuous beam search (decode/continuous.py, the
   server's) of the test split's first --lines sentences, --running at a time,
   newcomers joining as sentences finish, the kernel on or off in alternating rounds in
   one process. Counted: sentences per second of each round; the outputs compared.

    python bench/beam_step.py [--model runs/demo/ema --data data/bible]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import (alternating_rates, continuous_search, machine_info,  # noqa: E402
                     microseconds_per_call, native_kernel_off)
from transduce.decode import beam_step  # noqa: E402
from transduce.decode.search import Extensions, operator_extensions  # noqa: E402

BEAM, EOS = 4, 2


def by_kernel(case):
    logits, scores = case
    return Extensions(*beam_step.beam_extensions(logits, scores, BEAM, torch.tensor([EOS])))


def by_operators(case):
    return operator_extensions(*case, BEAM, EOS)


def step_alone(sentences: int, vocab: int, repeats: int) -> dict:
    """Microseconds per choice of A sentences' extensions, kernel and operators."""
    generator = torch.Generator().manual_seed(sentences)
    case = (torch.randn(sentences * BEAM, vocab, generator=generator) * 3,
            -torch.rand(sentences, BEAM, generator=generator) * 10)
    for got, expected in zip(by_kernel(case), by_operators(case)):
        assert torch.equal(got, expected), "the kernel's extensions differ"
    calls = max(5, 2000 // sentences)
    times = microseconds_per_call({"kernel": by_kernel, "operators": by_operators}, case,
                                  calls, repeats)
    return {"sentences": sentences, "vocab": vocab, "microseconds": times,
            "operators_over_kernel": round(times["operators"] / times["kernel"], 2)}


def search_with_and_without(model, ids: list[list[int]], running: int, rounds: int) -> dict:
    """Sentences per second of the continuous search, kernel on and off."""
    def run(kernel: bool) -> tuple[float, list]:
        with native_kernel_off(beam_step, not kernel):
            return continuous_search(model, ids, running, BEAM)

    found = alternating_rates({"kernel": lambda: run(True), "operators": lambda: run(False)},
                              rounds)
    medians = found["medians"]
    return {"lines": len(ids), "running": running, **found,
            "kernel_over_operators": round(medians["kernel"] / medians["operators"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--lines", type=int, default=300)
    parser.add_argument("--running", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" /
                        "beam-step-cpu.json")
    args = parser.parse_args()
    if not beam_step.available():
        sys.exit("the beam step kernel could not be built here (g++ and ninja are needed)")
    torch.set_num_threads(args.threads)
    result = {"machine": machine_info(args.threads), "alone": [], "search": []}
    for sentences in (1, 4, 8, 32):
        row = step_alone(sentences, args.vocab, args.repeats)
        print(json.dumps(row), flush=True)
        result["alone"].append(row)
    if args.model is not None:
        from transduce.data.corpus import read_lines, split_files
        from transduce.decode.translate import Translator

        translator = Translator.load(args.model, dtype=args.dtype)
        ids = translator.encode(read_lines(split_files(args.data, "test")[0])[:args.lines])
        result["model"], result["dtype"] = str(args.model), args.dtype
        for running in args.running:
            row = search_with_and_without(translator.model, ids, running, args.rounds)
            print(json.dumps(row), flush=True)
            result["search"].append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
