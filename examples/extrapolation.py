"""Length extrapolation: train on short verses only, translate longer ones.

Each position kind (sinusoidal, learned, rotary, T5's bias, ALiBi) trains the `small`
preset on the pairs of at most --max-len pieces (`transduce train --max-len`), the same
steps and seed for all. Then each translates, greedily, the test verses and pairs of
consecutive test verses joined (inputs up to twice the longest verse), with beam search
(--beam, 1 = greedy), and sacreBLEU is computed per bucket of source length in pieces:
the first bucket is the trained range, the others lie beyond it. --plot draws BLEU
against the bucket, one line per position kind.

    python examples/extrapolation.py --data data/bible --runs runs/extrapolation \
        [--steps 400] [--beam 4] [--plot docs/figures/extrapolation.png] [--reference RUN]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import sacrebleu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from transduce.data.corpus import read_lines  # noqa: E402
from transduce.decode.translate import Translator  # noqa: E402

KINDS = ["sinusoidal", "learned", "rotary", "t5", "alibi"]


def train(kind: str, args) -> Path:
    run = args.runs / kind
    if not (run / "ema").is_dir():
        subprocess.run([sys.executable, "-m", "transduce", "train", "--data", str(args.data),
                        "--out", str(run), "--preset", "small", "--positional", kind,
                        "--max-len", str(args.max_len), "--max-steps", str(args.steps),
                        "--max-tokens", "2048", "--eval-every", str(args.steps),
                        "--save-every", str(args.steps)], check=True)
    return run / "ema"


def test_inputs(data: Path) -> tuple[list[str], list[str]]:
    """The test verses, then consecutive pairs of them joined: (sources, references)."""
    src, ref = read_lines(data / "test.es"), read_lines(data / "test.en")
    pairs_src = [f"{a} {b}" for a, b in zip(src[0::2], src[1::2])]
    pairs_ref = [f"{a} {b}" for a, b in zip(ref[0::2], ref[1::2])]
    return src + pairs_src, ref + pairs_ref


def buckets(max_len: int) -> list[tuple[int, int]]:
    return [(1, max_len), (max_len + 1, 2 * max_len), (2 * max_len + 1, 3 * max_len),
            (3 * max_len + 1, 10 ** 6)]


def bucket_bleu(translator: Translator, sources: list[str], references: list[str],
                max_len: int, beam: int) -> dict[str, dict]:
    lengths = [len(ids) for ids in translator.tokenizer.encode(sources)]
    hypotheses = translator.translate(sources, beam=beam)
    result = {}
    for low, high in buckets(max_len):
        chosen = [i for i, n in enumerate(lengths) if low <= n <= high]
        if not chosen:
            continue
        bleu = sacrebleu.corpus_bleu([hypotheses[i] for i in chosen],
                                     [[references[i] for i in chosen]])
        result[f"{low}-{high if high < 10 ** 6 else ''}"] = {"sentences": len(chosen),
                                                              "bleu": round(bleu.score, 2)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--runs", type=Path, default=Path("runs/extrapolation"))
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--plot", type=Path, help="where to draw the figure (PNG)")
    parser.add_argument("--reference", type=Path,
                        help="a model trained on every length, scored alike: how much of the "
                             "fall with length is the longer inputs' difficulty")
    args = parser.parse_args()
    sources, references = test_inputs(args.data)
    table = {}
    models = {kind: train(kind, args) for kind in args.kinds}
    if args.reference:
        models["all lengths (reference)"] = args.reference
    for kind, model in models.items():
        table[kind] = bucket_bleu(Translator.load(model), sources, references, args.max_len,
                                  args.beam)
        print(kind, json.dumps(table[kind]), flush=True)
    columns = list(next(iter(table.values())))
    print(f"\n| positions | " + " | ".join(f"{c} pieces" for c in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for kind, row in table.items():
        print(f"| {kind} | " + " | ".join(f"{row[c]['bleu']:.2f}" if c in row else "-"
                                          for c in columns) + " |")
    print("sentences per bucket: " + ", ".join(f"{c}: {row[c]['sentences']}"
                                               for c, row in [(c, next(iter(table.values())))
                                                              for c in columns]))
    (args.runs / "extrapolation.json").write_text(json.dumps(table, indent=2) + "\n")
    if args.plot:
        plot(table, args)


def plot(table: dict[str, dict], args) -> None:
    """BLEU by source-length bucket, one line per position kind; the trained range shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = list(next(iter(table.values())))
    figure, axes = plt.subplots(figsize=(6.4, 4))
    axes.axvspan(-0.4, 0.4, color="0.9", label=f"trained (<= {args.max_len} pieces)")
    for kind, row in table.items():
        axes.plot(range(len(columns)), [row.get(c, {}).get("bleu") for c in columns],
                  marker="o", label=kind, linestyle="--" if "reference" in kind else "-",
                  color="0.4" if "reference" in kind else None)
    axes.set_xticks(range(len(columns)), [f"{c} pieces" for c in columns])
    axes.set_ylabel(f"test BLEU (beam {args.beam})")
    axes.set_title(f"Length extrapolation: {args.steps} steps on sources <= {args.max_len} pieces")
    axes.legend()
    figure.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.plot, dpi=120)
    plt.close(figure)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
