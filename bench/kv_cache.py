"""Decoding speed by KV-cache kind: float32, int8, int4 and a sliding window, the same
weights, interleaved.

0. One decoding step's attention alone (one query per row over S cached keys, B rows, H
   heads of 64): over a float32 cache, PyTorch's SDPA (what decoding runs) and the two
   batched products and a softmax (`impl="naive"`); over int8 and int4 caches,
   dequantize-then-SDPA (the caches' former step) against the compiled kernel that
   reads the integers (attention/quantized.py). Counted: microseconds per call.
1. Decode steps alone on a decoder-only model (random weights, `--preset`, default
   gpt-small: 4 layers of 256, 4 heads of 64, where the cache is most of a step's
   reading), the float32 decoding copy that Generator uses: prefill a prompt of each
   --prompt-lengths (not timed), then time --new-tokens greedy single-token steps, at each
   --batches. Counted: batch x new tokens per second of the steps. The sliding window
   (--window tokens) is a model of the same weights with attention_type "sliding".
2. With --model RUN --data DIR: translation of the test split (beam --beam, batches of
   --batch-sentences sentences sorted by length, as `transduce translate` does) by
   float32, int8 and int4 caches. Counted: sentences/s of the whole call; sacreBLEU of each.

    python bench/kv_cache.py [--model runs/small/ema --data data/bible] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce.attention.kernels import _naive, _sdpa  # noqa: E402
from transduce.attention.kv_cache import (dequantize_int4, dequantize_int8,  # noqa: E402
                                          quantize_int4, quantize_int8)
from transduce.attention.quantized import quantized_decode_attention  # noqa: E402
from transduce.config import preset  # noqa: E402
from transduce.data.corpus import read_lines  # noqa: E402
from transduce.decode.translate import Translator  # noqa: E402
from transduce.model import build_model  # noqa: E402
from transduce.model.packed import decoding_copy  # noqa: E402

CACHE_DTYPES = {"float32": None, "int8": torch.int8, "int4": torch.int4}


def attention_alone(args: argparse.Namespace) -> list[dict]:
    """Microseconds per decoding step's attention, by kernel and cache kind."""
    rows = []
    for batch, heads, keys in args.attention_shapes:
        torch.manual_seed(0)
        q = torch.randn(batch, heads, 1, 64)
        k, v = torch.randn(batch, heads, keys, 64), torch.randn(batch, heads, keys, 64)
        (k8, k8s), (v8, v8s) = quantize_int8(k), quantize_int8(v)
        (k4, k4s), (v4, v4s) = quantize_int4(k, 32), quantize_int4(v, 32)
        scale = 64 ** -0.5
        calls = {
            "float32 sdpa": lambda: _sdpa(q, k, v, None, False, 0.0, scale),
            "float32 products": lambda: _naive(q, k, v, None, False, 0.0, scale),
            "int8 dequantize + sdpa": lambda: _sdpa(
                q, dequantize_int8(k8, k8s, torch.float32),
                dequantize_int8(v8, v8s, torch.float32), None, False, 0.0, scale),
            "int8 kernel": lambda: quantized_decode_attention(q, k8, k8s, v8, v8s),
            "int4 dequantize + sdpa": lambda: _sdpa(
                q, dequantize_int4(k4, k4s, torch.float32),
                dequantize_int4(v4, v4s, torch.float32), None, False, 0.0, scale),
            "int4 kernel": lambda: quantized_decode_attention(q, k4, k4s, v4, v4s)}
        with torch.inference_mode():
            times = time_interleaved({name: repeated(call, 20) for name, call in calls.items()},
                                     args.repeats)
        record = {"batch": batch, "heads": heads, "keys": keys}
        for name in calls:
            record[name] = statistics.median(times[name]) / 20 * 1e6
        print(f"attention B={batch} H={heads} S={keys}: " + ", ".join(
            f"{name} {record[name]:.0f} us ({record[name] / record['float32 sdpa']:.2f}x)"
            for name in calls), flush=True)
        rows.append(record)
    return rows


def repeated(call, times: int):
    def calls():
        for _ in range(times):
            call()
    return calls


