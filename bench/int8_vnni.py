"""The int8 VNNI kernel (model/int8_vnni.py) against oneDNN's int8 product (model/int8.py),
which it equals bit for bit, and packed float32 (model/packed.py): one Linear's product
alone, the same weights and rows, interleaved.

Shapes: the products of the `small` translation model's decoder step (256 wide: the
fused query-key-value 256 -> 768, the attention outputs 256 -> 256, the feed-forward
256 -> 1,024 and 1,024 -> 256, the output projection 256 -> 8,000) and of GPT-2's (768
wide); rows 1 to 512 (one sentence greedy, at beam 4, batches, an encoder's pass).
Counted: microseconds a call, the median of --repeats interleaved rounds of --calls
calls, at each of --threads threads; every call of the two int8 peers gives the same
bits (checked before timing).

    python bench/int8_vnni.py [--threads 1 2] [--repeats 5] [--calls 50]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, microseconds_per_call  # noqa: E402
from transduce.model import int8_vnni  # noqa: E402
from transduce.model.int8 import Int8Linear  # noqa: E402
from transduce.model.packed import PackedLinear  # noqa: E402
from transduce.runtime import torch_threads  # noqa: E402

SHAPES = ((256, 768), (256, 256), (256, 1024), (1024, 256), (256, 8000),
          (768, 2304), (768, 3072), (3072, 768), (768, 50257))
ROWS = (1, 2, 4, 8, 16, 32, 128, 512)


def compare(inputs: int, outputs: int, rows: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(inputs + outputs)
    linear = nn.Linear(inputs, outputs)
    oneDNN, kernel = Int8Linear(linear), int8_vnni.Int8VnniLinear(linear)
    peers = {"float32 packed": PackedLinear(linear), "int8 oneDNN": oneDNN,
             "int8 VNNI kernel": kernel}
    x = torch.randn(rows, inputs)
    with torch.no_grad():
        assert torch.equal(oneDNN(x), kernel(x)), "the kernel's bits differ"
        microseconds = microseconds_per_call(peers, x, args.calls, args.repeats)
    speedup = microseconds["int8 oneDNN"] / microseconds["int8 VNNI kernel"]
    print(f"{inputs} -> {outputs}, {rows} rows: " +
          ", ".join(f"{name} {us:.1f} us" for name, us in microseconds.items()) +
          f"; kernel / oneDNN {speedup:.2f}x", flush=True)
    return {"inputs": inputs, "outputs": outputs, "rows": rows, "microseconds": microseconds,
            "kernel_over_onednn": speedup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("bench/results/int8-vnni-cpu.json"))
    args = parser.parse_args()
    if not int8_vnni.available():
        sys.exit("the int8 VNNI kernel does not run here (it needs AVX512-VNNI and g++)")
    runs = []
    for threads in args.threads:
        with torch_threads(threads):
            print(f"{threads} thread(s)", flush=True)
            runs.append({"threads": threads,
                         "rows": [compare(inputs, outputs, count, args)
                                  for inputs, outputs in SHAPES for count in ROWS]})
    result = {"benchmark": "int8-vnni", "calls": args.calls, "repeats": args.repeats,
              "machine": machine_info(max(args.threads)), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
