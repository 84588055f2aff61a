"""`transduce serve` answering attention maps while it translates under load.

An attention-map request is not decoded in the running search (its pass records the
weights): the server runs it between two steps of the search when the search runs on
one decoder, and waits for one of two decoders to finish when both work. This measures
what that costs the map's client and the others: --clients loopback clients translate
one test verse per request at --beam, while one more asks for a verse's maps every
--interval seconds; the server runs with each --decoders in turn (a fresh server each,
the same lines and order). Writes the latencies of the maps, the translations' rate and
statuses, with the machine's description, to JSON.

    python bench/serve_attention.py --model runs/small/ema --data data/bible
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info  # noqa: E402
from serve import client_load, default_model, start_server, stop_server  # noqa: E402
from transduce.data.corpus import read_lines, split_files  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


async def maps_while_translating(url: str, lines: list[str], args: argparse.Namespace
                                 ) -> dict:
    """The clients' load and the maps' requests side by side -> the phase's figures."""
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    stop = time.monotonic() + args.seconds

    async def maps() -> None:
        async with httpx.AsyncClient(timeout=args.seconds) as client:
            await asyncio.sleep(args.interval)          # the load first
            while time.monotonic() < stop - args.interval:
                started = time.perf_counter()
                answer = await client.post(f"{url}/v1/attention", json={
                    "text": lines[len(latencies) % len(lines)], "layers": [1]})
                statuses[str(answer.status_code)] = statuses.get(str(answer.status_code),
                                                                 0) + 1
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(args.interval)

    load = client_load(url, 10 ** 9, args.clients, "/v1/translate",
                       lambda index: {"texts": [lines[index % len(lines)]], "beam": args.beam},
                       lambda answer: None, args.seconds, args.seconds)
    (load_statuses, translated, _, wall), _ = await asyncio.gather(load, maps())
    return {"map_requests": len(latencies), "map_statuses": statuses,
            "map_p50_ms": round(1000 * statistics.median(latencies), 1) if latencies else None,
            "map_max_ms": round(1000 * max(latencies), 1) if latencies else None,
            "translations_per_second": round(len(translated) / wall, 2),
            "translation_statuses": load_statuses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model())
    parser.add_argument("--data", type=Path, default=REPO / "data" / "bible")
    parser.add_argument("--split", default="test")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--decoders", nargs="+", default=["1", "auto"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench/results/serve-attention-cpu.json")
    args = parser.parse_args()
    if args.model is None:
        parser.error("--model: no translation model under runs/; train one or name it")
    source = split_files(args.data, args.split)[0]
    lines = [line for line in read_lines(source) if line.strip()][:1000]
    phases = []
    for decoders in args.decoders:
        server = argparse.Namespace(model=args.model, threads=args.threads, decoders=decoders)
        process, url = start_server(server)
        try:
            asyncio.run(client_load(url, 32, 4, "/v1/translate",            # warm up
                                    lambda index: {"texts": [lines[index]], "beam": args.beam},
                                    lambda answer: None, 60, 60))
            phase = {"decoders": decoders, **asyncio.run(maps_while_translating(url, lines,
                                                                                args))}
        finally:
            stop_server(process)
        phases.append(phase)
        print(f"--decoders {decoders}: maps p50 {phase['map_p50_ms']} ms, max "
              f"{phase['map_max_ms']} ms ({phase['map_requests']}, {phase['map_statuses']}); "
              f"{phase['translations_per_second']} translations/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine_info(args.threads), "model": str(args.model.relative_to(REPO))
        if args.model.is_absolute() and args.model.is_relative_to(REPO) else str(args.model),
        "clients": args.clients, "beam": args.beam, "interval_s": args.interval,
        "seconds": args.seconds, "phases": phases}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
