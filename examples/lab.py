"""The attention lab's experiments on the built-in Bible corpus, one table at a time.

Each row trains a model with the same recipe and budget (or converts one and uptrains
it), averages its last 5 checkpoints, translates the test split (beam 4), and records
test BLEU, chrF, dev perplexity, training tokens/s and decoding sentences/s. Results go
to RUNS/TABLE.json and print as a Markdown table (the tables of docs/experiments.md).

    python examples/lab.py ablations                  # 400 steps a row
    python examples/lab.py architectures --minutes 20  # the 20-minute model comparison
    python examples/lab.py ablations --rows heads-1,heads-8

Runs live in runs/lab-BUDGET/NAME and are shared by every table (the baseline is trained
once); a run or evaluation already there is read back, not redone, so an interrupted
table resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from transduce.cli import main as transduce

ROOT = Path(__file__).resolve().parents[1]

# The small model with the paper's post-norm layout and the recipe these tables were
# measured with (float32, 4,096-token batches, the Noam schedule; --warmup-steps below),
# pinned so that they reproduce whatever the preset's own recipe becomes; rows change one
# thing each.
COMMON = ["--preset", "small", "--no-norm-first", "--max-tokens", "4096", "--schedule", "noam",
          "--ema-decay", "0", "--dtype", "float32",
          "--save-every", "20", "--keep-last", "5", "--eval-every", "100000", "--log-every", "10"]


@dataclass
class Row:
    """A table row: a run (shared by every table row with the same run name) and how its
    model is made: trained with `flags`, or converted from `convert_from` to `kv_heads`
    key/value heads and uptrained 5%."""

    label: str
    run: str
    flags: list[str] = field(default_factory=list)
    convert_from: str = ""
    kv_heads: int = 0
    kv_dtype: str = ""


BASELINE = "baseline"
SPEED_TABLES = ("kv-heads", "kv-dtype")
TABLES: dict[str, list[Row]] = {
    "ablations": [
        Row("baseline: 4 heads, sinusoidal, post-norm, label smoothing 0.1", BASELINE),
        Row("1 head (d_k = 256)", "heads-1", ["--num-heads", "1"]),
        Row("8 heads (d_k = 32)", "heads-8", ["--num-heads", "8"]),
        Row("learned positions", "positions-learned", ["--positional", "learned"]),
        Row("rotary positions", "positions-rotary", ["--positional", "rotary"]),
        Row("pre-norm", "pre-norm", ["--norm-first"]),
        Row("no label smoothing", "no-label-smoothing", ["--label-smoothing", "0"]),
    ],
    "kv-heads": [
        Row("MHA (4 kv heads)", BASELINE),
        Row("GQA-2, converted from MHA + 5% uptraining", "gqa-2-converted",
            convert_from=BASELINE, kv_heads=2),
        Row("MQA, converted from MHA + 5% uptraining", "mqa-converted",
            convert_from=BASELINE, kv_heads=1),
        Row("GQA-2, from scratch", "gqa-2", ["--num-kv-heads", "2"]),
        Row("MQA, from scratch", "mqa", ["--num-kv-heads", "1"]),
    ],
    "kv-dtype": [
        Row("float32 KV cache", BASELINE),
        Row("int8 KV cache (per token and head scales)", BASELINE, kv_dtype="int8"),
        Row("pre-norm model, float32 KV cache", "pre-norm"),
        Row("pre-norm model, int8 KV cache", "pre-norm", kv_dtype="int8"),
    ],
    "attention-types": [
        Row("softmax", BASELINE),
        Row("linear (elu + 1 feature map)", "linear", ["--attention-type", "linear"]),
        Row("sliding window, 16 either side", "sliding-16",
            ["--attention-type", "sliding", "--attention-window", "16"]),
    ],
    "architectures": [
        Row("RNN (bi-GRU) + Bahdanau attention", "rnn-bahdanau", ["--arch", "rnn-bahdanau"]),
        Row("RNN (bi-GRU) + Luong attention", "rnn-luong", ["--arch", "rnn-luong"]),
        Row("Transformer (small)", BASELINE),
    ],
}


def run(*argv: str) -> None:
    print(f"\n$ transduce {' '.join(argv)}", flush=True)
    status = transduce(list(argv))
    if status:
        sys.exit(status)


def training_summary(run_dir: Path) -> dict:
    """Median training tokens/s over the logged windows (the first one, with start-up, left
    out), the steps and seconds the run took, and its final dev perplexity."""
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("event") == "train"]
    dev = [r for r in records if r.get("event") == "dev"]
    return {"steps": train[-1]["step"], "train_seconds": train[-1]["elapsed_s"],
            "train_tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[1:] or train),
            "dev_ppl": dev[-1]["dev_ppl"] if dev else None}


def make_model(row: Row, budget: list[str], data: Path, runs: Path) -> Path:
    """Train (or convert and uptrain) the row's run unless it exists -> its averaged checkpoint."""
    run_dir = runs / row.run
    if not (run_dir / "log.jsonl").is_file():
        if row.convert_from:
            source = make_model(Row(row.convert_from, row.convert_from), budget, data, runs)
            converted = runs / f"{row.run}-init"
            run("convert-kv", str(source), "--kv-heads", str(row.kv_heads), "--out", str(converted))
            run("train", "--data", str(data), "--out", str(run_dir), "--init", str(converted),
                "--save-every", "1", "--keep-last", "5", "--eval-every", "100000")
        else:
            run("train", "--data", str(data), "--out", str(run_dir), *budget, *COMMON, *row.flags)
    if not (run_dir / "average").is_dir():
        run("average", str(run_dir), "--last", "5", "--out", str(run_dir / "average"))
    return run_dir / "average"


