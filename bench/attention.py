"""Attention kernels side by side: naive, PyTorch SDPA and our tiled flash kernel.

For each sequence length T (self-attention, B=1, H=8, D=64, float32 on the CPU) it times
the forward pass (no grad) and forward + backward, the kernels interleaved in one process
so that they share the machine's state, and reports ratios to SDPA. Peak memory is
measured in a fresh child process per case: the resident-set high-water mark (Linux
VmHWM, reset just before the call) minus the resident set with the inputs allocated.
A case whose estimated memory would not fit in this machine's free memory is not run
and is reported as skipped, with the estimate.

    python bench/attention.py [--lengths 256 1024 4096 16384] [--out bench/results/attention-cpu.json]
    python bench/attention.py --device cuda [...]   # the GPU benchmark: bench/attention_cuda.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from measure import (added_peak_bytes, available_bytes, format_bytes,  # noqa: E402
                     handed_to_gpu_benchmark, machine_info, peak_in_child, time_interleaved)
from transduce.attention import attention  # noqa: E402
from transduce.config import AttentionImpl, choices  # noqa: E402

IMPLS = [impl for impl in choices(AttentionImpl) if impl != "triton"]  # triton: --device cuda
MODES = ("forward", "forward+backward")
HEADS, HEAD_DIM, BATCH = 8, 64, 1


def make_inputs(length: int, requires_grad: bool):
    shape = (BATCH, HEADS, length, HEAD_DIM)
    return [torch.randn(shape, requires_grad=requires_grad) for _ in range(3)]


def run_once(impl: str, mode: str, inputs) -> None:
    q, k, v = inputs
    if mode == "forward":
        with torch.no_grad():
            attention(q, k, v, impl=impl)
    else:
        out = attention(q, k, v, impl=impl)
        out.backward(torch.ones_like(out))
        for x in inputs:
            x.grad = None


def estimated_bytes(impl: str, mode: str, length: int) -> int:
    """A rough upper bound used only to decide whether a case can run here: naive holds
    about 2 (forward) or 4 (backward) T x T score matrices per head."""
    io = 8 * BATCH * HEADS * length * HEAD_DIM * 4
    if impl != "naive":
        return io
    return io + (2 if mode == "forward" else 4) * BATCH * HEADS * length * length * 4


def fits(impl: str, mode: str, length: int) -> bool:
    return estimated_bytes(impl, mode, length) < 0.75 * available_bytes()


def measure_peak_in_this_process(impl: str, mode: str, length: int) -> int:
    """Child-process entry: bytes of resident memory the call adds at its peak."""
    torch.manual_seed(0)
    grad = mode != "forward"

    def prepare():
        inputs = make_inputs(length, grad)
        return lambda: run_once(impl, mode, inputs)

    return added_peak_bytes(lambda: run_once(impl, mode, make_inputs(64, grad)), prepare)


def time_cases(length: int, repeats: int) -> dict[tuple[str, str], list[float]]:
    """Seconds per call, the kernels interleaved within each repeat."""
    inputs = {mode: make_inputs(length, requires_grad=mode != "forward") for mode in MODES}
    return time_interleaved({(impl, mode): (lambda i=impl, m=mode: run_once(i, m, inputs[m]))
                             for mode in MODES for impl in IMPLS if fits(impl, mode, length)},
                            repeats)


def main() -> None:
    if handed_to_gpu_benchmark("attention_cuda"):
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention-cpu.json")
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "MODE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        impl, mode, length = args.child
        print(measure_peak_in_this_process(impl, mode, int(length)))
        return

    rows = []
    for length in args.lengths:
        repeats = 5 if length <= 1024 else 3 if length <= 4096 else 2
        print(f"T={length}: timing ({repeats} interleaved repeats) ...", flush=True)
        times = time_cases(length, repeats)
        for mode in MODES:
            sdpa_time = statistics.median(times[("sdpa", mode)]) if ("sdpa", mode) in times else None
            for impl in IMPLS:
                row = {"T": length, "impl": impl, "mode": mode}
                if (impl, mode) in times:
                    seconds = statistics.median(times[(impl, mode)])
                    row.update(seconds=seconds, time_vs_sdpa=seconds / sdpa_time if sdpa_time else None,
                               peak_bytes=peak_in_child(__file__, [impl, mode, str(length)],
                                                        args.threads))
                else:
                    row.update(skipped=f"needs about {format_bytes(estimated_bytes(impl, mode, length))}"
                                       f", more than fits in this machine's free memory",
                               estimated_bytes=estimated_bytes(impl, mode, length))
                rows.append(row)

    print(f"\n{'T':>6} {'mode':17} {'impl':6} {'time':>10} {'vs sdpa':>8} {'peak memory':>12}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['T']:>6} {row['mode']:17} {row['impl']:6} {'skipped: ' + row['skipped']}")
            continue
        ratio = f"{row['time_vs_sdpa']:.2f}x" if row["time_vs_sdpa"] else "-"
        print(f"{row['T']:>6} {row['mode']:17} {row['impl']:6} {row['seconds'] * 1e3:>8.1f}ms "
              f"{ratio:>8} {format_bytes(row['peak_bytes']):>12}")

    result = {"benchmark": "attention", "shape": {"B": BATCH, "H": HEADS, "D": HEAD_DIM},
              "dtype": "float32", "device": "cpu", "machine": machine_info(args.threads),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
