"""Training throughput on a CUDA GPU: the paper's base model (or another preset) on the
Bible corpus, bfloat16 autocast, fused Adam, our fused projection + label-smoothed loss.

Peers on the same batches, interleaved in rounds: ours with each attention impl asked
for (default sdpa and triton), ours under torch.compile ("ours sdpa compiled": the model
and its loss as one graph, train/objective.py, as `transduce train --compile` steps
them, shapes dynamic), and Hugging Face's
MarianMTModel of the same shape under the same autocast with F.cross_entropy (what its
Trainer does with bf16=True). Peers named "... packed" ("ours triton packed", "ours
sdpa packed compiled") train on rows of --pack-length tokens packed with whole pairs
(data/packing.py; `transduce train --pack-length`), the first --steps packed batches of
the same corpus at the same budget: batches of one shape, compiled without dynamic
shapes, and the Triton kernel skipping other pairs' tiles; "... packed graphed" also
replays each step's forward and backward as CUDA graphs (torch.compile's
reduce-overhead mode: one launch a graph, no Python between kernels), and "... packed
autotuned" compiles with mode="max-autotune": CUDA graphs too, and each product timed
against Triton templates that can take the elementwise work after it (bias, ReLU,
dropout) into their epilogue, where that is faster (compiling takes minutes). Peers with
"unstacked" in their name ("ours triton unstacked packed graphed") make one product
per attention projection in training, as before they were stacked (multihead.py);
"unfused" ones ("ours triton unfused packed graphed") end each post-norm sub-layer in
PyTorch's ops (or the compiler's kernels for them) rather than the Triton kernels that
impl "triton" takes (model/add_norm.py).
Every peer first steps through every batch once (kernels compiled for each shape,
allocator settled); then the rounds are timed. All count target tokens that are not
padding per second of forward, backward and optimizer step (each peer its own batches'
targets).
MFU is model FLOPs (train/flops.py, 6 N per token plus attention) per second against the
GPU's dense bfloat16 peak from its data sheet (989.4 TFLOP/s for H100 SXM and H200), and
also against the matmul rate measured here (8192^3 bfloat16).

    python bench/train.py --device cuda --data data/bible [--preset base] [--max-tokens 8192 16384 25000]
    python bench/train.py --device cuda --data data/bible --max-tokens 25000 \
        --peers "ours sdpa compiled" "ours triton packed" "ours triton packed compiled" \
        "ours triton packed graphed"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_cuda import gpu_info  # noqa: E402
from train import unstack_projections  # noqa: E402
from transduce.config import preset  # noqa: E402
from transduce.data.tokenizer import PAD_ID  # noqa: E402
from transduce.export.hf import hf_config  # noqa: E402
from transduce.model import Transformer  # noqa: E402
from transduce.train.flops import batch_training_flops, matmul_peak  # noqa: E402
from transduce.train.objective import SequenceObjective  # noqa: E402

# Dense bfloat16 tensor-core peaks from the data sheets (no sparsity), by name prefix.
DATASHEET_BF16 = {"NVIDIA H100": 989.4e12, "NVIDIA H200": 989.4e12, "NVIDIA A100": 312e12}
SMOOTHING, LR = 0.1, 5e-4


def datasheet_peak(name: str) -> float | None:
    return next((peak for prefix, peak in DATASHEET_BF16.items() if name.startswith(prefix)), None)


def build(peer: str, preset_name: str, vocab: int):
    """-> a training step on a batch (returning target tokens), our model's config and
    the model the step trains."""
    torch.manual_seed(0)
    impl = peer.split()[1] if peer.startswith("ours") else "sdpa"
    config = preset(preset_name, src_vocab_size=vocab, tgt_vocab_size=vocab, attention_impl=impl)
    ours = Transformer(config)
    if "unstacked" in peer:
        unstack_projections(ours)
    if "unfused" in peer:
        for module in ours.modules():
            if hasattr(module, "fused_add_norm"):
                module.fused_add_norm = False
    if peer.startswith("ours"):
        model = ours.cuda().train()
        objective = SequenceObjective(model, language_model=False, label_smoothing=SMOOTHING)
        # Packed batches all have one shape: compiled for it, as `transduce train` does.
        net = objective
        if peer.endswith(" compiled"):
            net = torch.compile(objective, dynamic="packed" not in peer)
        elif peer.endswith(" graphed"):
            net = torch.compile(objective, dynamic=False, mode="reduce-overhead")
        elif peer.endswith(" autotuned"):
            net = torch.compile(objective, dynamic=False, mode="max-autotune")

        def loss_of(batch):
            if replays_graphs(peer):   # the last step's outputs are no longer read
                torch.compiler.cudagraph_mark_step_begin()
            return net(batch.src, batch.tgt_in, batch.tgt_out, batch.segments)
    else:
        from transformers import MarianConfig, MarianMTModel

        model = MarianMTModel(MarianConfig(**hf_config(ours))).cuda().train()

        def loss_of(batch):
            logits = model(input_ids=batch.src, attention_mask=(batch.src != PAD_ID).long(),
                           decoder_input_ids=batch.tgt_in).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), batch.tgt_out.flatten(),
                                   ignore_index=PAD_ID, label_smoothing=SMOOTHING, reduction="sum")
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.98), eps=1e-9, fused=True)

    def step(batch) -> int:
        tokens = (batch.tgt_out != PAD_ID).sum()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(batch) / tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens

    return step, config, model


def replays_graphs(peer: str) -> bool:
    return peer.endswith((" graphed", " autotuned"))


def cuda_batches(data: Path, max_tokens: int, count: int, pack_length: int = 0):
    """The CPU benchmark's batches (the same corpus and batcher) on the GPU; with
    pack_length, the first `count` packed batches of the same corpus instead."""
    from train import batches, packed_batches
    chosen, vocab = packed_batches(data, max_tokens, count, pack_length) if pack_length \
        else batches(data, max_tokens, count)
    return [batch.to("cuda") for batch in chosen], vocab


def warmed_up(peer: str, preset_name: str, vocab: int, batches: list):
    """build(), then one step on every batch: kernels compiled for each shape (a
    compiled model may specialise on some), allocator settled. A peer whose steps leave
    every weight as it was is refused: its speed would be that of a step that trains
    nothing (a compiled loss that passed zero gradients once ran so)."""
    step, config, model = build(peer, preset_name, vocab)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    for batch in batches:
        step(batch)
    torch.cuda.synchronize()
    if all(torch.equal(old, new) for old, new in zip(before, model.parameters())):
        raise RuntimeError(f"{peer}: {len(batches)} training steps left every weight as it was")
    return step, config


def measure(args, max_tokens: int):
    """Yields a row per peer, as soon as it is known (a peer that fails at once, the
    others after the timed rounds; then the profiles, if asked for). Peers with "packed"
    in their name train on packed rows, the others on length-sorted batches of the same
    budget: tokens/s counts each one's own targets."""
    plain, vocab = cuda_batches(args.data, max_tokens, args.steps)
    packed = cuda_batches(args.data, max_tokens, args.steps, args.pack_length)[0] \
        if any("packed" in peer for peer in args.peers) else []
    data = {peer: packed if "packed" in peer else plain for peer in args.peers}
    steppers = {}
    for peer in args.peers:
        try:
            steppers[peer] = warmed_up(peer, args.preset, vocab, data[peer])
        except Exception as error:   # reported, and the other peers still measured
            traceback.print_exc()
            yield {"peer": peer, "max_tokens": max_tokens,
                   "error": f"{type(error).__name__}: {error}"}
            torch.cuda.empty_cache()
    seconds: dict[str, list[float]] = {peer: [] for peer in steppers}
    rows: dict[str, dict] = {}
    for _ in range(args.rounds):
        for peer, (step, _) in steppers.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for batch in data[peer]:
                step(batch)
            torch.cuda.synchronize()
            seconds[peer].append(time.perf_counter() - start)
    for peer, times in seconds.items():
        config = steppers[peer][1]
        median = statistics.median(times)
        tokens = sum(b.num_tgt_tokens for b in data[peer])
        flops = sum(batch_training_flops(config, b) for b in data[peer])
        rows[peer] = {"peer": peer, "max_tokens": max_tokens, "seconds": times,
                      "pack_length": args.pack_length if "packed" in peer else 0,
                      "target_tokens_per_round": tokens, "target_tokens_per_s": tokens / median,
                      "model_flops_per_s": flops / median,
                      "step_added_peak_bytes": step_added_peak(peer, steppers[peer][0],
                                                               data[peer][0])}
        yield rows[peer]
    if args.profile and max_tokens == args.max_tokens[-1]:
        for peer, (step, _) in steppers.items():
            # Into the peer's row, yielded above and written to JSON at the end.
            rows[peer]["gpu_ms_per_step"], rows[peer]["gpu_kernels"] = profile_kernels(
                peer, step, data[peer][:3], max_tokens)
    del steppers
    torch.cuda.empty_cache()


