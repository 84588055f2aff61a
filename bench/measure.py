"""What every benchmark here shares: interleaved timing, peak memory of one call measured in
a fresh child process, and the machine's description for the JSON results."""

from __future__ import annotations

import contextlib
import json
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Hashable, Iterator

import numpy as np
import torch


@contextlib.contextmanager
def native_kernel_off(module, wanted: bool = True) -> Iterator[None]:
    """Meanwhile (wanted), `module.available()` (one of the native kernels' modules) says
    False, so that its callers take PyTorch's own operators: the peer that times the
    kernel's gain."""
    available = module.available
    if wanted:
        module.available = lambda: False
    try:
        yield
    finally:
        module.available = available


def int8_through_onednn(wanted: bool = True) -> contextlib.AbstractContextManager:
    """Meanwhile (wanted), int8 decoding copies take oneDNN's int8 kernel rather than the
    VNNI kernel, which gives its bits faster (model/int8_vnni.py)."""
    from transduce.model import int8_vnni

    return native_kernel_off(int8_vnni, wanted)


def handed_to_gpu_benchmark(module: str) -> bool:
    """`--device cuda` on the command line runs `module`'s main (the GPU benchmark, beside
    this file) with the other arguments and returns True; `--device cpu` is dropped."""
    if "--device" not in sys.argv:
        return False
    where = sys.argv.index("--device")
    device = sys.argv[where + 1] if where + 1 < len(sys.argv) else ""
    if device not in ("cpu", "cuda"):
        sys.exit(f"--device must be cpu or cuda, got {device!r}")
    rest = sys.argv[1:where] + sys.argv[where + 2:]
    if device == "cpu":
        sys.argv[1:] = rest
        return False
    sys.path.insert(0, str(Path(__file__).parent))
    __import__(module).main(rest)
    return True


def time_interleaved(calls: dict[Hashable, Callable[[], float | None]],
                     repeats: int) -> dict[Hashable, list[float]]:
    """Seconds per call of each case, the cases interleaved within each repeat so that they
    share the machine's state; one warm-up call each first (allocator, thread pool). A
    call that returns a float timed itself (a child process, its start-up left out)."""
    for call in calls.values():
        call()
    times: dict[Hashable, list[float]] = {}
    for _ in range(repeats):
        for key, call in calls.items():
            start = time.perf_counter()
            timed = call()
            elapsed = time.perf_counter() - start
            times.setdefault(key, []).append(timed if isinstance(timed, float) else elapsed)
    return times


