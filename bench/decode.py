"""Decoding speed and quality of a trained model on a corpus split, settings side by side.

For beam 4 and greedy (beam 1) it translates the whole split with our decoder (float32,
the bfloat16 copy that `--dtype bfloat16` decodes with, and `--dtype int8`'s copy with
int8 products through the VNNI kernel where it runs, model/int8_vnni.py, and through
oneDNN's, model/int8.py, "ours int8 oneDNN"; "ours int8 operators" chooses beam search's
extensions by PyTorch's operators rather than the beam step kernel, decode/beam_step.py), with the same weights exported to Hugging
Face (Marian for a post-norm model, Pegasus for a pre-norm one) and run by `generate`
(float32), and exported to CTranslate2 (float32 and int8, each run in a child process
that times itself, see CTranslate2Model), and exported to ONNX and run by ONNX Runtime
behind our own searches (float32 and int8 weights, `transduce export onnx`), and ours
(float32, int8) and CTranslate2 float32 with two batches decoded side by side on one
thread each ("2 workers"), all in batches of --batch-sentences lines sorted by length,
interleaving everything over --repeats rounds. It reports sentences/s (median), the
ratios to Hugging Face and to CTranslate2 float32 at the same beam (where they ran: a
format that cannot hold the model is left out), and sacreBLEU. Writes JSON with the
machine's description.

    python bench/decode.py --model runs/small/average --data data/bible [--split test]

HF and CTranslate2 divide by length^alpha where ours is GNMT's ((5 + |Y|) / 6)^alpha, so
beam-4 outputs can differ slightly (greedy outputs are identical, as tests show).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import int8_through_onednn, machine_info, native_kernel_off  # noqa: E402
from transduce.decode import beam_step  # noqa: E402
from transduce.export import ExportError  # noqa: E402
from transduce.runtime import keep_freed_memory  # noqa: E402
from transduce.data.corpus import read_lines, split_files  # noqa: E402
from transduce.data.tokenizer import PAD_ID, Tokenizer  # noqa: E402
from transduce.decode.translate import Translator, length_sorted_batches, pad_sources  # noqa: E402

DECODERS = ("ours float32", "ours bfloat16", "ours int8", "ours int8 oneDNN",
            "ours int8 operators", "ours float32 2 workers", "ours bfloat16 2 workers",
            "ours int8 2 workers", "ours int8 oneDNN 2 workers",
            "ours int8 operators 2 workers", "hf generate", "ct2 float32", "ct2 int8",
            "ct2 float32 2 workers", "ort float32", "ort int8")
# "2 workers": two batches decoded side by side, each on one thread (ours: Translator's
# workers=2; CTranslate2: inter_threads=2, intra_threads=1, two batches in flight).
WORKERS_SUFFIX = " 2 workers"


def sorted_batches(ids: list[list[int]], batch_sentences: int):
    """The batching every decoder here gets: by length, batch_sentences at a time."""
    return length_sorted_batches(ids, 1 << 30, batch_sentences)


class CTranslate2Model:
    """Our checkpoint exported to CTranslate2 (float32 or int8 weights), run in a child
    process: loaded into this one, CTranslate2's thread runtime halves the speed of every
    PyTorch decoder here (128 -> 58 sentences/s, greedy), which would bias the table."""

    def __init__(self, model_path: Path, export_dir: Path, quantization: str | None,
                 threads: int, workers: int = 1):
        from transduce.export import export_ctranslate2

        if not (export_dir / "model.bin").is_file():
            export_ctranslate2(model_path, export_dir, quantization)
        self.export_dir, self.threads, self.workers = export_dir, threads, workers

    def translate(self, lines: list[str], beam: int, batch_sentences: int,
                  **_) -> tuple[list[str], float]:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        result = subprocess.run(
            [sys.executable, __file__, "--ct2-worker", str(self.export_dir), "--input", f.name,
             "--beam", str(beam), "--batch-sentences", str(batch_sentences),
             "--threads", str(self.threads), "--workers", str(self.workers)],
            capture_output=True, text=True, check=True)
        answer = json.loads(result.stdout.splitlines()[-1])
        return answer["hypotheses"], answer["seconds"]


def ct2_worker(args: argparse.Namespace) -> None:
    """Child process: load, warm up, then time the whole input; print JSON."""
    import ctranslate2

    tokenizer = Tokenizer(args.ct2_worker / "spm.model")
    from concurrent.futures import ThreadPoolExecutor

    translator = ctranslate2.Translator(str(args.ct2_worker), device="cpu",
                                        intra_threads=max(1, args.threads // args.workers),
                                        inter_threads=args.workers)
    lines = read_lines(args.input)
    piece = tokenizer.processor.id_to_piece

    def run(subset: list[str]) -> list[str]:
        ids = tokenizer.encode(subset)
        out = [""] * len(subset)

        def one_batch(batch: list[int]) -> None:   # CTranslate2 releases the GIL
            tokens = [[piece(t) for t in ids[i]] for i in batch]   # the export appends eos
            found = translator.translate_batch(
                tokens, beam_size=args.beam, length_penalty=0.6 if args.beam > 1 else 0.0,
                max_decoding_length=max(len(t) for t in tokens) + 50)
            for index, result in zip(batch, found):
                out[index] = tokenizer.processor.decode(result.hypotheses[0])

        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(one_batch, sorted_batches(ids, args.batch_sentences)))
        return out

    run(lines[:args.batch_sentences])  # warm-up
    start = time.perf_counter()
    hypotheses = run(lines)
    print(json.dumps({"seconds": time.perf_counter() - start, "hypotheses": hypotheses}))


class HuggingFaceGenerate:
    """Our checkpoint exported to transformers (Marian or Pegasus), translated with its
    generate."""

    def __init__(self, model_path: Path, export_dir: Path):
        import warnings

        from transformers import AutoModelForSeq2SeqLM

        from transduce.export import export_hf

        export_hf(model_path, export_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = AutoModelForSeq2SeqLM.from_pretrained(export_dir).eval()
        self.tokenizer = Tokenizer(export_dir / "source.spm")

    def translate(self, lines: list[str], beam: int, batch_sentences: int, **_) -> list[str]:
        ids = self.tokenizer.encode(lines)
        out = [""] * len(lines)
        for batch in sorted_batches(ids, batch_sentences):
            src = pad_sources([ids[i] for i in batch])
            width = src.shape[1]
            with torch.inference_mode():
                beam_options = {"length_penalty": 0.6, "early_stopping": True} if beam > 1 else {}
                generated = self.model.generate(
                    input_ids=src, attention_mask=(src != PAD_ID).long(), num_beams=beam,
                    do_sample=False, max_new_tokens=width + 50, **beam_options)
            for row, index in enumerate(batch):
                out[index] = self.tokenizer.decode(generated[row, 1:].tolist())
        return out


class SearchByOperators:
    """A translator whose beam searches choose their extensions by PyTorch's operators."""

    def __init__(self, translator: Translator):
        self.translator = translator

    def translate(self, *args, **kwargs) -> list[str]:
        with native_kernel_off(beam_step):
            return self.translator.translate(*args, **kwargs)


