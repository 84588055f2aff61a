"""Corpora larger than memory, measured: import and tokenisation throughput, and training's
peak memory on a synthetic corpus of many pairs against the Bible.

    python bench/token_store.py --bible data/bible --pairs 500000 --work /tmp/store-bench

1. Writes --pairs raw pairs (the Bible's training pairs over and over, each copy's
   words rotated so that it is a new pair of the same lengths), gzip-compressed.
2. `transduce data import` of them (lines/s).
3. Tokenisation: the token store with --workers processes against fairseq-preprocess-like
   single-process SentencePiece encoding of the same files (read a line, encode it,
   write its ids as binary), in the same run, interleaved (lines/s).
4. Peak resident memory (the OS's: the child's ru_maxrss) of `transduce train` for
   --steps steps of the tiny preset on the Bible (text path), on the synthetic corpus
   (token store), and on a control: as many synthetic pairs as the Bible has, drawn
   uniformly (seeded) and trained from text, each in a fresh process, --repeats times
   interleaved. The control has the synthetic sentences at the Bible's size, so store /
   control is what the corpus's size costs (with the rotated copies, the synthetic
   sentences have the Bible's lengths, and the control is the Bible's peak too).

Writes a JSON of the figures and the machine to --out (bench/results/token-store-cpu.json).
Steps 1-3's figures are also kept in --work/build.json: `--reuse` measures step 4 again on
the corpus and store an earlier run left in --work, and reports their figures from there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = ("import resource, sys\n"
         "from transduce.cli import main\n"
         "code = main(sys.argv[1:])\n"
         "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
         "sys.exit(code)\n")


def synthesise(bible: Path, pairs: int, work: Path) -> tuple[Path, Path]:
    """The Bible's training pairs over and over, copy c of a pair with its source words
    rotated by c and its target words by c // (source words): a new pair with the same
    words, hence the same pieces per side (SentencePiece marks every word's start
    alike), so the corpus has the Bible's lengths. A pair too short for that many
    distinct rotations repeats, and the import drops the exact duplicates (counted)."""
    source = (bible / "train.es").read_text(encoding="utf-8").splitlines()
    target = (bible / "train.en").read_text(encoding="utf-8").splitlines()
    paths = work / "raw.es.gz", work / "raw.en.gz"
    with gzip.open(paths[0], "wt", encoding="utf-8", compresslevel=1) as s_out, \
            gzip.open(paths[1], "wt", encoding="utf-8", compresslevel=1) as t_out:
        for i in range(pairs):
            copy, row = divmod(i, len(source))
            src, tgt = source[row].split(), target[row].split()
            s_out.write(" ".join(rotated(src, copy)) + "\n")
            t_out.write(" ".join(rotated(tgt, copy // max(len(src), 1))) + "\n")
    return paths


def rotated(words: list[str], by: int) -> list[str]:
    by = by % len(words) if words else 0
    return words[by:] + words[:by]


def baseline_encode(corpus: Path, model: Path) -> int:
    """fairseq-preprocess-like: one process, line by line, ids to a binary file."""
    import numpy as np
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(model))
    count = 0
    for side in ("es", "en"):
        with open(corpus / f"train.{side}", encoding="utf-8") as lines, \
                open(corpus / f"baseline.{side}.bin", "wb") as out:
            for line in lines:
                out.write(np.asarray(processor.encode(line.strip()), dtype=np.uint16).tobytes())
                count += side == "es"
    return count


def control_corpus(corpus: Path, bible: Path, out: Path) -> Path:
    """As many training pairs of `corpus` as `bible` has, drawn uniformly (seed 0), in
    file order, with corpus's vocabulary and dev split: a text corpus."""
    import numpy as np

    size = sum(1 for _ in open(bible / "train.es", "rb"))
    total = sum(1 for _ in open(corpus / "train.es", "rb"))
    keep = np.zeros(total, dtype=bool)
    keep[np.random.default_rng(0).choice(total, size, replace=False)] = True
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for side in ("es", "en"):
        with open(corpus / f"train.{side}", "rb") as lines, \
                open(out / f"train.{side}", "wb") as kept:
            kept.writelines(line for line, chosen in zip(lines, keep) if chosen)
    for name in ("corpus.json", "spm.model", "dev.es", "dev.en"):
        shutil.copy(corpus / name, out / name)
    return out