def step_added_peak(peer: str, step, batch) -> int | None:
    """The memory one step allocates at its peak over what was allocated before it (its
    activations and temporaries; not the weights and Adam state, nor the other peers',
    which stay allocated meanwhile); None for a graphed peer, whose replays take their
    memory from the graphs' pool, made in the warm-up, and allocate nothing."""
    if replays_graphs(peer):
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def print_row(row: dict, sheet: float | None, measured: float) -> None:
    """Adds the MFU figures to `row` and prints it."""
    if "error" in row:
        print(f"{row['peer']:20s} {row['max_tokens']:7d} failed: {row['error']}", flush=True)
        return
    row["mfu"] = row["model_flops_per_s"] / sheet if sheet else None
    row["mfu_of_measured_matmul"] = row["model_flops_per_s"] / measured
    mfu = f"{100 * row['mfu']:5.1f}%" if row["mfu"] is not None else "    -"
    added = row["step_added_peak_bytes"]
    memory = f"{added / 2**30:7.2f} GiB" if added is not None else "      -    "
    print(f"{row['peer']:20s} {row['max_tokens']:7d} {row['target_tokens_per_s']:13,.0f} "
          f"{row['model_flops_per_s'] / 1e12:8.1f} {mfu} "
          f"{100 * row['mfu_of_measured_matmul']:10.1f}% "
          f"{memory}", flush=True)