def decoding_speed(model_dir: Path, data: Path, kv_dtype: str) -> dict:
    """Sentences/s and output pieces/s of beam 4 at batch 1 (the first 100 test sentences)
    and batch 64 (all), and the self-attention cache's bytes per target token, measured on
    its cache objects."""
    import torch

    from transduce import load
    from transduce.data.corpus import read_split
    from transduce.model.transformer import kv_cache_size

    translator = load(model_dir, kv_dtype=kv_dtype or None)
    sources = read_split(data, "test").source
    speeds = {}
    for batch, lines in ((1, sources[:100]), (64, sources)):
        start = time.perf_counter()
        outputs = translator.translate(lines, beam=4, batch_sentences=batch, batch_tokens=1 << 30)
        seconds = time.perf_counter() - start
        # Models that write longer translations decode fewer sentences per second for that
        # reason alone: output pieces per second separate speed from length.
        pieces = sum(len(ids) + 1 for ids in translator.tokenizer.encode(outputs))  # + eos
        speeds[f"sentences_per_s_batch{batch}"] = len(lines) / seconds
        speeds[f"pieces_per_s_batch{batch}"] = pieces / seconds
    config = translator.model.config
    if config.arch == "transformer":
        dtype = torch.int8 if kv_dtype == "int8" else torch.float32
        speeds["kv_bytes_per_token"] = kv_cache_size(config, 1, 1, dtype)[0] \
            if config.attention_type == "softmax" else None
    return speeds


def run_row(row: Row, budget: list[str], data: Path, runs: Path, speed: bool) -> dict:
    model_dir = make_model(row, budget, data, runs)
    suffix = f"-kv{row.kv_dtype}" if row.kv_dtype else ""
    evaluation = model_dir / f"eval-test-beam4{suffix}.json"
    if not evaluation.is_file():
        run("evaluate", "--model", str(model_dir), "--data", str(data), "--split", "test",
            "--beam", "4", "--batch-sentences", "32",
            *(["--kv-dtype", row.kv_dtype] if row.kv_dtype else []))
    scores = json.loads(evaluation.read_text())
    result = {"row": row.label, "run": row.run, "flags": " ".join(row.flags), "bleu": scores["bleu"],
              "chrf": scores["chrf"], "decode_sentences_per_s": scores["sentences_per_second"],
              **training_summary(runs / row.run)}
    if speed:
        result.update(decoding_speed(model_dir, data, row.kv_dtype))
    return result


def markdown(rows: list[dict]) -> str:
    columns = [("test BLEU", "bleu", "{:.2f}"), ("chrF", "chrf", "{:.1f}"),
               ("dev ppl", "dev_ppl", "{:.1f}"), ("steps", "steps", "{}"),
               ("train tok/s", "train_tokens_per_s", "{:,.0f}"),
               ("decode sent/s (batch 32)", "decode_sentences_per_s", "{:.1f}")]
    if "sentences_per_s_batch1" in rows[0]:
        columns += [("KV bytes/token", "kv_bytes_per_token", "{:,}"),
                    ("batch 1: sent/s", "sentences_per_s_batch1", "{:.1f}"),
                    ("pieces/s", "pieces_per_s_batch1", "{:,.0f}"),
                    ("batch 64: sent/s", "sentences_per_s_batch64", "{:.1f}"),
                    ("pieces/s", "pieces_per_s_batch64", "{:,.0f}")]
    lines = ["| row | " + " | ".join(title for title, _, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for r in rows:
        cells = ["-" if r.get(key) is None else form.format(r[key]) for _, key, form in columns]
        lines.append(f"| {r['row']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", choices=sorted(TABLES))
    parser.add_argument("--minutes", type=float, default=0,
                        help="time budget per row (default: --steps)")
    parser.add_argument("--steps", type=int, default=400, help="step budget per row")
    parser.add_argument("--warmup-steps", type=int, default=250)
    parser.add_argument("--rows", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--speed", action="store_true",
                        help="also time beam 4 at batch 1 and 64 and measure KV bytes per token")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "bible")
    parser.add_argument("--runs", type=Path, default=None, help="default runs/lab-TABLE-BUDGET")
    args = parser.parse_args()

    if not (args.data / "spm.model").is_file():
        run("data", "bible", "--out", str(args.data))
        run("vocab", "--data", str(args.data), "--size", "8000")
    budget = ["--max-minutes", str(args.minutes)] if args.minutes else ["--max-steps", str(args.steps)]
    budget += ["--warmup-steps", str(args.warmup_steps)]
    label = f"{args.minutes:g}min" if args.minutes else f"{args.steps}steps"
    runs = args.runs or ROOT / "runs" / f"lab-{label}"
    wanted = set(filter(None, args.rows.split(",")))
    rows = [run_row(row, budget, args.data, runs, args.speed or args.table in SPEED_TABLES)
            for row in TABLES[args.table] if not wanted or row.run in wanted]
    runs.mkdir(parents=True, exist_ok=True)
    (runs / f"{args.table}.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n" + markdown(rows))


if __name__ == "__main__":
    main()
