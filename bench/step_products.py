"""What a training step's matrix products allow: each product of one step timed alone.

One batch of the Bible corpus (bench/train.py's batcher: length-sorted batches of
--max-tokens per side, or rows of --pack-length packed pairs), one forward and backward
pass of our model and its fused loss (train/objective.py) under the dtype a run would
train in (bfloat16 autocast on a GPU; --dtype auto on a CPU), recorded below autograd
(train/products.py): every matrix product and attention kernel with its operands'
shapes, strides and dtype. Each distinct call is then made again on fresh operands of
the same layout, in a loop of a few calls between synchronisations, and its median time
times its count gives what it takes in the step. Their sum is a floor under any step of
this batch, however well the rest is fused or hidden, so model FLOPs over it is the MFU
the products allow: the ceiling a compiled or graphed step can approach. Timed beside
them, in the same rounds (each round times every call, the step, then the square), so
that a machine whose speed drifts moves all alike: the whole eager step (forward and
backward, no optimizer), and the square product on which the measured peak is taken
(train/flops.py's peak_operands, as matmul_peak: 8192 on a GPU, 2048 on a CPU).

    python bench/step_products.py --device cuda --data data/bible [--preset base] \\
        [--max-tokens 25000] [--pack-length 256 --impl triton]
    python bench/step_products.py --device cpu --data data/bible --preset small --max-tokens 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transduce.config import preset  # noqa: E402
from transduce.model import Transformer  # noqa: E402
from transduce.runtime import training_dtype  # noqa: E402
from transduce.train.flops import batch_training_flops, peak_operands  # noqa: E402
from transduce.train.objective import SequenceObjective  # noqa: E402
from transduce.train.products import Call, StepRecorder  # noqa: E402

SMOOTHING = 0.1
CALLS = 10   # calls of a kernel timed together, so that a GPU runs them back to back


def first_batch(args):
    """The corpus's first batch at --max-tokens (packed rows with --pack-length) and
    the vocabulary size."""
    from train import batches, packed_batches
    chosen, vocab = packed_batches(args.data, args.max_tokens, 1, args.pack_length) \
        if args.pack_length else batches(args.data, args.max_tokens, 1)
    return chosen[0].to(args.device), vocab


def step_of(args, vocab: int):
    """-> (the model's config, one forward and backward pass on a batch)."""
    torch.manual_seed(0)
    config = preset(args.preset, src_vocab_size=vocab, tgt_vocab_size=vocab,
                    attention_impl=args.impl)
    model = Transformer(config).to(args.device).train()
    objective = SequenceObjective(model, language_model=False, label_smoothing=SMOOTHING)
    dtype = autocast_dtype(args)

    def step(batch) -> None:
        with torch.autocast(args.device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = objective(batch.src, batch.tgt_in, batch.tgt_out, batch.segments)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return config, step


def autocast_dtype(args) -> torch.dtype | None:
    if args.device == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if training_dtype(args.dtype, torch.device("cpu")) == "bfloat16" \
        else None


def timed_rounds(runs: dict, device: str, repeats: int, calls: dict) -> dict[object, float]:
    """Median seconds a call of each runs[key]() takes: `repeats` rounds, each timing
    every key in turn over calls[key] calls (launched back to back on a GPU,
    synchronised around them), so that a machine whose speed drifts slows all alike."""
    for run in runs.values():
        run()                                             # warm-up
    times: dict[object, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            synchronize(device)
            start = time.perf_counter()
            for _ in range(calls[key]):
                run()
            synchronize(device)
            times[key].append((time.perf_counter() - start) / calls[key])
    return {key: statistics.median(values) for key, values in times.items()}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def call_rows(calls: dict[Call, int], seconds: dict[Call, float]) -> list[dict]:
    """The recorded calls of one kind with their times in the step, longest first."""
    rows = [{"op": call.op.removeprefix("aten."), "operands": describe(call), "calls": count,
             "seconds_each": seconds[call], "seconds": seconds[call] * count,
             "flops": call.flops * count} for call, count in calls.items()]
    return sorted(rows, key=lambda row: -row["seconds"])


def describe(call: Call) -> str:
    """The tensor operands' shapes (a 'T' marks a transposed matrix) and dtype."""
    shapes = [("x".join(map(str, o.size)) + ("T" if _transposed(o) else ""), o.dtype)
              for o in call.args if o.size is not None]
    dtype = str(shapes[-1][1]).removeprefix("torch.") if shapes else ""
    return ", ".join(shape for shape, _ in shapes) + f" ({dtype})"


def _transposed(operand) -> bool:
    return len(operand.size) >= 2 and operand.stride[-1] != 1 and operand.stride[-2] == 1


def measure(args) -> dict:
    batch, vocab = first_batch(args)
    config, step = step_of(args, vocab)
    step(batch)                                          # warm-up: kernels, allocator
    with StepRecorder() as recorder:
        step(batch)
    runs, failed = replays([*recorder.of_kind("product"), *recorder.of_kind("attention")])
    products, attention = ({call: count for call, count in recorder.of_kind(kind).items()
                            if call in runs} for kind in ("product", "attention"))
    runs["step"] = lambda: step(batch)
    square = peak_operands(autocast_dtype(args) or torch.float32, args.device)
    size = square[0].shape[0]
    runs["square"] = lambda: square[0] @ square[1]
    seconds = timed_rounds(runs, args.device, args.repeats,
                           {key: CALLS if isinstance(key, Call) else 1 for key in runs})
    products, attention = call_rows(products, seconds), call_rows(attention, seconds)
    return {"matmul_peak": 2 * size ** 3 / seconds["square"],
            "model_flops": batch_training_flops(config, batch.to("cpu")),
            "recorded_product_flops": recorder.flops("product"),
            "recorded_attention_flops": recorder.flops("attention"),
            "aten_calls": sum(recorder.calls.values()),
            "target_tokens": batch.num_tgt_tokens, "batch_shape": describe_batch(batch),
            "products_seconds": sum(row["seconds"] for row in products),
            "attention_seconds": sum(row["seconds"] for row in attention),
            "eager_step_seconds": seconds["step"], "products": products, "attention": attention,
            "not_replayed": failed}


def replays(calls: list[Call]) -> tuple[dict, list[str]]:
    """Each call's replay, made once; a call that cannot be made again on fresh operands
    is left out of the sums and named (with its error) rather than ending the run."""
    runs, failed = {}, []
    for call in calls:
        try:
            run = call.replay()
            run()
            runs[call] = run
        except Exception as error:   # reported; the others are still timed
            failed.append(f"{describe(call)} {call.op}: {type(error).__name__}: {error}")
            print(f"not replayed, left out of the sums: {failed[-1]}", flush=True)
    return runs, failed


def describe_batch(batch) -> str:
    return f"src {tuple(batch.src.shape)}, tgt {tuple(batch.tgt_in.shape)}" + \
        (" packed" if batch.segments is not None else "")


def machine(device: str) -> dict:
    if device == "cuda":
        from attention_cuda import gpu_info
        return gpu_info()
    from measure import machine_info
    return machine_info(torch.get_num_threads())


def report(result: dict, peaks: dict[str, float]) -> None:
    """Prints the products by time, then the floors and the MFU each allows."""
    print(f"{'op':18s} {'operands':44s} {'calls':>5s} {'TFLOP/s':>8s} {'ms in step':>10s}")
    for row in result["products"] + result["attention"]:
        rate = row["flops"] / row["seconds"] / 1e12 if row["flops"] else float("nan")
        op = row["op"].split(".")[0]
        if "scaled_dot_product" in op:   # the backend is in the JSON
            op = "attention backward" if op.endswith("_backward") else "attention"
        print(f"{op:18s} {row['operands'][:44]:44s} {row['calls']:5d} "
              f"{rate:8.3f} {1e3 * row['seconds']:10.2f}")
    if not result["attention"]:
        print("(no attention kernel among the aten calls: impl='triton' launches its own, "
              "which are not timed here)")
    flops = result["model_flops"]
    floors = {"products alone": result["products_seconds"],
              "products and attention": result["products_seconds"] + result["attention_seconds"],
              "eager step (measured)": result["eager_step_seconds"]}
    for name, seconds in floors.items():
        shares = ", ".join(f"{100 * flops / seconds / peak:.1f}% of {what}"
                           for what, peak in peaks.items())
        print(f"{name:24s} {1e3 * seconds:9.2f} ms -> MFU {shares}")
    result["mfu"] = {name: {what: flops / seconds / peak for what, peak in peaks.items()}
                     for name, seconds in floors.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--preset", default="base")
    parser.add_argument("--impl", default="sdpa", help="attention_impl of the model")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="on a CPU, as `transduce train --dtype` (a GPU: bfloat16)")
    parser.add_argument("--max-tokens", type=int, default=25000)
    parser.add_argument("--pack-length", type=int, default=0,
                        help="rows of this many tokens of packed pairs (0: padded batches)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is available here")
    dtype = autocast_dtype(args) or torch.float32
    result = measure(args)
    peaks = {"measured matmul": result["matmul_peak"]}
    if args.device == "cuda":
        from train_cuda import datasheet_peak
        sheet = datasheet_peak(torch.cuda.get_device_name())
        peaks = {"data sheet": sheet, **peaks} if sheet else peaks
    print(", ".join(f"{what} {peak / 1e12:.3f} TFLOP/s" for what, peak in peaks.items()))
    print(f"{args.preset}, {result['batch_shape']}, {result['target_tokens']} target tokens, "
          f"{str(dtype).removeprefix('torch.')}: model {result['model_flops'] / 1e12:.3f} "
          f"TFLOP, recorded products {result['recorded_product_flops'] / 1e12:.3f} and "
          f"attention {result['recorded_attention_flops'] / 1e12:.3f} TFLOP, "
          f"{result['aten_calls']} aten calls")
    report(result, peaks)
    out = args.out or Path(__file__).parent / "results" / f"step-products-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "step_products", "device": args.device,
                               "machine": machine(args.device), "preset": args.preset,
                               "impl": args.impl, "dtype": str(dtype), "max_tokens":
                               args.max_tokens, "pack_length": args.pack_length,
                               "peaks": peaks, **result}, indent=2, default=str) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