# Kernel names -> what they do, first match wins: our Triton add-norm kernels,
# cuBLAS's and CUTLASS's products, attention (PyTorch's SDPA kernels and ours in
# Triton), Inductor's fused kernels, Adam.
KERNEL_GROUPS = (("add-norm (ours, Triton)", ("add_norm_",)),
                 ("attention", ("fmha", "flash", "attention", "forward_kernel", "dq_kernel",
                                "dkdv_kernel")),
                 ("matrix products", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
                 ("fused by Inductor", ("triton_",)),
                 ("optimizer", ("multi_tensor_apply",)))


def kernel_group(name: str) -> str:
    lowered = name.lower()
    return next((group for group, marks in KERNEL_GROUPS
                 if any(mark in lowered for mark in marks)), "other (aten elementwise, copies)")


def profile_kernels(peer: str, step, batches: list, max_tokens: int
                    ) -> tuple[dict[str, float], list[dict]]:
    """A measured peer's GPU time by kernel over a few more steps (its kernels are
    compiled and warm already) -> ms per step by kernel group, every kernel counted,
    and the 40 longest kernels (name, group, calls and ms per step), which the table
    prints too."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch in batches:
            step(batch)
        torch.cuda.synchronize()
    print(f"===== {peer}, {max_tokens} tokens: GPU time by kernel over {len(batches)} steps")
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))
    kernels = sorted(({"name": event.key, "group": kernel_group(event.key),
                       "calls_per_step": event.count / len(batches),
                       "ms_per_step": event.self_device_time_total / 1e3 / len(batches)}
                      for event in averages if event.self_device_time_total > 0),
                     key=lambda kernel: -kernel["ms_per_step"])
    groups: dict[str, float] = {}
    for kernel in kernels:
        groups[kernel["group"]] = groups.get(kernel["group"], 0.0) + kernel["ms_per_step"]
    print("GPU ms per step: " + ", ".join(f"{group} {ms:.2f}" for group, ms in
                                          sorted(groups.items(), key=lambda kv: -kv[1]))
          + f"; total {sum(groups.values()):.2f}", flush=True)
    return groups, kernels[:40]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[8192, 16384, 25000])
    parser.add_argument("--peers", nargs="+",
                        default=["ours sdpa", "ours triton", "ours sdpa compiled", "hf"])
    parser.add_argument("--pack-length", type=int, default=256,
                        help="row length of the peers named '... packed' (data/packing.py)")
    parser.add_argument("--profile", action="store_true",
                        help="also print each peer's GPU kernels by time over three steps "
                             "(at the last --max-tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train-cuda.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and none is available")
    for peer in args.peers:
        if replays_graphs(peer) and "packed" not in peer:
            parser.error(f"--peers {peer!r}: CUDA graphs replay one shape; name a packed peer "
                         f"('ours triton packed graphed')")
    info = gpu_info()
    sheet = datasheet_peak(info["gpu"])
    measured = matmul_peak(torch.bfloat16, "cuda", size=8192, seconds=2.0)
    print(f"{info['gpu']}: bfloat16 peak {sheet / 1e12 if sheet else float('nan'):.0f} TFLOP/s "
          f"(data sheet), {measured / 1e12:.0f} TFLOP/s measured (8192^3 matmul)")
    print(f"{'peer':20s} {'tokens':>7s} {'target tok/s':>13s} {'TFLOP/s':>8s} {'MFU':>6s} "
          f"{'of measured':>11s} {'step adds':>11s}", flush=True)
    rows = []
    for max_tokens in args.max_tokens:   # each size's rows printed as soon as measured
        for row in measure(args, max_tokens):
            print_row(row, sheet, measured)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "train", "device": "cuda", "preset": args.preset,
                                    "dtype": "bfloat16 autocast", "machine": info,
                                    "bf16_peak_datasheet": sheet, "bf16_matmul_measured": measured,
                                    "rounds": args.rounds, "steps_per_round": args.steps,
                                    "rows": rows}, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
