"""Attention kernels on a CUDA GPU: our Triton kernel, our PyTorch-ops flash kernel,
PyTorch SDPA held to its FlashAttention backend, and the naive formula.

Shapes follow FlashAttention's benchmarks: 16k tokens per batch (B = 16384 / T, at least
1), H = 2048 / D heads, self-attention, causal and not. Each case times the forward pass
(no grad) and forward + backward, the kernels interleaved within each repeat on the same
inputs; a time is the median of the repeats, each the mean of a few calls between CUDA
events. TFLOP/s counts 4 B H T^2 D per forward (half when causal) and 2.5 times that for
forward + backward, the same count for every kernel. Peak memory is what the call adds to
the allocated memory (torch.cuda.max_memory_allocated). A case whose naive score matrices
would not fit is skipped and reported.

    python bench/attention.py --device cuda [--lengths 512 ... 32768] [--head-dims 64 128]
    python bench/attention_cuda.py --sweep      # tile sizes for impl="triton"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from transduce.attention import attention  # noqa: E402
from transduce.attention.triton_flash import Tiles, triton_attention  # noqa: E402
from transduce.train.flops import matmul_peak  # noqa: E402

IMPLS = ("triton", "sdpa-flash", "flash", "naive")
MODES = ("forward", "forward+backward")
TOKENS, WIDTH = 16384, 2048
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768]


def shape(length: int, head_dim: int) -> tuple[int, int, int, int]:
    return max(1, TOKENS // length), WIDTH // head_dim, length, head_dim


def call(impl: str, q, k, v, causal: bool, tiles: Tiles | None = None):
    if impl == "sdpa-flash":
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "triton" and tiles is not None:
        return triton_attention(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, tiles=tiles)
    return attention(q, k, v, causal=causal, impl=impl)


def runner(impl: str, mode: str, inputs, causal: bool, tiles: Tiles | None = None):
    q, k, v = inputs
    grad = torch.randn_like(q)

    def run():
        if mode == "forward":
            with torch.no_grad():
                call(impl, q, k, v, causal, tiles)
        else:
            out = call(impl, q, k, v, causal, tiles)
            torch.autograd.grad(out, (q, k, v), grad)
    return run


def seconds_per_call(run, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def added_peak_bytes(run) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def flops(mode: str, B: int, H: int, T: int, D: int, causal: bool) -> float:
    forward = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    return forward * (2.5 if mode == "forward+backward" else 1.0)


def fits(impl: str, mode: str, B: int, H: int, T: int) -> bool:
    """naive keeps a few (T, T) matrices per head in float32; the rest are O(T)."""
    if impl != "naive":
        return True
    matrices = 3 if mode == "forward" else 6
    return matrices * B * H * T * T * 4 < 0.7 * torch.cuda.mem_get_info()[0]


def measure_case(T: int, D: int, dtype, causal: bool, repeats: int, impls) -> list[dict]:
    B, H, _, _ = shape(T, D)
    torch.manual_seed(0)
    inputs = {mode: [torch.randn(B, H, T, D, device="cuda", dtype=dtype,
                                 requires_grad=mode != "forward") for _ in range(3)]
              for mode in MODES}
    runs = {(impl, mode): runner(impl, mode, inputs[mode], causal)
            for mode in MODES for impl in impls if fits(impl, mode, B, H, T)
            and not (impl == "flash" and T > 16384)}
    calls = max(1, min(20, int(2e9 // (B * H * T * T))))   # about the same time per case
    for run in runs.values():
        run()                                               # compile, allocator, cuDNN plans
    times: dict = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            times[key].append(seconds_per_call(run, calls if key[0] != "flash" else 1))
    rows = []
    for (impl, mode), values in times.items():
        seconds = statistics.median(values)
        rows.append({"T": T, "B": B, "H": H, "D": D, "dtype": str(dtype).removeprefix("torch."),
                     "causal": causal, "impl": impl, "mode": mode, "seconds": seconds,
                     "tflops": flops(mode, B, H, T, D, causal) / seconds / 1e12,
                     "peak_bytes": added_peak_bytes(runs[(impl, mode)])})
    for row in rows:
        sdpa = next((r for r in rows if r["impl"] == "sdpa-flash" and r["mode"] == row["mode"]), None)
        row["time_vs_sdpa_flash"] = row["seconds"] / sdpa["seconds"] if sdpa else None
    return rows


def sweep(args) -> None:
    """Time impl='triton' with each tile setting on a few shapes; print the best per case."""
    candidates = [Tiles(m, n, w, s) for m in (64, 128) for n in (32, 64, 128)
                  for w in (4, 8) for s in (2, 3, 4) if not (m == 128 and n == 128 and s == 4)]
    for D in args.head_dims:
        for causal in (False, True):
            for mode in MODES:
                T = 4096
                B, H, _, _ = shape(T, D)
                inputs = [torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16,
                                      requires_grad=mode != "forward") for _ in range(3)]
                sdpa = runner("sdpa-flash", mode, inputs, causal)
                sdpa()
                results = []
                for tiles in candidates:
                    run = runner("triton", mode, inputs, causal, tiles)
                    try:
                        run()
                    except Exception as error:  # out of shared memory: not a candidate
                        print(f"  {tiles}: {type(error).__name__}")
                        continue
                    results.append((min(seconds_per_call(run, 10) for _ in range(3)), tiles))
                base = min(seconds_per_call(sdpa, 10) for _ in range(3))
                best = sorted(results, key=lambda r: r[0])[:3]
                print(f"D={D} causal={causal} {mode}: sdpa-flash {base * 1e3:.3f} ms; best "
                      + "; ".join(f"{t} {s * 1e3:.3f} ms ({s / base:.2f}x)" for s, t in best),
                      flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "attention-cuda.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and none is available")
    if args.sweep:
        sweep(args)
        return
    rows = []
    matmul_peak(torch.bfloat16, "cuda", seconds=2.0)   # the GPU's clocks up from idle first
    for dtype in args.dtypes:
        for D in args.head_dims:
            for causal in (False, True):
                for T in args.lengths:
                    case = measure_case(T, D, getattr(torch, dtype), causal, args.repeats, args.impls)
                    rows += case
                    print_rows(case)
    summarise(rows)
    result = {"benchmark": "attention", "device": "cuda", "machine": gpu_info(),
              "tokens_per_batch": TOKENS, "model_width": WIDTH, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        ratio = f"{r['time_vs_sdpa_flash']:.2f}x" if r["time_vs_sdpa_flash"] else "-"
        print(f"{r['dtype']:8s} D={r['D']:<3d} causal={r['causal']!s:5s} T={r['T']:<5d} "
              f"{r['mode']:16s} {r['impl']:10s} {r['seconds'] * 1e3:9.3f} ms {r['tflops']:7.1f} "
              f"TFLOP/s {ratio:>6s} vs sdpa-flash  peak {r['peak_bytes'] / 2**20:8.1f} MiB",
              flush=True)


def summarise(rows: list[dict]) -> None:
    """Geometric mean of triton's speed relative to sdpa-flash, per mode (>1: faster)."""
    for mode in MODES:
        ratios = [1 / r["time_vs_sdpa_flash"] for r in rows
                  if r["impl"] == "triton" and r["mode"] == mode and r["time_vs_sdpa_flash"]]
        if ratios:
            mean = statistics.geometric_mean(ratios)
            print(f"triton speed / sdpa-flash speed, {mode}: geometric mean {mean:.2f}x, "
                  f"min {min(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} cases")


def gpu_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    info = {"gpu": props.name, "multiprocessors": props.multi_processor_count,
            "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


if __name__ == "__main__":
    main()
