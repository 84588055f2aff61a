"""Loading a checkpoint: the seconds `load_model` takes and the memory it needs, against
the way it loaded before (build_model with its random initialisation, then safetensors'
load_model, which reads the whole file before copying it in, then isfinite on every
element) and, for the NLLB shapes, transformers' from_pretrained of the same model.

Shapes, all with random weights in float32:

    base       the paper's base model, 37,000 shared ids (63M parameters)
    big        the paper's big model, 37,000 shared ids (214M)
    nllb-600m  bench/nllb.py's random NLLB-200-distilled-600M (615M), our import of it,
               and its Hugging Face directory for transformers
    nllb-3.3b  the same at nllb-200-3.3B's sizes (3.3B; 13 GB in float32; not run
               unless named: it writes 26 GB)

The import that writes an NLLB checkpoint is measured the same way, once, when the run
makes it. The way of loading before is not run where two copies of the weights would
not fit in the memory available.

Every load runs in a fresh child process, which times the load alone (perf_counter)
and samples its anonymous resident memory (RssAnon, which leaves out the pages of the
file the page cache maps in) and its whole resident memory (VmRSS) every 2 ms from a
thread; each figure is the peak less the value just before the load. The peers
alternate within each round, after one warm-up round that brings the files into the
page cache. The children also report the sum of every weight, checked equal across our
two ways. Writes JSON with the machine's description.

    python bench/load.py [--work DIR] [--repeats 3] [--shapes base big nllb-600m nllb-3.3b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info  # noqa: E402

SHAPES = ("base", "big", "nllb-600m", "nllb-3.3b")
PEERS = ("ours", "random init, then read", "transformers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES[:3]), choices=SHAPES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None,
                        help="where the checkpoints are written and kept between runs")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "load-cpu.json")
    parser.add_argument("--child", nargs="+", metavar="PEER DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    with tempfile.TemporaryDirectory() as scratch:
        run(args, args.work or Path(scratch))


def run(args: argparse.Namespace, work: Path) -> None:
    import torch

    results = {"machine": machine_info(torch.get_num_threads()), "repeats": args.repeats,
               "method": "median of the rounds; each load in a fresh process; the peaks "
                         "of anonymous and of all resident memory (anonymous + file pages "
                         "mapped) that the load added", "shapes": {}}
    cases = {}          # (shape, peer) -> the directory the child loads
    for shape in args.shapes:
        ours, hf, imported = prepared(shape, work)
        entry = results["shapes"][shape] = {"import": imported} if imported else {}
        cases[shape, "ours"] = ours
        if fits_twice(ours):
            cases[shape, "random init, then read"] = ours
        else:
            entry["random init, then read"] = "not run: two copies of the weights would " \
                                              "not fit in the memory available"
        if hf is not None:
            cases[shape, "transformers"] = hf
    for (shape, peer), reports in rounds(cases, args.repeats).items():
        entry = results["shapes"][shape]
        if peer == "ours":
            entry["parameters"] = reports[0]["parameters"]
        entry[peer] = {"seconds": statistics.median(r["seconds"] for r in reports),
                       **{f"{kind}_gib": statistics.median(r[kind] for r in reports) / 2**30
                          for kind in ("peak_anonymous", "peak_resident")},
                       "weight_sum": reports[0]["weight_sum"]}
    for shape, entry in results["shapes"].items():
        ours, before = entry["ours"], entry["random init, then read"]
        if isinstance(before, dict):
            assert ours["weight_sum"] == before["weight_sum"], f"{shape}: the loads differ"
            entry["speedup_over_before"] = before["seconds"] / ours["seconds"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def rounds(cases: dict[tuple[str, str], Path], repeats: int) -> dict[tuple[str, str], list]:
    """Each case's reports, the cases alternating within each round; the first round
    (not kept) brings the files into the page cache."""
    runs: dict[tuple[str, str], list[dict]] = {case: [] for case in cases}
    for round_ in range(repeats + 1):
        for (shape, peer), directory in cases.items():
            report = in_child(peer, directory)
            print(f"round {round_} {shape:10s} {peer:24s} {describe(report)}")
            if round_:
                runs[shape, peer].append(report)
    return runs


def describe(report: dict) -> str:
    return (f"{report['seconds']:6.2f} s, peak anonymous "
            f"{report['peak_anonymous'] / 2**30:5.2f} GiB, resident "
            f"{report['peak_resident'] / 2**30:5.2f} GiB")


def fits_twice(directory: Path) -> bool:
    """Whether the way of loading before (a random model, then the whole file read)
    has room: two copies of the weights, and a fifth more."""
    from measure import available_bytes
    return 2.2 * (directory / "model.safetensors").stat().st_size < available_bytes()


def prepared(shape: str, work: Path) -> tuple[Path, Path | None, dict | None]:
    """Our checkpoint of `shape` under `work` (kept between runs), the Hugging Face
    directory of the same model where there is one, and the report of the import that
    wrote ours, when this run made it."""
    if shape.startswith("nllb"):
        from nllb import SHAPE, SHAPE_3B, prepared_hf

        hf = prepared_hf(work / shape, SHAPE_3B if shape == "nllb-3.3b" else SHAPE)
        ours, imported = work / shape / "ours", None
        if not (ours / "config.json").is_file():
            imported = {f"{key}_gib" if key.startswith("peak") else key:
                        value / 2**30 if key.startswith("peak") else value
                        for key, value in in_child("import hf-nllb", hf, ours).items()}
            print(f"import of {shape}: {imported}")
        return ours, hf, imported
    return base_or_big(shape, work), None, None


def base_or_big(shape: str, work: Path) -> Path:
    """The paper's preset `shape` with random weights, as our checkpoint."""
    import torch

    from transduce import checkpoint
    from transduce.config import preset
    from transduce.model import build_model

    directory = work / shape
    if not (directory / checkpoint.CONFIG).is_file():
        tokenizer = small_tokenizer(work)
        torch.manual_seed(0)
        model = build_model(preset(shape, src_vocab_size=37000, tgt_vocab_size=37000))
        checkpoint.save(directory, model, None, tokenizer)
    return directory