def time_decode_steps(model, prompt: torch.Tensor, steps: int, cache_dtype) -> float:
    """Prefill the prompt (untimed), then time `steps` greedy single-token steps
    -> seconds."""
    with torch.inference_mode():
        state = model.prefill(prompt, steps + 1, cache_dtype=cache_dtype)
        token = prompt[:, -1:]
        start = time.perf_counter()
        for _ in range(steps):
            token = model.decode_step(token, state)[:, -1].argmax(dim=-1, keepdim=True)
        return time.perf_counter() - start


def decode_steps(args: argparse.Namespace) -> list[dict]:
    """Tokens/s of decode steps by cache kind, prompt length and batch."""
    torch.manual_seed(0)
    model = build_model(preset(args.preset)).eval()
    sliding = build_model(model.config.replace(attention_type="sliding",
                                               attention_window=args.window)).eval()
    sliding.load_state_dict(model.state_dict())
    packed = decoding_copy(model)
    kinds = {name: (packed, dtype) for name, dtype in CACHE_DTYPES.items()}
    kinds[f"sliding {args.window}"] = (decoding_copy(sliding), None)
    rows = []
    for length in args.prompt_lengths:
        for batch in args.batches:
            generator = torch.Generator().manual_seed(length)
            prompt = torch.randint(0, model.config.tgt_vocab_size - 1, (batch, length),
                                   generator=generator)
            times: dict[str, list[float]] = {name: [] for name in kinds}
            for repeat in range(args.repeats + 1):          # the first round warms up
                for name, (net, dtype) in kinds.items():
                    seconds = time_decode_steps(net, prompt, args.new_tokens, dtype)
                    if repeat:
                        times[name].append(seconds)
            record = {"prompt_length": length, "batch": batch}
            for name in kinds:
                record[name] = batch * args.new_tokens / statistics.median(times[name])
            print(f"prompt {length:4d}, batch {batch:2d}: decode tok/s " + ", ".join(
                f"{name} {record[name]:.1f} ({record[name] / record['float32']:.2f}x)"
                for name in kinds), flush=True)
            rows.append(record)
    return rows


def translation(args: argparse.Namespace) -> list[dict]:
    """Sentences/s and BLEU of the test split by cache kind, interleaved."""
    sources = read_lines(args.data / "test.es")
    references = read_lines(args.data / "test.en")
    translators = {name: Translator.load(args.model, kv_dtype=None if name == "float32" else name)
                   for name in CACHE_DTYPES}
    outputs: dict[str, list[str]] = {}

    def run(name: str):
        def call():
            outputs[name] = translators[name].translate(
                sources, beam=args.beam, batch_sentences=args.batch_sentences)
        return call

    times = time_interleaved({name: run(name) for name in translators}, args.repeats)
    rows = []
    for name in translators:
        seconds = statistics.median(times[name])
        bleu = sacrebleu.corpus_bleu(outputs[name], [references]).score
        rows.append({"kv_dtype": name, "sentences_per_s": len(sources) / seconds,
                     "bleu": round(bleu, 2), "sentences": len(sources)})
    for row in rows:
        row["ratio_to_float32"] = row["sentences_per_s"] / rows[0]["sentences_per_s"]
        print(f"translation, beam {args.beam}, batches of {args.batch_sentences}: "
              f"{row['kv_dtype']} {row['sentences_per_s']:.1f} sentences/s "
              f"({row['ratio_to_float32']:.2f}x), BLEU {row['bleu']}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention-shapes", type=lambda text: tuple(map(int, text.split("x"))),
                        nargs="+", default=[(128, 4, 32), (256, 4, 64), (8, 12, 768),
                                            (64, 12, 256)],
                        help="BxHxS shapes for part 0")
    parser.add_argument("--preset", default="gpt-small")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 448])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--model", type=Path, help="a translation checkpoint (part 2)")
    parser.add_argument("--data", type=Path, help="its corpus directory (test split)")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--batch-sentences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-steps", action="store_true", help="only part 2")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv-cache-cpu.json"))
    args = parser.parse_args()
    if (args.model is None) != (args.data is None):
        parser.error("--model and --data go together")
    torch.set_num_threads(args.threads)
    started = time.time()
    result = {"machine": machine_info(args.threads),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if not args.skip_steps:
        result["attention_alone"] = attention_alone(args)
        result["decode_steps"] = decode_steps(args)
    if args.model is not None:
        result["translation"] = translation(args)
    result["seconds"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
