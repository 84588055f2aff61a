"""The continuous search's attention: the one-query kernel (attention/one_query.py)
against PyTorch's SDPA, the same rows, caches and weights, interleaved, at --threads
threads (one by default).

1. One layer's self-attention alone: R rows (sentences x beam 4) of 4 heads of 64, one
   query each, over a cache window of W slots in which runs of sentences joined at
   different slots (each row reads its own slots only). Peers: the kernel (one call,
   each row its own range), SDPA once per run (what the step did before), and SDPA
   once over the whole window with the slots a row does not own masked. Counted:
   microseconds per call (all R rows).
2. With --model RUN --data DIR: a continuous beam search (decode/continuous.py) of the
   test split's first --lines sentences, --running at a time, newcomers joining as
   sentences finish, through the decoding copy's written-out step: self-attention's
   runs and cross-attention's sources read by the kernel, or by SDPA (a call per run,
   and one over the widest source with a mask), alternating rounds in one process.
   Counted: sentences per second of each round.

    python bench/one_query.py [--model runs/small/ema --data data/bible]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import alternating_rates, continuous_search, machine_info, time_interleaved  # noqa: E402
from transduce.attention import one_query  # noqa: E402

HEADS, HEAD_DIM, BEAM, INNER = 4, 64, 4, 20


def attention_alone(sentences: int, window: int, run_size: int, repeats: int) -> dict:
    """Microseconds per call of each peer; runs of `run_size` sentences, each run
    joining `window // runs` slots after the one before."""
    torch.manual_seed(0)
    rows, runs = sentences * BEAM, -(-sentences // run_size)
    k = torch.randn(rows, HEADS, 2 * window, HEAD_DIM)[:, :, :window]
    v = torch.randn(rows, HEADS, 2 * window, HEAD_DIM)[:, :, :window]
    q = torch.randn(rows, HEADS, 1, HEAD_DIM)
    bounds = [(r * run_size * BEAM, min(rows, (r + 1) * run_size * BEAM), r * window // runs)
              for r in range(runs)]
    starts = torch.tensor([s for first, last, s in bounds for _ in range(last - first)])
    ends = torch.full((rows,), window)
    hidden = (torch.arange(window) < starts[:, None])[:, None, None, :]
    scale = HEAD_DIM ** -0.5

    def kernel():
        return one_query.one_query_attention(q, k, v, starts, ends, scale)

    def per_run():
        return torch.cat([F.scaled_dot_product_attention(q[a:b], k[a:b, :, s:], v[a:b, :, s:],
                                                         scale=scale) for a, b, s in bounds])

    def masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, scale=scale)

    peers = {"kernel": kernel, "sdpa_per_run": per_run, "sdpa_masked": masked}
    reference = per_run()
    for name, call in peers.items():
        torch.testing.assert_close(call(), reference, atol=1e-5, rtol=1e-5, msg=name)
    times = time_interleaved({name: lambda c=call: [c() for _ in range(INNER)]
                              for name, call in peers.items()}, repeats)
    micros = {name: round(statistics.median(t) / INNER * 1e6, 1) for name, t in times.items()}
    return {"sentences": sentences, "rows": rows, "window": window, "runs": runs,
            "keys_read_per_row": round(float((window - starts).float().mean()), 1),
            "microseconds": micros,
            "sdpa_per_run_over_kernel": round(micros["sdpa_per_run"] / micros["kernel"], 2)}


def search(args: argparse.Namespace) -> dict:
    """Sentences per second of the continuous search, kernel against SDPA."""
    from transduce.data.corpus import read_lines
    from transduce.decode.translate import Translator
    from transduce.model.decoder_step import DecoderStep

    translator = Translator.load(args.model, dtype=args.dtype)
    ids = translator.encode(read_lines(Path(args.data) / "test.es")[:args.lines])
    decoder = translator.model.decoder
    layers = {name: DecoderStep(decoder, kernel=name == "kernel") for name in ("kernel", "sdpa")}

    def run(name: str) -> tuple[float, list]:
        decoder.fast_step = layers[name]
        return continuous_search(translator.model, ids, args.running, BEAM)

    found = alternating_rates({name: lambda name=name: run(name) for name in layers},
                              args.rounds)
    return {"model": str(args.model), "dtype": args.dtype, "lines": len(ids),
            "running": args.running, **found,
            "kernel_over_sdpa": round(found["medians"]["kernel"] / found["medians"]["sdpa"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--running", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" /
                        "one-query-cpu.json")
    args = parser.parse_args()
    if not one_query.available():
        sys.exit("the one-query kernel could not be built here (g++ and ninja are needed)")
    torch.set_num_threads(args.threads)
    result = {"machine": machine_info(args.threads), "alone": []}
    for sentences, window, run_size in [(16, 32, 4), (16, 64, 1), (16, 64, 4), (16, 128, 2),
                                        (32, 64, 2), (4, 64, 1)]:
        row = attention_alone(sentences, window, run_size, args.repeats)
        print(json.dumps(row), flush=True)
        result["alone"].append(row)
    if args.model is not None:
        result["search"] = search(args)
        print(json.dumps(result["search"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
