"""Decoding speed and quality of a trained model on a corpus split, settings side by side.

For beam 4 and greedy (beam 1) it translates the whole split with our decoder (float32
and bfloat16 autocast) and with the same weights exported to Hugging Face Marian and run
by `generate` (float32), in batches of --batch-sentences lines sorted by length,
interleaving everything over --repeats rounds in one process. It reports sentences/s
(median), the ratio to Hugging Face at the same beam, and sacreBLEU. Writes JSON with the
machine's description.

    python bench/decode.py --model runs/small/average --data data/bible [--split test]

HF's length penalty divides by length^alpha where ours is GNMT's ((5 + |Y|) / 6)^alpha,
so beam-4 outputs can differ slightly (with alpha 0 they are identical, as tests show).
CTranslate2 joins once the export to its format exists.
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
from transduce.data.tokenizer import EOS_ID, PAD_ID, Tokenizer  # noqa: E402
from transduce.decode.translate import Translator  # noqa: E402

SETTINGS = [("ours float32", 4), ("ours bfloat16", 4), ("hf generate", 4),
            ("ours float32", 1), ("ours bfloat16", 1), ("hf generate", 1)]


class HuggingFaceMarian:
    """Our checkpoint exported to Marian, translated with transformers' generate."""

    def __init__(self, model_path: Path, export_dir: Path):
        import warnings

        from transformers import MarianMTModel

        from transduce.export import export_hf

        export_hf(model_path, export_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = MarianMTModel.from_pretrained(export_dir).eval()
        self.tokenizer = Tokenizer(export_dir / "source.spm")

    def translate(self, lines: list[str], beam: int, batch_sentences: int, **_) -> list[str]:
        ids = self.tokenizer.encode(lines)
        batches = Translator._batches(ids, 1 << 30, batch_sentences)
        out = [""] * len(lines)
        for batch in batches:
            width = max(len(ids[i]) for i in batch) + 1
            src = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
            for row, index in enumerate(batch):
                src[row, :len(ids[index])] = torch.tensor(ids[index])
                src[row, len(ids[index])] = EOS_ID
            with torch.inference_mode():
                beam_options = {"length_penalty": 0.6, "early_stopping": True} if beam > 1 else {}
                generated = self.model.generate(
                    input_ids=src, attention_mask=(src != PAD_ID).long(), num_beams=beam,
                    do_sample=False, max_new_tokens=width + 50, **beam_options)
            for row, index in enumerate(batch):
                out[index] = self.tokenizer.decode(generated[row, 1:].tolist())
        return out


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
    import tempfile

    translators = {"ours float32": Translator.load(args.model, dtype="float32"),
                   "ours bfloat16": Translator.load(args.model, dtype="bfloat16"),
                   "hf generate": HuggingFaceMarian(args.model, Path(tempfile.mkdtemp()) / "hf")}
    for translator in translators.values():  # warm-up
        translator.translate(sources[:32], beam=4, batch_sentences=32)
    seconds: dict[tuple[str, int], list[float]] = {}
    bleu: dict[tuple[str, int], float] = {}
    for round_number in range(args.repeats):
        for decoder, beam in SETTINGS:
            start = time.perf_counter()
            hypotheses = translators[decoder].translate(sources, beam=beam,
                                                      batch_sentences=args.batch_sentences,
                                                      batch_tokens=1 << 30)
            seconds.setdefault((decoder, beam), []).append(time.perf_counter() - start)
            bleu[(decoder, beam)] = sacrebleu.corpus_bleu(hypotheses, [references]).score
            print(f"round {round_number + 1}: {decoder}, beam {beam}: "
                  f"{len(sources) / seconds[(decoder, beam)][-1]:.1f} sentences/s", flush=True)

    rows = []
    print(f"\n{'setting':24} {'sentences/s':>12} {'vs hf generate':>15} {'BLEU':>6}")
    for decoder, beam in SETTINGS:
        rate = len(sources) / statistics.median(seconds[(decoder, beam)])
        baseline = len(sources) / statistics.median(seconds[("hf generate", beam)])
        rows.append({"decoder": decoder, "beam": beam, "sentences_per_second": rate,
                     "ratio_to_hf": rate / baseline, "bleu": bleu[(decoder, beam)],
                     "seconds": seconds[(decoder, beam)]})
        print(f"{decoder + ', beam ' + str(beam):24} {rate:>12.1f} {rate / baseline:>14.2f}x "
              f"{bleu[(decoder, beam)]:>6.2f}")
    result = {"benchmark": "decode", "model": str(args.model), "split": args.split,
              "sentences": len(sources), "batch_sentences": args.batch_sentences,
              "machine": machine_info(args.threads), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