def train_peak(corpus: Path, out: Path, steps: int) -> tuple[int, str]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run(
        [sys.executable, "-c", TRAIN, "train", "--data", str(corpus), "--out", str(out),
         "--preset", "tiny", "--max-steps", str(steps), "--max-tokens", "4096",
         "--eval-every", "100000", "--save-every", "100000", "--threads", "2"],
        env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stdout + result.stderr)
    kib = int(result.stdout.split("maxrss_kib")[-1].split()[0])
    return kib * 1024, result.stdout


def build(args: argparse.Namespace, corpus: Path) -> dict:
    """Steps 1-3: the synthetic corpus, its import and its token store -> their figures."""
    from transduce.data.importer import import_corpus
    from transduce.data.store import build_store
    from transduce.data.tokenizer import MODEL_NAME, Tokenizer

    figures: dict = {"pairs": args.pairs}
    start = time.perf_counter()
    src, tgt = synthesise(args.bible, args.pairs, args.work)
    figures["synthesis_s"] = time.perf_counter() - start

    start = time.perf_counter()
    result = import_corpus(corpus, "es", "en", src=src, tgt=tgt, dev=1000, progress=False)
    seconds = time.perf_counter() - start
    figures["import"] = {"seconds": seconds, "lines_per_s": args.pairs / seconds,
                         "report": result.report}
    shutil.copy(args.bible / MODEL_NAME, corpus / MODEL_NAME)
    tokenizer = Tokenizer(corpus / MODEL_NAME)

    start = time.perf_counter()
    stored = build_store(corpus, "train", tokenizer.path, tokenizer.vocab_size,
                         tokenizer.fingerprint, workers=args.workers)
    store_s = time.perf_counter() - start
    figures["tokenise"] = {
        "store_workers": args.workers, "store_s": store_s,
        "store_pairs_per_s": stored.pairs / store_s,
        "store_bytes": sum(p.stat().st_size for p in stored.path.iterdir())}
    if not args.skip_baseline:
        start = time.perf_counter()
        baseline_pairs = baseline_encode(corpus, tokenizer.path)
        baseline_s = time.perf_counter() - start
        figures["tokenise"].update(baseline_single_process_s=baseline_s,
                                   baseline_pairs_per_s=baseline_pairs / baseline_s)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bible", type=Path, default=REPO / "data" / "bible")
    parser.add_argument("--pairs", type=int, default=5_000_000)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="training runs of each kind")
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / "token-store-cpu.json")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="no single-process encoding to compare the store's speed with")
    parser.add_argument("--reuse", action="store_true",
                        help="measure training only, on the corpus and store in --work")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO / "bench"))
    import numpy as np
    from measure import machine_info

    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus"
    if args.reuse:
        figures = json.loads((args.work / "build.json").read_text())
        figures["reused_build"] = True
    else:
        figures = build(args, corpus)
        (args.work / "build.json").write_text(json.dumps(figures, indent=2) + "\n")
    figures["machine"] = machine_info(os.cpu_count() or 1)
    figures["command"] = " ".join(["python", "bench/token_store.py", *sys.argv[1:]])
    figures["load_average_before_training"] = os.getloadavg()   # the CPU may be shared
    control = control_corpus(corpus, args.bible, args.work / "control")
    bible_peaks, store_peaks, control_peaks = [], [], []
    for _ in range(args.repeats):          # interleaved, each in a fresh process
        bible_peaks.append(train_peak(args.bible, args.work / "run-bible", args.steps)[0])
        store_peaks.append(train_peak(corpus, args.work / "run-store", args.steps)[0])
        control_peaks.append(train_peak(control, args.work / "run-control", args.steps)[0])
    figures["train_peak_rss"] = {"bible_text_bytes": bible_peaks,
                                 "synthetic_store_bytes": store_peaks,
                                 "control_text_bytes": control_peaks,
                                 "ratio_of_medians": float(np.median(store_peaks)
                                                           / np.median(bible_peaks)),
                                 "ratio_to_control": float(np.median(store_peaks)
                                                           / np.median(control_peaks)),
                                 "steps": args.steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
