"""Training throughput: our `small` Transformer and Hugging Face's MarianMTModel of the same
size, on the same batches, interleaved in short rounds.

Both models: d_model 256, 3 + 3 layers, 4 heads, FFN 1024, one tied 8k embedding matrix,
dropout 0.1, label smoothing 0.1, post-norm (Marian's layout), fused Adam (0.9, 0.98,
1e-9; Hugging Face's Trainer defaults to its fused AdamW on this torch).
Three peers see the same batches (our length-sorted token batches of --max-tokens per
side): ours in the dtype `transduce train` picks here (--dtype auto: bfloat16 autocast
where the CPU has bfloat16 units, else float32), Hugging Face in float32 (its default)
and Hugging Face under bfloat16 autocast (what its `bf16=True` flag does on a CPU). All
count the same thing: target tokens that are not padding, per second of forward,
backward and optimizer step. Each side computes its loss as its training loop does
(ours: the output projection fused with the label-smoothed loss,
projected_label_smoothed_nll; Hugging Face: logits, then F.cross_entropy with
label_smoothing, as its Trainer does). With --compiled, a fourth peer, "ours compiled",
steps our model and loss as `transduce train --compile` does (train/objective.py under
torch.compile, shapes dynamic; it first steps every batch once, so that compiling is
not timed). With --unstacked, "ours unstacked" makes one product per attention
projection, as before training stacked them (attention/multihead.py). For each batch
size the peers alternate rounds
of --steps steps; the median round gives tokens/s, model FLOPs utilisation against the
matmul peak measured here for the peer's dtype, and the ratios ours / each Hugging Face
peer. Peak memory is the resident memory a few steps add, measured in a fresh child
process per case. The timed rounds run with the allocator setting `transduce train`
makes (runtime.keep_freed_memory), for all peers alike; the memory children without
it, so that freed blocks leave the high-water mark honest. Writes JSON with the
machine's description and CPU flags.

    python bench/train.py --data data/bible --max-tokens 2048 4096 8192 [--dtype auto] [--compiled]
        [--unstacked] [--peers ours "hf float32"]
    python bench/train.py --device cuda --data data/bible [--preset base]   # bench/train_cuda.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import (added_peak_bytes, format_bytes, handed_to_gpu_benchmark,  # noqa: E402
                     machine_info, peak_in_child)
from transduce.attention import MultiHeadAttention  # noqa: E402
from transduce.config import preset  # noqa: E402
from transduce.data.batching import TokenBatcher  # noqa: E402
from transduce.data.dataset import load_split  # noqa: E402
from transduce.data.packing import PackedPairBatcher  # noqa: E402
from transduce.data.tokenizer import MODEL_NAME, PAD_ID, Tokenizer  # noqa: E402
from transduce.export.hf import hf_config  # noqa: E402
from transduce.model import Transformer  # noqa: E402
from transduce.runtime import BFLOAT16_FLAGS, cpu_flags, keep_freed_memory, training_dtype  # noqa: E402
from transduce.train.flops import matmul_peak, training_flops  # noqa: E402
from transduce.train.objective import SequenceObjective  # noqa: E402

HF_PEERS = {"hf float32": None, "hf bfloat16": torch.bfloat16}
PEERS = ("ours", *HF_PEERS)
EXTRA_PEERS = ("ours compiled", "ours unstacked")
SMOOTHING, LR = 0.1, 5e-4


def build(peer: str, vocab_size: int, ours_dtype: torch.dtype | None):
    """The model and its one training step on a batch -> target tokens trained."""
    torch.manual_seed(0)
    ours = Transformer(preset("small", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                              norm_first=False))     # Marian's layout, for both
    if peer == "ours unstacked":
        unstack_projections(ours)
    if peer.startswith("ours"):
        model = ours.train()
        objective = SequenceObjective(model, language_model=False, label_smoothing=SMOOTHING)
        net = torch.compile(objective, dynamic=True) if peer == "ours compiled" else objective

        def loss_of(batch):
            return net(batch.src, batch.tgt_in, batch.tgt_out)
    else:
        from transformers import MarianConfig, MarianMTModel

        values = {**hf_config(ours), "dropout": 0.1}
        model = MarianMTModel(MarianConfig(**values)).train()

        def loss_of(batch):
            logits = model(input_ids=batch.src, attention_mask=(batch.src != PAD_ID).long(),
                           decoder_input_ids=batch.tgt_in).logits
            return F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(),
                                   ignore_index=PAD_ID, label_smoothing=SMOOTHING,
                                   reduction="sum")
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.98), eps=1e-9,
                                 fused=True)
    dtype = ours_dtype if peer.startswith("ours") else HF_PEERS[peer]

    def step(batch) -> int:
        tokens = int((batch.tgt_out != PAD_ID).sum())
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            (loss_of(batch) / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens

    return ours.config, dtype, step


def unstack_projections(model: torch.nn.Module) -> None:
    """One product per attention projection in training, as before they were stacked
    (a benchmark's reference: MultiHeadAttention.stack_in_training)."""
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.stack_in_training = False


def batches(data: Path, max_tokens: int, count: int) -> list:
    tokenizer = Tokenizer(data / MODEL_NAME)
    split = load_split(data, "train", tokenizer, 256)
    batcher = TokenBatcher(split.src_ids, split.tgt_ids, max_tokens, seed=1)
    return [batcher.collate(indices) for indices in batcher.epoch_batches(0)[:count]], \
        tokenizer.vocab_size


def packed_batches(data: Path, max_tokens: int, count: int, pack_length: int) -> tuple[list, int]:
    """The first `count` batches of the same corpus packed into rows (data/packing.py)."""
    tokenizer = Tokenizer(data / MODEL_NAME)
    split = load_split(data, "train", tokenizer, min(256, pack_length - 1))
    batcher = PackedPairBatcher(split.src_ids, split.tgt_ids, pack_length, max_tokens, seed=1)
    return [batcher.collate(indices) for indices in batcher.epoch_batches(0)[:count]], \
        tokenizer.vocab_size


def measure(data: Path, max_tokens: int, rounds: int, steps: int, ours_dtype,
            peers: tuple[str, ...]) -> dict:
    chosen, vocab = batches(data, max_tokens, steps)
    steppers = {peer: build(peer, vocab, ours_dtype) for peer in peers}
    config = steppers["ours"][0]
    flops = sum(training_flops(config, *b.src.shape, b.tgt_in.shape[1]) for b in chosen)
    for peer, (_, _, step) in steppers.items():   # warm-up: allocator, thread pool, autograd
        for batch in chosen if peer == "ours compiled" else chosen[:1]:   # and compiling
            step(batch)
    seconds: dict[str, list[float]] = {peer: [] for peer in peers}
    tokens = 0
    for _ in range(rounds):
        for peer, (_, _, step) in steppers.items():
            start = time.perf_counter()
            tokens = sum(step(batch) for batch in chosen)
            seconds[peer].append(time.perf_counter() - start)
            print(f"  {max_tokens} tokens, {peer}: {tokens / seconds[peer][-1]:,.0f} target "
                  f"tokens/s", flush=True)
    return {peer: {"dtype": str(steppers[peer][1] or torch.float32).removeprefix("torch."),
                   "seconds": times, "target_tokens_per_round": tokens,
                   "target_tokens_per_s": tokens / statistics.median(times),
                   "model_flops_per_s": flops / statistics.median(times)}
            for peer, times in seconds.items()}


def child(args) -> None:
    """Peak memory of a few training steps of one peer, in this fresh process."""
    peer, max_tokens, data = args.child[0], int(args.child[1]), Path(args.child[2])
    ours_dtype = torch.bfloat16 if args.child[3] == "bfloat16" else None
    chosen, vocab = batches(data, max_tokens, 3)

    def prepare():
        step = build(peer, vocab, ours_dtype)[2]
        return lambda: [step(batch) for batch in chosen]

    tiny_step = build(peer, vocab, ours_dtype)[2]
    print(added_peak_bytes(lambda: tiny_step(chosen[0]), prepare))


def report(rows: list[dict], peaks: dict[str, float]) -> dict[str, float]:
    """Print the table; -> ours / each Hugging Face peer at each one's fastest batch size."""
    print("\nmatmul peak " + ", ".join(f"{name} {value / 1e9:.0f} GFLOP/s"
                                      for name, value in peaks.items()))
    hf_peers = [hf for hf in HF_PEERS if any(row["peer"] == hf for row in rows)]
    print(f"{'peer':14s} {'dtype':9s} {'tokens':>7s} {'target tok/s':>13s} "
          + " ".join(f"{'vs ' + hf:>15s}" for hf in hf_peers) + f" {'MFU':>6s} {'peak mem':>10s}")
    for row in rows:
        same_batch = {hf: next(r for r in rows if r["peer"] == hf and
                               r["max_tokens"] == row["max_tokens"]) for hf in hf_peers}
        ratios = " ".join(f"{row['target_tokens_per_s'] / hf['target_tokens_per_s']:14.2f}x"
                          for hf in same_batch.values())
        print(f"{row['peer']:14s} {row['dtype']:9s} {row['max_tokens']:7d} "
              f"{row['target_tokens_per_s']:13,.0f} {ratios} {100 * row['mfu']:5.1f}% "
              f"{format_bytes(row['peak_memory_bytes']):>10s}")
    best = {peer: max(r["target_tokens_per_s"] for r in rows if r["peer"] == peer)
            for peer in {row["peer"] for row in rows}}
    ratios = {hf: best["ours"] / best[hf] for hf in hf_peers}
    print("at each one's fastest batch size: " + ", ".join(f"ours / {hf} = {ratio:.2f}x"
                                                          for hf, ratio in ratios.items()))
    return ratios


def main() -> None:
    if handed_to_gpu_benchmark("train_cuda"):
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="corpus directory (required)")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="batches per round and peer")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="our model's training dtype (default: what `transduce train` picks)")
    parser.add_argument("--compiled", action="store_true",
                        help="also time 'ours compiled' (transduce train --compile)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=[*PEERS, *EXTRA_PEERS],
                        help="which peers to time ('ours' always is; default: ours and "
                             "both Hugging Face peers)")
    parser.add_argument("--unstacked", action="store_true",
                        help="also time 'ours unstacked' (one product per attention projection)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:   # memory: glibc returning freed blocks, so the high-water mark is honest
        child(args)
        return
    keep_freed_memory()   # timing: what `transduce train` does, for every peer alike
    if args.data is None:
        parser.error("--data is required")
    ours = training_dtype(args.dtype, torch.device("cpu"))
    ours_dtype = torch.bfloat16 if ours == "bfloat16" else None
    peaks = {name: matmul_peak(getattr(torch, name)) for name in ("float32", "bfloat16")}
    rows = []
    peers = tuple(dict.fromkeys(["ours", *args.peers] + ["ours compiled"] * args.compiled
                                + ["ours unstacked"] * args.unstacked))
    for max_tokens in args.max_tokens:
        result = measure(args.data, max_tokens, args.rounds, args.steps, ours_dtype, peers)
        for peer, values in result.items():
            values["mfu"] = values["model_flops_per_s"] / peaks[values["dtype"]]
            case = [peer, str(max_tokens), str(args.data), ours]
            values["peak_memory_bytes"] = peak_in_child(Path(__file__), case, args.threads)
            rows.append({"peer": peer, "max_tokens": max_tokens, **values})
    ratios = report(rows, peaks)
    out = args.out or Path(__file__).parent / "results" / "train-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "train", "ours_dtype": ours, "rounds": args.rounds,
                               "steps_per_round": args.steps, "matmul_peak_flops": peaks,
                               "machine": {**machine_info(args.threads),
                                           "bfloat16_flags": sorted(cpu_flags() & BFLOAT16_FLAGS)},
                               "rows": rows, "best_ratio": ratios}, indent=2) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
