"""Softmax, linear, sliding-window and sparse (global, strided) self-attention at long
inputs, side by side.

One encoder self-attention module of the `small` preset (d_model 256, 4 heads, float32,
B=1) runs forward, and forward + backward, at each length T: softmax through the naive
kernel (the (T, T) scores materialised) and through SDPA, linear attention, and
sliding-window attention (16 tokens either side, block kernel), and the sparse patterns
on the same block kernel: the window plus one global token, and the window plus a summary
key every 16 positions (attention/sparse.py). The peers are timed
interleaved in one process (ratios to softmax SDPA); peak memory is measured in a fresh
child process per case (bench/measure.py: VmHWM over the call).

    python bench/attention_types.py [--lengths 1024 4096 16384] [--out bench/results/attention-types-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))
from measure import (added_peak_bytes, available_bytes, format_bytes,  # noqa: E402
                     machine_info, peak_in_child, time_interleaved)
from transduce.attention import MultiHeadAttention  # noqa: E402

D_MODEL, HEADS, WINDOW = 256, 4, 16
PEERS = {  # name -> (kind, impl)
    "softmax naive": ("softmax", "naive"),
    "softmax sdpa": ("softmax", "sdpa"),
    "linear": ("linear", "sdpa"),
    "sliding 16": ("sliding", "sdpa"),
    "global 16+1": ("global", "sdpa"),      # the window and one global token
    "strided 16": ("strided", "sdpa"),      # the window and a summary key every 16
}
MODES = ("forward", "forward+backward")


def make_case(peer: str, length: int, requires_grad: bool):
    kind, impl = PEERS[peer]
    torch.manual_seed(0)
    module = MultiHeadAttention(D_MODEL, HEADS, impl=impl, kind=kind, window=WINDOW)
    return module, torch.randn(1, length, D_MODEL, requires_grad=requires_grad)


def run_once(module, x, mode: str) -> None:
    if mode == "forward":
        with torch.no_grad():
            module(x)
    else:
        module(x).sum().backward()
        x.grad = None
        module.zero_grad(set_to_none=True)


def fits(peer: str, mode: str, length: int) -> bool:
    """Naive softmax holds a few (H, T, T) float32 matrices; skip what cannot fit here."""
    if PEERS[peer][1] != "naive":
        return True
    matrices = 3 if mode == "forward" else 6
    return matrices * HEADS * length * length * 4 < 0.75 * available_bytes()


def measure_peak_in_this_process(peer: str, mode: str, length: int) -> int:
    """Child-process entry: bytes of resident memory the call adds at its peak."""
    grad = mode != "forward"

    def prepare():
        module, x = make_case(peer, length, grad)
        return lambda: run_once(module, x, mode)

    return added_peak_bytes(lambda: run_once(*make_case(peer, 64, grad), mode), prepare)


def time_cases(length: int, repeats: int) -> dict[tuple[str, str], list[float]]:
    cases = {(peer, mode): make_case(peer, length, mode != "forward")
             for mode in MODES for peer in PEERS if fits(peer, mode, length)}
    return time_interleaved({key: (lambda case=case, mode=key[1]: run_once(*case, mode))
                             for key, case in cases.items()}, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=HERE / "results" / "attention-types-cpu.json")
    parser.add_argument("--child", nargs=3, metavar=("PEER", "MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        peer, mode, length = args.child
        print(measure_peak_in_this_process(peer, mode, int(length)))
        return

    rows = []
    for length in args.lengths:
        times = time_cases(length, args.repeats)
        for mode in MODES:
            reference = statistics.median(times[("softmax sdpa", mode)])
            for peer in PEERS:
                if (peer, mode) not in times:
                    rows.append({"length": length, "mode": mode, "peer": peer, "skipped":
                                 "its (T, T) matrices would not fit in free memory"})
                    continue
                seconds = statistics.median(times[(peer, mode)])
                rows.append({"length": length, "mode": mode, "peer": peer, "seconds": seconds,
                             "vs_softmax_sdpa": seconds / reference,
                             "peak_bytes": peak_in_child(__file__, [peer, mode, str(length)],
                                                           args.threads)})
    print(f"\n{'T':>6} {'mode':17} {'peer':14} {'time':>10} {'vs sdpa':>8} {'peak memory':>12}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['length']:>6} {row['mode']:17} {row['peer']:14} skipped: {row['skipped']}")
            continue
        print(f"{row['length']:>6} {row['mode']:17} {row['peer']:14} {row['seconds'] * 1e3:>8.1f}ms "
              f"{row['vs_softmax_sdpa']:>7.2f}x {format_bytes(row['peak_bytes']):>12}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_info(args.threads), "d_model": D_MODEL,
                                    "heads": HEADS, "window": WINDOW, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