def load_decoder(name: str, model: Path, exports: Path, threads: int):
    """One decoder of the table, its export written under `exports` where it needs one."""
    workers = 2 if name.endswith(WORKERS_SUFFIX) else 1
    name = name.removesuffix(WORKERS_SUFFIX)
    if name.startswith("ours"):
        with int8_through_onednn(name.endswith(" oneDNN")):
            translator = Translator.load(model, dtype=name.split()[1], workers=workers)
        return SearchByOperators(translator) if name.endswith(" operators") else translator
    if name == "hf generate":
        return HuggingFaceGenerate(model, exports / "hf")
    if name.startswith("ct2"):
        quantization = None if name == "ct2 float32" else "int8"
        return CTranslate2Model(model, exports / name.replace(" ", "-"), quantization, threads,
                                workers)
    from transduce.export.onnx import export_onnx

    quantize = None if name == "ort float32" else "int8"
    return Translator.load(export_onnx(model, exports / name.replace(" ", "-"), quantize))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--split", default="test")
    parser.add_argument("--batch-sentences", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lines", type=int, default=0,
                        help="only the split's first N lines (0: all; for --batch-sentences 1)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--decoders", nargs="+", default=list(DECODERS), choices=DECODERS,
                        help="which to run (default: all); the ratios are to hf generate "
                             "and to ct2 float32, where they ran")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "decode-cpu.json")
    parser.add_argument("--ct2-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--beam", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ct2_worker:
        ct2_worker(args)
        return
    torch.set_num_threads(args.threads)
    if args.model is None or args.data is None:
        parser.error("--model and --data are required")
    # What `transduce translate` does for its process (the in-process decoders share it).
    keep_freed_memory()

    source_path, reference_path = split_files(args.data, args.split)
    sources, references = read_lines(source_path), read_lines(reference_path)
    if args.lines:
        sources, references = sources[:args.lines], references[:args.lines]
    exports = Path(tempfile.mkdtemp())
    translators = {}
    for name in (d for d in DECODERS if d in args.decoders):
        try:
            translators[name] = load_decoder(name, args.model, exports, args.threads)
        except ExportError as error:      # a format that cannot hold this model
            print(f"{name}: left out ({error})")
    bases = [d for d in ("hf generate", "ct2 float32") if d in translators]
    settings = [(decoder, beam) for beam in (4, 1) for decoder in translators]
    for name, translator in translators.items():  # warm-up (the worker warms up itself)
        if not name.startswith("ct2"):
            translator.translate(sources[:32], beam=4, batch_sentences=32)
    seconds: dict[tuple[str, int], list[float]] = {}
    bleu: dict[tuple[str, int], float] = {}
    for round_number in range(args.repeats):
        for decoder, beam in settings:
            start = time.perf_counter()
            hypotheses = translators[decoder].translate(sources, beam=beam,
                                                        batch_sentences=args.batch_sentences,
                                                        batch_tokens=1 << 30)
            elapsed = time.perf_counter() - start
            if isinstance(hypotheses, tuple):  # a child process timed itself
                hypotheses, elapsed = hypotheses
            seconds.setdefault((decoder, beam), []).append(elapsed)
            bleu[(decoder, beam)] = sacrebleu.corpus_bleu(hypotheses, [references]).score
            print(f"round {round_number + 1}: {decoder}, beam {beam}: "
                  f"{len(sources) / elapsed:.1f} sentences/s", flush=True)

    rows = []
    print(f"\n{'setting':40} {'sentences/s':>12}" + "".join(f" {'vs ' + b:>15}" for b in bases)
          + f" {'BLEU':>6}")
    for decoder, beam in settings:
        rate = len(sources) / statistics.median(seconds[(decoder, beam)])
        ratios = {b: rate * statistics.median(seconds[(b, beam)]) / len(sources) for b in bases}
        rows.append({"decoder": decoder, "beam": beam, "sentences_per_second": rate,
                     "ratios": ratios, "bleu": bleu[(decoder, beam)],
                     "seconds": seconds[(decoder, beam)]})
        print(f"{decoder + ', beam ' + str(beam):34} {rate:>12.1f}"
              + "".join(f" {ratio:>14.2f}x" for ratio in ratios.values())
              + f" {bleu[(decoder, beam)]:>6.2f}")
    result = {"benchmark": "decode", "model": str(args.model), "split": args.split,
              "sentences": len(sources), "batch_sentences": args.batch_sentences,
              "machine": machine_info(args.threads), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