def small_tokenizer(work: Path) -> Path:
    """A small SentencePiece model for the checkpoints to carry: loading a model reads
    its configuration and weights only."""
    import sentencepiece

    prefix = work / "spm"
    if not prefix.with_suffix(".model").is_file():
        work.mkdir(parents=True, exist_ok=True)
        lines = [f"line {i} of words {i * 7 % 13} and {i * 11 % 17}" for i in range(200)]
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines),
                                                 model_prefix=str(prefix), vocab_size=40,
                                                 minloglevel=2)
    return prefix.with_suffix(".model")


def in_child(peer: str, *paths: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", peer, *map(str, paths)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{peer} on {paths[0]} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(peer: str, *paths: str) -> None:
    """Run `peer` on `paths`, timed and its memory sampled; print the report."""
    import torch

    sampler = PeakMemory()
    start = time.perf_counter()
    model = LOADS[peer](*map(Path, paths))
    seconds = time.perf_counter() - start
    anonymous, resident = sampler.stop()
    if model is None:                                          # the import
        print(json.dumps({"seconds": seconds, "peak_anonymous": anonymous,
                          "peak_resident": resident}))
        return
    with torch.no_grad():
        weights = {id(p): p for p in model.parameters()}.values()
        total = float(sum(p.double().sum() for p in weights))
    print(json.dumps({"seconds": seconds, "peak_anonymous": anonymous,
                      "peak_resident": resident, "weight_sum": total,
                      "parameters": sum(p.numel() for p in weights)}))


def load_ours(directory: Path):
    from transduce.model import load_model
    return load_model(directory)


def load_as_before(directory: Path):
    """The load this project did before empty_model and the streamed read."""
    import torch
    from safetensors.torch import load_model as safetensors_load

    from transduce import checkpoint
    from transduce.model import build_model

    model = build_model(checkpoint.read_configs(directory)[0])
    missing, unexpected = safetensors_load(model, str(directory / checkpoint.WEIGHTS),
                                           strict=False)
    assert not missing and not unexpected
    finite = [torch.isfinite(weight).all() for weight in model.parameters()]
    assert bool(torch.stack(finite).all())
    return model.eval()


def load_transformers(directory: Path):
    from transformers import AutoModelForSeq2SeqLM
    return AutoModelForSeq2SeqLM.from_pretrained(directory, dtype="float32").eval()


def import_nllb(hf_dir: Path, out: Path) -> None:
    from transduce.importers import import_nllb as ours
    ours(hf_dir, out)


LOADS = {"ours": load_ours, "random init, then read": load_as_before,
         "transformers": load_transformers, "import hf-nllb": import_nllb}


class PeakMemory:
    """The highest RssAnon and VmRSS, each less its value at start, sampled every 2 ms by
    a thread. A model whose weights stay mapped from the file (transformers') shows in
    the second, not the first."""

    def __init__(self):
        self.baseline = self.peak = resident_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.peak = tuple(map(max, self.peak, resident_bytes()))
            time.sleep(0.002)

    def stop(self) -> tuple[int, int]:
        self.running = False
        self.thread.join()
        peak = map(max, self.peak, resident_bytes())
        return tuple(high - low for high, low in zip(peak, self.baseline))


def resident_bytes() -> tuple[int, int]:
    """(RssAnon, VmRSS) of this process."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "VmRSS:")):
                found[line.split(":")[0]] = int(line.split()[1]) * 1024
    return found["RssAnon"], found["VmRSS"]


if __name__ == "__main__":
    main()