def time_keeping_results(calls: dict[Hashable, Callable[[], object]], repeats: int
                         ) -> tuple[dict[Hashable, list[float]], dict[Hashable, object]]:
    """time_interleaved of calls that return what they computed -> (seconds per call,
    each call's last result), so that the peers' outputs can be compared after timing."""
    results: dict[Hashable, object] = {}

    def keeping(key: Hashable, call: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            results[key] = call()
        return run

    times = time_interleaved({key: keeping(key, call) for key, call in calls.items()},
                             repeats)
    return times, results


def ratios_to_ours(peers: dict[str, dict], rate: str) -> dict[str, float]:
    """{"ours / PEER": ours' rate over the peer's} of each other peer, `rate` the key of
    their records compared (a throughput: above 1, ours is faster)."""
    return {f"ours / {name}": peers["ours"][rate] / record[rate]
            for name, record in peers.items() if name != "ours"}


def array_peer_records(times: dict[str, list[float]], outputs: dict[str, np.ndarray],
                       count: int, unit: str, tokens: int) -> dict[str, dict]:
    """Each peer's record: its median seconds, `unit`s (of `count`) and tokens per
    second, every round's seconds, and the largest difference of its output array from
    ours; each printed."""
    peers = {}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        difference = float(np.abs(outputs[name] - outputs["ours"]).max())
        peers[name] = {"seconds": median, f"{unit}_per_s": count / median,
                       "tokens_per_s": tokens / median, "all_seconds": seconds,
                       "largest_difference_from_ours": difference}
        print(f"{name}: {count / median:.2f} {unit}/s, {tokens / median:.0f} tokens/s "
              f"(largest difference from ours {difference:.1e})")
    return peers


def write_peers_result(args, peers: dict[str, dict], rate: str, started: float,
                       settings: dict | None = None, **counts) -> None:
    """A benchmark of peers against ours, written to args.out: the machine, the settings
    (default: every argument), what was counted (`counts`), each peer's record, the
    ratios of their `rate` to ours, and the seconds since `started`."""
    settings = vars(args) if settings is None else settings
    write_result(args.out, {"machine": machine_info(args.threads),
                            "settings": settings | {"out": str(args.out)}, **counts,
                            "peers": peers, "ratios": ratios_to_ours(peers, rate),
                            "seconds": time.time() - started})


def write_result(path: Path, result: dict) -> None:
    """A benchmark's result as indented JSON at `path` (its folder made), said."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def microseconds_per_call(peers: dict[Hashable, Callable], x, calls: int,
                          repeats: int) -> dict[Hashable, float]:
    """Each peer's median microseconds per call on x: `calls` calls a case, the peers
    interleaved over `repeats` rounds (time_interleaved)."""
    def run(peer):
        def case():
            for _ in range(calls):
                peer(x)
        return case

    times = time_interleaved({name: run(peer) for name, peer in peers.items()}, repeats)
    return {name: statistics.median(t) / calls * 1e6 for name, t in times.items()}


def continuous_search(model, ids: list[list[int]], running: int, beam: int
                      ) -> tuple[float, list[list[int]]]:
    """A continuous beam search (decode/continuous.py, the server's) of `ids`, `running`
    sentences at a time, newcomers joining as sentences finish -> sentences per second,
    and each sentence's best tokens in order."""
    from transduce.data.tokenizer import BOS_ID, EOS_ID
    from transduce.decode.continuous import ContinuousBeamSearch
    from transduce.decode.translate import pad_sources

    searcher = ContinuousBeamSearch(model, bos_id=BOS_ID, eos_id=EOS_ID, beam=beam)
    seconds, found = run_joining(
        searcher, len(ids), running,
        lambda joining: searcher.add(pad_sources([ids[i] for i in joining]), joining))
    return len(ids) / seconds, [hypotheses[0].tokens for hypotheses in found]


def run_joining(stream, count: int, running: int, add: Callable[[list[int]], None]
                ) -> tuple[float, list]:
    """Items 0..count-1 through a continuous search or generation (`stream`: .running,
    .step() -> (tag, result) of those done), `running` at a time, newcomers joining as
    others finish (add(their indices), which are their tags) -> seconds, and each
    item's result in order."""
    waiting, found = list(range(count)), {}
    started = time.perf_counter()
    while waiting or stream.running:
        room = running - stream.running
        if room and waiting:
            joining, waiting = waiting[:room], waiting[room:]
            add(joining)
        found.update(stream.step())
    return time.perf_counter() - started, [found[i] for i in range(count)]


def alternating_rates(runs: dict[str, Callable[[], tuple[float, list]]], rounds: int) -> dict:
    """Two runs (each -> a rate and its outputs), each once to warm up, then over
    `rounds` rounds in alternating order -> the rates of each round, their medians, and
    how many outputs of the last round differ between the two."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for run in runs.values():
        run()
    for round_ in range(rounds):
        for name in runs if round_ % 2 == 0 else reversed(list(runs)):
            rate, outputs[name] = runs[name]()
            rates[name].append(round(rate, 1))
    return {"sentences_per_second": rates,
            "medians": {name: statistics.median(r) for name, r in rates.items()},
            "outputs_differing": sum(a != b for a, b in zip(*outputs.values()))}


def added_peak_bytes(warm_up: Callable[[], None], prepare: Callable[[], Callable[[], None]]) -> int:
    """Bytes of resident memory a call adds at its peak, in this process: the high-water
    mark (Linux VmHWM, reset just before the call) minus the resident set once its inputs
    exist. warm_up runs a tiny call first, so that code pages and thread stacks loaded on
    first use are not counted; prepare() allocates the inputs and returns the call."""
    warm_up()
    call = prepare()
    baseline = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the high-water mark to the current resident set
    call()
    return max(0, _status_kib("VmHWM") - baseline) * 1024


def peak_in_child(script: str | Path, case: list[str], threads: int) -> int | None:
    """Run `script --child CASE... --threads N` (whose child mode prints added_peak_bytes)
    in a fresh process -> its answer, or None (with the reason printed) if it failed."""
    result = subprocess.run([sys.executable, str(script), "--child", *case,
                             "--threads", str(threads)], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"  memory of {' '.join(case)} failed: {result.stderr.strip()[-300:]}")
        return None
    return int(result.stdout.strip().splitlines()[-1])


def available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


# The instruction sets the fast paths choose by (one "AMD EPYC" may be a Zen 4 with
# AVX-512, VNNI and bfloat16, or a CPU with AVX2 alone).
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine_info(threads: int) -> dict:
    cpu, flags = "unknown", set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            lines = info.read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines
                    if line.startswith("model name")), cpu)
        flags = next((set(line.split(":", 1)[1].split()) for line in lines
                      if line.startswith("flags")), flags)
        # A virtual machine's model name can be generic ("Intel(R) Xeon(R) Processor"):
        # family and model tell the generation (6/143 Sapphire Rapids, 6/207 Emerald
        # Rapids, 25/17 Zen 4).
        family, model = (next((line.split(":", 1)[1].strip() for line in lines
                               if line.split(":")[0].strip() == key), "?")
                         for key in ("cpu family", "model"))
        cpu = f"{cpu} (family {family}, model {model})"
    return {"cpu": cpu, "cpu_flags": [flag for flag in KERNEL_FLAGS if flag in flags],
            "logical_cpus": os.cpu_count(), "torch_threads": threads,
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "platform": platform.platform(),
            "memory_available_bytes": available_bytes(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def package_version(package: str) -> str | None:
    """An installed package's version from its metadata (None: not installed); some,
    such as xgrammar, have no __version__."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
