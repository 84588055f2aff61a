"""The paper's "Why Self-Attention" comparison (its Table 1), for our layer sizes, with the
FLOPs counted the way train/flops.py counts them and one layer of each kind timed.

    layer                      FLOPs per layer         sequential ops   max path length
    self-attention             8 n d^2 + 4 n^2 d       O(1)             O(1)
    recurrent (GRU)            12 n d^2 (+ input)      O(n)             O(n)
    convolutional (kernel k)   2 k n d^2               O(1)             O(log_k n) dilated, O(n / k) not
    restricted self-attention  8 n d^2 + 4 n r d       O(1)             O(n / r)

n tokens of width d; the self-attention count includes its four projections, as
train/flops.py's does (the paper's O(n^2 d) is the n^2 part alone). Each kind is timed as
one layer over the same (B, n, d) input, interleaved in one process, forward only.

    python examples/why_self_attention.py [--d-model 256] [--lengths 32 128 512 2048]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from transduce.attention import MultiHeadAttention  # noqa: E402
from transduce.config import preset  # noqa: E402
from transduce.train.flops import forward_flops  # noqa: E402

KERNEL, WINDOW, TOKENS = 3, 16, 8192


def flops(kind: str, n: int, d: int) -> float:
    """Matmul FLOPs of one layer over one sequence of n tokens (2 per multiply-add)."""
    if kind == "self-attention":
        return 8 * n * d * d + 4 * n * n * d
    if kind == "recurrent":
        return 2 * 3 * n * (d * d + d * d)          # GRU: 3 gates, input and hidden matmuls
    if kind == "convolutional":
        return 2 * KERNEL * n * d * d
    return 8 * n * d * d + 4 * n * min(WINDOW, n) * d


def path_length(kind: str, n: int) -> str:
    if kind == "self-attention":
        return "1"
    if kind == "recurrent":
        return str(n)
    if kind == "convolutional":
        return f"{math.ceil(math.log(n, KERNEL))} (dilated) / {math.ceil(n / (KERNEL - 1))}"
    return str(math.ceil(n / WINDOW))


def check_against_train_flops(d: int) -> None:
    """train/flops.py's count of a one-layer encoder is this self-attention formula plus
    the feed-forward network and the pooler: the two count alike."""
    config = preset("bert-small", src_vocab_size=1000, tgt_vocab_size=1000, d_model=d,
                    num_heads=4, d_ff=4 * d, num_encoder_layers=1)
    n = 100
    ffn_and_pooler = 4 * n * d * config.d_ff + 2 * d * d
    counted = forward_flops(config, 1, n, n)
    assert counted == flops("self-attention", n, d) + ffn_and_pooler, counted


def layers(d: int) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"self-attention": MultiHeadAttention(d, 4),
            "recurrent": nn.GRU(d, d, batch_first=True),
            "convolutional": nn.Conv1d(d, d, KERNEL, padding=KERNEL // 2),
            "restricted": MultiHeadAttention(d, 4, kind="sliding", window=WINDOW)}


def run_layer(kind: str, layer: nn.Module, x: torch.Tensor) -> None:
    if kind == "recurrent":
        layer(x)
    elif kind == "convolutional":
        layer(x.transpose(1, 2))
    else:
        layer(x)


def timed(d: int, n: int, repeats: int) -> dict[str, float]:
    """Seconds per token of each layer kind, interleaved; batches of TOKENS tokens."""
    x = torch.randn(max(1, TOKENS // n), n, d)
    kinds = layers(d)
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for kind, layer in kinds.items():
            run_layer(kind, layer, x)
        for _ in range(repeats):
            for kind, layer in kinds.items():
                start = time.perf_counter()
                run_layer(kind, layer, x)
                seconds[kind].append(time.perf_counter() - start)
    return {kind: statistics.median(s) / x.shape[0] / n for kind, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    d = args.d_model
    check_against_train_flops(d)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU")
    print(f"d = {d}, kernel k = {KERNEL}, window r = {WINDOW}; {torch.get_num_threads()} "
          f"threads of {cpu}, torch {torch.__version__}\n")
    print("| n | layer | MFLOPs per token | sequential ops | max path length | "
          "measured us per token | vs self-attention |")
    print("|---|---|---|---|---|---|---|")
    for n in args.lengths:
        times = timed(d, n, args.repeats)
        for kind in times:
            sequential = str(n) if kind == "recurrent" else "1"
            print(f"| {n} | {kind} | {flops(kind, n, d) / n / 1e6:.2f} | {sequential} | "
                  f"{path_length(kind, n)} | {times[kind] * 1e6:.2f} | "
                  f"{times[kind] / times['self-attention']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
