"""`transduce serve` generating under load: continuous batching against whole batches.

Clients on loopback send one prompt per request (the first --prompt-words words of a
test verse, sampled at --temperature with the request's own seed, or greedy at 0; at
most --max-new-tokens, the model's eos ending most earlier). Two servers of the same
model run side by side in child processes: one with continuous batching (prompts join
the running batch between steps and leave it when done), one decoding whole batches
(--static-batches: a batch lasts as long as its longest continuation, and requests that
arrive meanwhile wait). At each concurrency the two are loaded one after the other (the
idle one waits on its socket), each phase stopping after its prompts or its time budget.
Writes JSON with the machine's description.

    python bench/serve_generate.py --model runs/lm/ema --data data/bible-text

With --mixed, prompt i is sent with the settings MIXED[i % 4] (greedy, sampled with and
without top-p, a shorter limit): the continuous server runs them in one batch, the
whole-batch server in batches of one setting each.

Counted on both sides alike: requests answered 200, and the tokens of their generated
text (re-encoded with the model's tokenizer). The outputs of the two servers are
compared, each prompt drawn from the same seed on both: in float32 they must be equal;
in int8 (what the server's --dtype auto picks on a CPU with VNNI) the activations'
scales follow the batch, so a few can differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info  # noqa: E402
from serve import client_load, percentiles, start_server, stop_server  # noqa: E402
from transduce import checkpoint  # noqa: E402
from transduce.data.corpus import TEXT_SUFFIX, read_lines  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# Settings that --mixed sends in turn (over --max-new-tokens and --temperature).
MIXED = [{}, {"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9}, {"max_new_tokens": 32}]


async def load(url: str, prompts: list[str], concurrency: int,
               settings: Callable[[int], dict], seconds: float, timeout: float) -> dict:
    """Prompts continued one per request by `concurrency` clients (serve.py's
    client_load), each with its index as its seed and settings(index) -> statuses,
    latencies, outputs."""
    statuses, latencies, outputs, wall = await client_load(
        url, len(prompts), concurrency, "/v1/generate",
        lambda index: {"prompts": [prompts[index]], "seed": index, **settings(index)},
        lambda answer: answer["generations"][0], seconds, timeout)
    return {"concurrency": concurrency, "seconds": round(wall, 3), "statuses": statuses,
            **percentiles(list(latencies.values())), "outputs": outputs}


MODES = {"continuous": (), "whole_batches": ("--static-batches",)}


def run_phases(args: argparse.Namespace, prompts: list[str]) -> dict[str, list[dict]]:
    """Both servers, warmed up, loaded in turn at each concurrency -> results by mode."""
    base = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    settings = (lambda index: {**base, **MIXED[index % len(MIXED)]}) if args.mixed else \
        (lambda index: base)
    servers: dict[str, tuple] = {}
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        for mode, extra in MODES.items():
            servers[mode] = start_server(args, *extra)
            asyncio.run(load(servers[mode][1], prompts[:16], 4, settings, 60, args.timeout))
        for concurrency in args.concurrency:
            for mode in MODES:
                print(f"  c={concurrency}, {mode.replace('_', ' ')}", flush=True)
                results[mode].append(asyncio.run(load(
                    servers[mode][1], prompts, concurrency, settings, args.phase_seconds,
                    args.timeout)))
    finally:
        for mode, (process, _) in servers.items():
            status = stop_server(process)
            if results[mode]:
                results[mode][-1]["exit_status_after_sigterm"] = status
    return results


def counted(result: dict, tokenizer) -> dict:
    """Requests and generated tokens per second of the phase."""
    texts = list(result["outputs"].values())
    tokens = sum(len(ids) for ids in tokenizer.encode(texts)) if texts else 0
    return {"requests_per_second": round(len(texts) / result["seconds"], 2),
            "tokens_per_second": round(tokens / result["seconds"], 1), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("runs/lm/ema"))
    parser.add_argument("--data", type=Path, default=Path("data/bible-text"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--prompt-words", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--phase-seconds", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--decoders", default="auto")
    parser.add_argument("--mixed", action="store_true",
                        help="send the settings of MIXED in turn, not one setting")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/serve-generate[-mixed]-cpu.json")
    args = parser.parse_args()
    args.out = args.out or REPO / "bench/results" / \
        f"serve-generate{'-mixed' if args.mixed else ''}-cpu.json"
    prompts = [" ".join(line.split()[:args.prompt_words])
               for line in read_lines(args.data / f"{args.split}{TEXT_SUFFIX}")[:args.prompts]]
    tokenizer = checkpoint.load_tokenizer(checkpoint.resolve(args.model))
    phases = run_phases(args, prompts)
    for name, results in phases.items():
        print(f"server, {name.replace('_', ' ')}", flush=True)
        for result in results:
            result.update(counted(result, tokenizer))
            print(f"  c={result['concurrency']}: {result['requests_per_second']} requests/s, "
                  f"{result['tokens_per_second']} tokens/s, p50 {result['p50_ms']} ms, "
                  f"p99 {result['p99_ms']} ms, statuses {result['statuses']}", flush=True)
    for ours, theirs in zip(phases["continuous"], phases["whole_batches"]):
        both = set(ours["outputs"]) & set(theirs["outputs"])
        ours["outputs_differing"] = sum(ours["outputs"][i] != theirs["outputs"][i] for i in both)
        ours["outputs_compared"] = len(both)
        ours["speedup"] = round(ours["tokens_per_second"] / theirs["tokens_per_second"], 3)
        print(f"  c={ours['concurrency']}: continuous {ours['speedup']}x whole batches; "
              f"{ours['outputs_differing']} of {len(both)} outputs differ", flush=True)
    for results in phases.values():
        for result in results:
            result.pop("outputs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine_info(args.threads), "model": str(args.model), "prompts": len(prompts),
        "prompt_words": args.prompt_words, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "mixed": MIXED if args.mixed else None,
        "decoders": args.decoders, **phases}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
