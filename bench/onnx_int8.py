"""The int8 ONNX export (`export onnx --quantize int8`), whose tied embedding table is
quantized once by the export (export/onnx_int8_tables.py), against ONNX Runtime's
quantizer alone (`quantize_dynamic` on each graph of the float32 export, per channel,
7-bit weights as the export's own call: what the export wrote before, and what one gets
running the quantizer on a float export), on the same random weights. (The results in
bench/results/onnx-int8-cpu-xeon.json predate the 7 bits: both sides had 8.)

Shapes (random float32 weights, tied embeddings):

    gpt2       GPT-2 small's shape (124M parameters, 50,257 ids): decoder.onnx; a call is
               a 64-token prompt on 4 rows, then 16 one-token steps
    nllb-600m  NLLB-200-distilled-600M's shape (615M, 256,206 ids) in our pre-norm
               Transformer: encoder.onnx + decoder_step.onnx; a call is 8 sources of 24
               tokens, then 16 one-token steps on 4 beams each (32 rows)

For each: the bytes on disk; the resident memory a process holds with the sessions open
after one call, less the interpreter's before loading, in all (VmRSS) and split into
anonymous memory (RssAnon) and pages of the files mapped (RssFile: page cache the
system can reclaim; pages two sessions map are counted twice), the median of three
fresh processes, one after the other; the seconds of a call, the peers interleaved
within each of --repeats rounds after a warm-up, median; and how far each int8
export's logits are from the float32 export's on that call's inputs (the root mean
square of the difference over every step's logits / that of the float32 logits).
Writes JSON with the machine's description.

    python bench/onnx_int8.py [--shapes gpt2 nllb-600m] [--repeats 5] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import small_tokenizer  # noqa: E402
from measure import machine_info, time_interleaved  # noqa: E402

SHAPES = {
    "gpt2": ("gpt2", {}),
    "nllb-600m": ("big", dict(src_vocab_size=256206, tgt_vocab_size=256206, d_model=1024,
                              num_heads=16, d_ff=4096, num_encoder_layers=12,
                              num_decoder_layers=12, norm_first=True, dropout=0.0)),
}
PEERS = ("float32", "int8, tables once", "int8, quantizer alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=None,
                        help="where the checkpoints and exports are written and kept "
                             "(those found there are reused: remove them after changing "
                             "the export)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "onnx-int8-cpu.json")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    with tempfile.TemporaryDirectory() as scratch:
        run(args, args.work or Path(scratch))


def run(args: argparse.Namespace, work: Path) -> None:
    import torch

    results = {"machine": machine_info(torch.get_num_threads()), "repeats": args.repeats,
               "method": "median seconds of a call, the peers interleaved in each round; "
                         "resident memory (VmRSS, RssAnon, RssFile) with the sessions "
                         "open after one call, the median of 3 fresh processes; "
                         "logit_error: the root mean square of the logits' difference "
                         "from float32's over every step / that of float32's logits",
               "shapes": {}}
    for shape in args.shapes:
        exports = prepared(shape, work)
        engines = {peer: engine_of(path) for peer, path in exports.items()}
        calls = {peer: lambda engine=engine: one_call(engine) for peer, engine in engines.items()}
        times = time_interleaved(calls, args.repeats)
        reference = every_step(engines["float32"])
        entry = results["shapes"][shape] = {}
        for peer, path in exports.items():
            logits = every_step(engines[peer])
            entry[peer] = {
                "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
                "files": {f.name: f.stat().st_size for f in sorted(path.iterdir())
                          if f.suffix in (".onnx", ".data")},
                "seconds": statistics.median(times[peer]),
                "all_seconds": times[peer],
                "resident_bytes": resident_in_child(path),   # VmRSS, RssAnon, RssFile
                "logit_error": float((logits - reference).square().mean().sqrt()
                                     / reference.square().mean().sqrt()),
            }
            print(shape, peer, json.dumps(entry[peer]))
        del engines
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


def prepared(shape: str, work: Path) -> dict[str, Path]:
    """The float32 export of `shape`'s random model, its int8 export, and the float32
    export's graphs quantized by ONNX Runtime's quantizer alone (kept under `work`)."""
    import torch

    from transduce import checkpoint
    from transduce.config import preset
    from transduce.export.onnx import export_onnx
    from transduce.model import build_model

    directory = work / shape
    model_path = directory / "checkpoint"
    if not (model_path / checkpoint.CONFIG).is_file():
        name, changes = SHAPES[shape]
        torch.manual_seed(0)
        model = build_model(preset(name, **changes))
        checkpoint.save(model_path, model, None, small_tokenizer(work))
        del model
    exports = {"float32": directory / "float32", "int8, tables once": directory / "int8",
               "int8, quantizer alone": directory / "int8-quantizer"}
    for peer, quantize in (("float32", None), ("int8, tables once", "int8")):
        if not exports[peer].is_dir():
            export_onnx(model_path, exports[peer], quantize)
    if not exports["int8, quantizer alone"].is_dir():
        quantizer_alone(exports["float32"], exports["int8, quantizer alone"])
    return exports


def quantizer_alone(float_export: Path, out: Path) -> None:
    """Each graph of the float32 export through quantize_dynamic (int8 weights per
    channel, as the export's own call), everything else copied."""
    import shutil

    from onnxruntime.quantization import QuantType, quantize_dynamic

    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(float_export, scratch, ignore=shutil.ignore_patterns("*.onnx", "*.data"))
    for graph in float_export.glob("*.onnx"):
        quantize_dynamic(str(graph), str(scratch / graph.name), weight_type=QuantType.QInt8,
                         per_channel=True, reduce_range=True)
    info = json.loads((scratch / "onnx.json").read_text(encoding="utf-8"))
    (scratch / "onnx.json").write_text(json.dumps({**info, "quantize": "int8"}) + "\n",
                                       encoding="utf-8")
    scratch.rename(out)


def engine_of(path: Path):
    from transduce.decode.onnx_engine import OnnxEngine
    from transduce.decode.onnx_lm_engine import OnnxLanguageModel

    graphs = json.loads((path / "onnx.json").read_text(encoding="utf-8"))["graphs"]
    return OnnxLanguageModel(path) if graphs == ["decoder.onnx"] else OnnxEngine(path)


def every_step(engine):
    """one_call's logits at every step, (steps, R, 1, V)."""
    import torch

    steps = []
    one_call(engine, steps)
    return torch.stack(steps)


def one_call(engine, steps: list | None = None):
    """The shape's call (the module's docstring) on fixed inputs; each step's logits
    are appended to `steps` when given."""
    import torch

    from transduce.decode.onnx_engine import OnnxEngine

    generator = torch.Generator().manual_seed(0)
    vocabulary = engine.config.tgt_vocab_size
    if isinstance(engine, OnnxEngine):
        sources, rows = torch.randint(4, vocabulary, (8, 24), generator=generator), 32
        state = engine.prefill(sources, 64)
        state.reorder(torch.arange(8).repeat_interleave(4))
    else:
        prompt, rows = torch.randint(4, vocabulary, (4, 64), generator=generator), 4
        state = engine.prefill(prompt, 96)
    for _ in range(16):
        logits = engine.decode_step(
            torch.randint(4, vocabulary, (rows, 1), generator=generator), state)
        if steps is not None:
            steps.append(logits)


RESIDENT = ("VmRSS", "RssAnon", "RssFile")


def resident_in_child(path: Path, processes: int = 3) -> dict[str, int]:
    """Each of RESIDENT's bytes, the median over `processes` fresh processes (what the
    allocators keep varies)."""
    runs = [json.loads(subprocess.run([sys.executable, __file__, "--child", str(path)],
                                      check=True, capture_output=True,
                                      text=True).stdout.splitlines()[-1])
            for _ in range(processes)]
    return {field: int(statistics.median(run[field] for run in runs)) for field in RESIDENT}


def child(path: Path) -> None:
    """Print the resident bytes the export's sessions hold after one call, as JSON."""
    def resident() -> dict[str, int]:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status)
        return {field: int(fields[field].split()[0]) * 1024 for field in RESIDENT}

    import transduce.decode.onnx_engine  # noqa: F401  (the libraries, before the baseline)
    import transduce.decode.onnx_lm_engine  # noqa: F401

    before = resident()
    engine = engine_of(path)
    one_call(engine)
    after = resident()
    print(json.dumps({field: after[field] - before[field] for field in RESIDENT}))


if __name__ == "__main__":
    main()
