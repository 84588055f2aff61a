"""Decoding speed and quality of a trained model on a corpus split, settings side by side.

For beam 4 and greedy (beam 1), float32 and bfloat16 autocast, batches of --batch-sentences
lines (the peers' usual 32), it translates the whole split, interleaving the settings over
--repeats rounds in one process, and reports sentences/s (median), the ratio to float32
beam 4, and sacreBLEU. Writes JSON with the machine's description.

    python bench/decode.py --model runs/small/average --data data/bible [--split test]

Peers (Hugging Face generate, CTranslate2) join this table once checkpoints can be
exported to their format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import machine_info  # noqa: E402
from transduce.data.corpus import read_lines, split_files  # noqa: E402
from transduce.decode.translate import Translator  # noqa: E402

SETTINGS = [("float32", 4), ("bfloat16", 4), ("float32", 1), ("bfloat16", 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--batch-sentences", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "decode-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    source_path, reference_path = split_files(args.data, args.split)
    sources, references = read_lines(source_path), read_lines(reference_path)
    translators = {dtype: Translator.load(args.model, dtype=dtype) for dtype in ("float32", "bfloat16")}
    translators["float32"].translate(sources[:32], beam=4)  # warm-up
    seconds: dict[tuple[str, int], list[float]] = {}
    bleu: dict[tuple[str, int], float] = {}
    for round_number in range(args.repeats):
        for dtype, beam in SETTINGS:
            start = time.perf_counter()
            hypotheses = translators[dtype].translate(sources, beam=beam,
                                                      batch_sentences=args.batch_sentences,
                                                      batch_tokens=1 << 30)
            seconds.setdefault((dtype, beam), []).append(time.perf_counter() - start)
            bleu[(dtype, beam)] = sacrebleu.corpus_bleu(hypotheses, [references]).score
            print(f"round {round_number + 1}: {dtype} beam {beam}: "
                  f"{len(sources) / seconds[(dtype, beam)][-1]:.1f} sentences/s", flush=True)

    baseline = len(sources) / statistics.median(seconds[("float32", 4)])
    rows = []
    print(f"\n{'setting':22} {'sentences/s':>12} {'vs fp32 beam 4':>15} {'BLEU':>6}")
    for dtype, beam in SETTINGS:
        rate = len(sources) / statistics.median(seconds[(dtype, beam)])
        rows.append({"dtype": dtype, "beam": beam, "sentences_per_second": rate,
                     "ratio": rate / baseline, "bleu": bleu[(dtype, beam)],
                     "seconds": seconds[(dtype, beam)]})
        print(f"{dtype + ' beam ' + str(beam):22} {rate:>12.1f} {rate / baseline:>14.2f}x "
              f"{bleu[(dtype, beam)]:>6.2f}")
    result = {"benchmark": "decode", "model": str(args.model), "split": args.split,
              "sentences": len(sources), "batch_sentences": args.batch_sentences,
              "machine": machine_info(args.threads), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
