"""The main job, end to end on the built-in corpus:

  1. extract the Spanish -> English Bible (data/bible; skipped when already there);
  2. train the shared 8k BPE vocabulary (skipped when already there);
  3. train the `small` preset with its budget recipe for MINUTES minutes (default 20):
     pre-norm, 2,048-token batches, bfloat16 where the CPU has bfloat16 units, a rate
     that warms up over the first 30% of the budget and decays to 0 at its end, and a
     moving average of the weights (docs/experiments.md, "A budget recipe");
  4. translate the test split with the moving average of the weights, beam search (beam
     4, length penalty 0.6), score it with sacreBLEU and chrF, and show a few
     translations.

    MINUTES=5 python examples/demo.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from transduce import load
from transduce.cli import main as transduce
from transduce.data.corpus import read_split
from transduce.data.tokenizer import MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "bible"

# The preset brings its training recipe (config.TRAIN_RECIPES); these flags only set how
# often the run reports. Dev BLEU on 200 verses every 500 steps draws the run's curve
# (`transduce plot`) at a few seconds each; the budget counts them.
TRAIN_FLAGS = ["--preset", "small", "--save-every", "500", "--keep-last", "2",
               "--eval-every", "500", "--dev-bleu-sentences", "200", "--log-every", "20"]


def run(*argv: str) -> None:
    print(f"\n$ transduce {' '.join(argv)}", flush=True)
    status = transduce(list(argv))
    if status:
        sys.exit(status)


def main() -> None:
    minutes = os.environ.get("MINUTES", "20")
    if not (DATA / "corpus.json").is_file():
        run("data", "bible", "--out", str(DATA))
    else:
        print(f"corpus already in {DATA}")
    if not (DATA / MODEL_NAME).is_file():
        run("vocab", "--data", str(DATA), "--size", "8000")
    else:
        print(f"vocabulary already in {DATA / MODEL_NAME}")

    out = ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")
    run("train", "--data", str(DATA), "--out", str(out), "--max-minutes", minutes, *TRAIN_FLAGS)
    run("plot", str(out))

    run("evaluate", "--model", str(out / "ema"), "--data", str(DATA), "--split", "test",
        "--beam", "4")
    translator = load(out / "ema")
    test = read_split(DATA, "test")
    print("\nA few test verses:")
    for source, reference in zip(test.source[:5], test.target[:5]):
        output = translator.translate([source])[0]
        print(f"\n  es:  {source}\n  ref: {reference}\n  out: {output}")
    print(f"\nrun directory: {out}")


if __name__ == "__main__":
    main()
