"""The main job, end to end on the built-in corpus:

  1. extract the Spanish -> English Bible (data/bible; skipped when already there);
  2. train the shared 8k BPE vocabulary (skipped when already there);
  3. train the `small` preset with the paper's recipe for MINUTES minutes (default 20);
  4. average the last 5 checkpoints, as the paper does;
  5. translate the test split with beam search (beam 4, length penalty 0.6), score it
     with sacreBLEU and chrF, and show a few translations.

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

# Settings for a short CPU budget: the paper's 4000 warmup steps would outlast 20 minutes
# of training on 2 cores (about 1,100 steps of 4,096-token batches).
TRAIN_FLAGS = ["--preset", "small", "--max-tokens", "4096", "--warmup-steps", "500",
               "--save-every", "50", "--keep-last", "5", "--eval-every", "250",
               "--dev-bleu-sentences", "200", "--log-every", "10"]


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
    run("average", str(out), "--last", "5", "--out", str(out / "average"))
    run("plot", str(out))

    run("evaluate", "--model", str(out / "average"), "--data", str(DATA), "--split", "test",
        "--beam", "4")
    translator = load(out / "average")
    test = read_split(DATA, "test")
    print("\nA few test verses:")
    for source, reference in zip(test.source[:5], test.target[:5]):
        output = translator.translate([source])[0]
        print(f"\n  es:  {source}\n  ref: {reference}\n  out: {output}")
    print(f"\nrun directory: {out}")


if __name__ == "__main__":
    main()
