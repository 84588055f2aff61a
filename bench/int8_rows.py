"""The int8 rows kernel (model/int8_rows.py) against oneDNN's int8 product (model/int8.py)
and packed float32 (model/packed.py): one Linear's product alone, the same weights and
rows, interleaved, at the shapes of a language model's decoding step.

Shapes: the products of gpt-small's layout 768 wide (the fused query-key-value 768 ->
2,304, the output 768 -> 768, the feed-forward 768 -> 3,072 and 3,072 -> 768) and 1,024
wide (its feed-forward), and the output projection 768 -> 8,000; rows 1, 4, 8, 32 and
128 (a prompt a row at a decoding step; a prompt's tokens at its prefill). Counted:
microseconds a call (the median of --repeats interleaved rounds of --calls calls) and
the relative error of each against the float64 product (whose rows' 8 or 7 bits show).

With --model RUN --data DIR (a trained language model and its text corpus): the
perplexity per piece of the first --lines lines of the test split under the model's
float32 decoding copy and its int8 copies through each kernel, every product of 2^16
weights or more in int8 (as `--dtype int8` converts them), each line scored alone.

    python bench/int8_rows.py [--repeats 5] [--calls 20] [--model runs/lm/ema --data data/bible-text]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, microseconds_per_call  # noqa: E402
from transduce.model import int8_rows  # noqa: E402
from transduce.model.int8 import Int8Linear  # noqa: E402
from transduce.model.int8_rows import Int8RowsLinear  # noqa: E402
from transduce.model.packed import PackedLinear  # noqa: E402

SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768), (1024, 4096), (4096, 1024),
          (768, 8000))
ROWS = (1, 4, 8, 32, 128)


def compare(inputs: int, outputs: int, rows: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(inputs + outputs)
    linear = nn.Linear(inputs, outputs)
    peers = {"float32 packed": PackedLinear(linear), "int8 oneDNN": Int8Linear(linear),
             "int8 rows": Int8RowsLinear(linear)}
    x = torch.randn(rows, inputs)
    with torch.no_grad():
        exact = linear.double()(x.double())
        linear.float()
        error = {name: float((peer(x).double() - exact).norm() / exact.norm())
                 for name, peer in peers.items()}
        microseconds = microseconds_per_call(peers, x, args.calls, args.repeats)
    base = microseconds["float32 packed"]
    row = {"inputs": inputs, "outputs": outputs, "rows": rows, "microseconds": microseconds,
           "speed_over_float32": {name: base / us for name, us in microseconds.items()},
           "rows_over_onednn": microseconds["int8 oneDNN"] / microseconds["int8 rows"],
           "relative_error": error}
    print(f"{inputs} -> {outputs}, {rows} rows: " + ", ".join(
        f"{name} {us:.0f} us ({base / us:.2f}x)" for name, us in microseconds.items()) +
        f"; rows / oneDNN {row['rows_over_onednn']:.2f}x; error " +
        ", ".join(f"{e:.4f}" for e in error.values()), flush=True)
    return row


def perplexities(run: Path, data: Path, lines: int) -> dict:
    """Perplexity per piece of the test split's first `lines` lines: {copy: perplexity}."""
    import contextlib

    import torch.nn.functional as F

    from transduce import checkpoint
    from transduce.data.corpus import read_text_split
    from transduce.model import load_model
    from transduce.model.packed import decoding_copy

    directory = checkpoint.resolve(run)
    model = load_model(directory)
    tokenizer = checkpoint.load_tokenizer(directory)
    texts = read_text_split(data, "test").lines[:lines]

    @contextlib.contextmanager
    def kernel(rows: bool):
        preferred = int8_rows.preferred
        int8_rows.preferred = lambda: rows
        try:
            yield
        finally:
            int8_rows.preferred = preferred

    copies = {"float32": decoding_copy(model)}
    for name, rows in (("int8 oneDNN", False), ("int8 rows", True)):
        with kernel(rows):
            copies[name] = decoding_copy(model, torch.int8)
    nll, pieces = dict.fromkeys(copies, 0.0), 0
    with torch.no_grad():
        for ids in tokenizer.encode(texts):
            tokens = torch.tensor([[tokenizer.bos_id, *ids, tokenizer.eos_id]])   # (1, T + 1)
            pieces += len(ids) + 1
            for name, copy in copies.items():
                logits = copy(tokens[:, :-1])                                    # (1, T, V)
                nll[name] += float(F.cross_entropy(logits[0], tokens[0, 1:], reduction="sum"))
    result = {name: math.exp(total / pieces) for name, total in nll.items()}
    print(f"{run}, {len(texts)} test lines, {pieces} pieces: perplexity per piece " +
          ", ".join(f"{name} {value:.4f}" for name, value in result.items()), flush=True)
    return {"model": str(run), "lines": len(texts), "pieces": pieces,
            "perplexity_per_piece": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--model", type=Path, help="a trained language model's run or checkpoint")
    parser.add_argument("--data", type=Path, help="its text corpus (test.txt)")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/int8-rows-cpu.json"))
    args = parser.parse_args()
    if not int8_rows.KERNEL.available():
        sys.exit("the int8 rows kernel could not be built here (it needs AVX2 and g++)")
    if (args.model is None) != (args.data is None):
        sys.exit("--model and --data go together")
    rows = [compare(inputs, outputs, count, args)
            for inputs, outputs in SHAPES for count in ROWS]
    result = {"benchmark": "int8-rows", "calls": args.calls, "repeats": args.repeats,
              "machine": machine_info(torch.get_num_threads()), "rows": rows}
    if args.model is not None:
        result["quality"] = perplexities(args.model, args.data, args.lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
