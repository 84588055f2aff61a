"""`transduce serve` under load: throughput and latency against offline translation.

Clients on loopback send one sentence per request at each concurrency (1, 8, 32, 128)
over the test split's lines, to the server with dynamic batching, to the same server
decoding whole batches (--static-batches: no sentence joins a running search) and with
batching off (one request at a time, as servers that serialise requests do). In the
same run, offline translation of the same lines (Translator.translate as `transduce
translate` runs it, two workers on two cores and freed memory kept: the ceiling, timed
before the servers and after them, and averaged, as this host's speed drifts). One
client's latency is compared with translating the sentence directly (the floor) in
pairs: a process holding a Translator stays up beside the server, and for each
sentence one request to the server and one direct translation alternate, in turn
first, so that the host's drift falls on both sides alike. Last, 128 clients against a
small queue: the excess must get 429, none a 5xx, none hang. The server runs in a child
process; every phase stops after its line count or its time budget, whichever comes
first. Writes JSON with the machine's description.

    python bench/serve.py --model runs/small/average --data data/bible

Sentences/s count requests answered 200 (one sentence each). Outputs are compared with
the offline translations: batching must not change one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback_http import HttpError, LoopbackConnection  # noqa: E402
from measure import machine_info  # noqa: E402
from transduce.data.corpus import read_lines, split_files  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def default_model() -> Path | None:
    """The best translation model under runs/ by its test BLEU (`transduce evaluate`'s
    eval-test-beam4.json), else the newest average or ema; None if there is none."""
    found = []
    for config in (REPO / "runs").glob("**/config.json"):
        directory = config.parent
        if directory.name not in ("average", "ema"):
            continue
        arch = json.loads(config.read_text()).get("model", {}).get("arch", "transformer")
        if arch not in ("transformer", "rnn"):
            continue
        scores = directory / "eval-test-beam4.json"
        bleu = json.loads(scores.read_text()).get("bleu", 0.0) if scores.is_file() else -1.0
        found.append((bleu, config.stat().st_mtime, directory))
    return max(found)[2] if found else None


def percentiles(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None}
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)
    return {"p50_ms": at(0.50), "p95_ms": at(0.95), "p99_ms": at(0.99)}


def cli_translator(args: argparse.Namespace):
    """A Translator as `transduce translate` makes one: its dtype, workers and process
    settings."""
    import torch

    from transduce.decode.translate import Translator
    from transduce.runtime import keep_freed_memory

    torch.set_num_threads(args.threads)
    keep_freed_memory()                 # what `transduce translate` sets for its process
    return Translator.load(args.model, dtype="auto", workers="auto")   # the CLI's defaults


def offline_child(args: argparse.Namespace) -> None:
    """Child process: time the whole split through Translator.translate as `transduce
    translate` runs it (the ceiling); print JSON."""
    translator = cli_translator(args)
    lines = json.loads(Path(args.offline_child).read_text())
    translator.translate(lines[:16], beam=args.beam)                  # warm up
    started = time.perf_counter()
    outputs = translator.translate(lines, beam=args.beam)
    seconds = time.perf_counter() - started
    print(json.dumps({"outputs": outputs, "seconds": seconds}))


def direct_child(args: argparse.Namespace) -> None:
    """Child process: for each JSON line on stdin (one sentence), translate it alone and
    answer a JSON line with the seconds it took."""
    translator = cli_translator(args)
    print(json.dumps({"ready": True}), flush=True)
    for request in sys.stdin:
        started = time.perf_counter()
        translator.translate([json.loads(request)], beam=args.beam)
        print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)


def paired_latency(args: argparse.Namespace, url: str, lines: list[str]) -> dict:
    """One client: each sentence sent to the server and translated directly in a process
    of its own, alternately (the server first for even lines) -> both sides' latency
    percentiles on the same sentences, the same spell of the host."""
    direct = subprocess.Popen(
        [sys.executable, __file__, "--direct-child", "--model", str(args.model), "--beam",
         str(args.beam), "--threads", str(args.threads)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")})

    def alone(line: str) -> float:
        direct.stdin.write(json.dumps(line) + "\n")
        direct.stdin.flush()
        return json.loads(direct.stdout.readline())["seconds"]

    def served(http: httpx.Client, line: str) -> float:
        started = time.perf_counter()
        http.post(f"{url}/v1/translate", json={"texts": [line], "beam": args.beam}
                  ).raise_for_status()
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"served": [], "direct": []}
    deadline = time.monotonic() + args.phase_seconds
    try:
        json.loads(direct.stdout.readline())                   # loaded
        with httpx.Client(timeout=args.timeout) as http:
            for line in lines[:16]:                            # warm up both
                served(http, line)
                alone(line)
            for index, line in enumerate(lines[:args.direct_lines]):
                if time.monotonic() > deadline:
                    break
                if index % 2 == 0:
                    times["served"].append(served(http, line))
                    times["direct"].append(alone(line))
                else:
                    times["direct"].append(alone(line))
                    times["served"].append(served(http, line))
    finally:
        direct.stdin.close()
        direct.wait(60)
    return {"sentences": len(times["served"]),
            **{side: percentiles(values) for side, values in times.items()}}


def start_server(args: argparse.Namespace, *extra: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tempfile.TemporaryFile()           # the server's log, read if it fails to start
    process = subprocess.Popen(
        [sys.executable, "-m", "transduce", "serve", "--model", str(args.model), "--port",
         str(port), "--threads", str(args.threads), "--decoders", args.decoders, *extra],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with status {process.returncode}: "
                               f"{log.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start in 120 s")


def stop_server(process: subprocess.Popen) -> int:
    """SIGTERM -> the exit status (0 when it drained and stopped)."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        return -9


async def client_load(url: str, count: int, concurrency: int, path: str,
                      body: Callable[[int], dict], output: Callable[[dict], Any],
                      seconds: float, timeout: float) -> tuple[dict, dict, dict, float]:
    """`concurrency` clients, each on its keep-alive connection (loopback_http.py: the
    clients share the server's cores), posting body(i) to `path` for the next unsent i
    of `count` until none is left or the time is up -> (statuses, latencies and outputs
    by index, of the answers 200, seconds)."""
    next_index, outputs, latencies = iter(range(count)), {}, {}
    statuses: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def client() -> None:
        connection = LoopbackConnection(host, int(port))
        try:
            for index in next_index:
                if time.monotonic() > deadline:
                    return
                started = time.perf_counter()
                try:
                    status, answer = await asyncio.wait_for(
                        connection.post(path, body(index)), timeout)
                    status = str(status)
                except asyncio.TimeoutError:
                    status = "timeout"
                    await connection.close()
                except (HttpError, OSError) as error:
                    status = type(error).__name__
                statuses[status] = statuses.get(status, 0) + 1
                if status == "200":
                    latencies[index] = time.perf_counter() - started
                    outputs[index] = output(answer)
        finally:
            await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return statuses, latencies, outputs, time.perf_counter() - started


async def load(url: str, lines: list[str], concurrency: int, beam: int, seconds: float,
               timeout: float) -> dict:
    """Lines translated one per request by `concurrency` clients (client_load) ->
    statuses, latencies, outputs by line."""
    statuses, latencies, outputs, wall = await client_load(
        url, len(lines), concurrency, "/v1/translate",
        lambda index: {"texts": [lines[index]], "beam": beam},
        lambda answer: answer["translations"][0]["text"], seconds, timeout)
    return {"concurrency": concurrency, "seconds": round(wall, 3), "statuses": statuses,
            "sentences_per_second": round(len(latencies) / wall, 2),
            **percentiles(list(latencies.values())),
            "errors": sum(n for s, n in statuses.items() if s != "200"), "outputs": outputs}


def run_server_phases(args, lines, extra: tuple[str, ...], levels: list[int]) -> list[dict]:
    if not levels:              # none of --concurrency is one this server is measured at
        return []
    process, url = start_server(args, *extra)
    try:
        asyncio.run(load(url, lines[:32], 4, args.beam, 60, args.timeout))   # warm up
        results = []
        for concurrency in levels:
            result = asyncio.run(load(url, lines, concurrency, args.beam, args.phase_seconds,
                                      args.timeout))
            results.append(result)
            print(f"  {' '.join(extra) or 'batching'} c={concurrency}: "
                  f"{result['sentences_per_second']} sentences/s, p99 {result['p99_ms']} ms, "
                  f"statuses {result['statuses']}", flush=True)
    finally:
        status = stop_server(process)
    results[-1]["exit_status_after_sigterm"] = status
    return results


def run_pairs(args: argparse.Namespace, lines: list[str]) -> dict:
    """The batching server at one client against direct translation, in pairs."""
    process, url = start_server(args)
    try:
        pairs = paired_latency(args, url, lines)
    finally:
        stop_server(process)
    print(f"  {pairs['sentences']} sentences: p99 served {pairs['served']['p99_ms']} ms, "
          f"direct {pairs['direct']['p99_ms']} ms", flush=True)
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model())
    parser.add_argument("--data", type=Path, default=REPO / "data" / "bible")
    parser.add_argument("--split", default="test")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--phase-seconds", type=float, default=300.0,
                        help="each phase stops after this long, lines sent or not")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="a request unanswered after this long counts as hung")
    parser.add_argument("--direct-lines", type=int, default=200,
                        help="sentences of the one-client pairs (served and direct)")
    parser.add_argument("--small-queue", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--decoders", default="auto",
                        help="the server's --decoders (auto: 2 on a CPU with 2+ threads)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/serve-cpu.json")
    parser.add_argument("--offline-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--direct-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        parser.error("no trained model under runs/: pass --model")
    if args.offline_child:
        return offline_child(args)
    if args.direct_child:
        return direct_child(args)
    source, _ = split_files(args.data, args.split)
    lines = [line for line in read_lines(source)[:args.lines]]
    report(args, lines, measure(args, lines))


def measure(args: argparse.Namespace, lines: list[str]) -> dict:
    """Every phase, one after the other (never two timed processes at once)."""
    print(f"offline: {len(lines)} lines, beam {args.beam}", flush=True)
    offline = offline_run(args, lines)
    print(f"  {len(lines) / offline['seconds']:.2f} sentences/s offline", flush=True)
    print("server, dynamic batching", flush=True)
    batched = run_server_phases(args, lines, (), args.concurrency)
    print("server, whole batches (no continuous batching)", flush=True)
    static = run_server_phases(args, lines, ("--static-batches",),
                               [c for c in args.concurrency if c in (8, 32)])
    print("server, batching off", flush=True)
    unbatched = run_server_phases(args, lines, ("--no-batching",),
                                  [c for c in args.concurrency if c <= 32])
    print(f"server, queue of {args.small_queue}, {max(args.concurrency)} clients", flush=True)
    overload = run_server_phases(args, lines, ("--max-queue", str(args.small_queue)),
                                 [max(args.concurrency)])
    print("one client: served and direct, alternating", flush=True)
    pairs = run_pairs(args, lines)
    print("offline again (the host's speed drifts: the ceiling is the mean of both)", flush=True)
    offline["seconds_after"] = offline_run(args, lines)["seconds"]
    print(f"  {len(lines) / offline['seconds_after']:.2f} sentences/s offline", flush=True)
    return {"offline": offline, "batched": batched, "static": static,
            "unbatched": unbatched, "overload": overload[0], "pairs": pairs}


def offline_run(args: argparse.Namespace, lines: list[str]) -> dict:
    scratch = args.out.with_suffix(".lines.json")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    scratch.write_text(json.dumps(lines))
    try:
        child = subprocess.run(
            [sys.executable, __file__, "--offline-child", str(scratch), "--model",
             str(args.model), "--beam", str(args.beam), "--threads", str(args.threads),
             "--phase-seconds", str(args.phase_seconds)],
            capture_output=True, text=True, check=True)
    finally:
        scratch.unlink()
    return json.loads(child.stdout.splitlines()[-1])


def _shown(value):
    """A setting as the JSON records it: paths inside the repository relative to it."""
    if not isinstance(value, Path):
        return value
    resolved = value.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(value)


def report(args: argparse.Namespace, lines: list[str], found: dict) -> None:
    offline = found["offline"]
    rates = [len(lines) / offline["seconds"], len(lines) / offline["seconds_after"]]
    ceiling = sum(rates) / 2
    for phase in found["batched"] + found["static"] + found["unbatched"] + [found["overload"]]:
        outputs = phase.pop("outputs")
        phase["outputs_differing_from_offline"] = sum(
            1 for i, text in outputs.items() if text != offline["outputs"][i])
        phase["fraction_of_offline"] = round(phase["sentences_per_second"] / ceiling, 3)
    by_level = {r["concurrency"]: r for r in found["batched"]}
    unbatched = {r["concurrency"]: r for r in found["unbatched"]}
    goals = {}
    if 32 in by_level and 32 in unbatched:
        goals["c32_fraction_of_offline"] = by_level[32]["fraction_of_offline"]
        goals["c32_over_unbatched"] = round(by_level[32]["sentences_per_second"]
                                            / max(unbatched[32]["sentences_per_second"], 1e-9), 2)
    static = {r["concurrency"]: r for r in found["static"]}
    if 32 in by_level and 32 in static:
        goals["c32_over_whole_batches"] = round(by_level[32]["sentences_per_second"]
                                                / max(static[32]["sentences_per_second"], 1e-9), 2)
    pairs = found["pairs"]     # the same sentences, served one at a time and translated directly
    if pairs["sentences"]:
        served, alone = pairs["served"]["p99_ms"], pairs["direct"]["p99_ms"]
        goals["c1_p99_over_direct_p99"] = round(served / alone, 3)
        goals["c1_p99_ms_and_direct_p99_ms_on_the_same_sentences"] = [served, alone]
        goals["c1_p50_over_direct_p50"] = round(pairs["served"]["p50_ms"]
                                                / pairs["direct"]["p50_ms"], 3)
    overload = found["overload"]
    goals["overload_429"] = overload["statuses"].get("429", 0)
    goals["overload_5xx"] = sum(n for s, n in overload["statuses"].items() if s.startswith("5"))
    goals["overload_hung"] = overload["statuses"].get("timeout", 0)
    result = {"machine": machine_info(args.threads),
              "settings": {k: _shown(v) for k, v in vars(args).items() if k != "offline_child"},
              "offline": {"lines": len(lines), "seconds": round(offline["seconds"], 3),
                          "seconds_after_the_servers": round(offline["seconds_after"], 3),
                          "sentences_per_second": round(ceiling, 2),
                          "sentences_per_second_before_and_after": [round(r, 2) for r in rates]},
              "one_client_pairs": pairs,
              "batched": found["batched"], "whole_batches": found["static"],
              "unbatched": found["unbatched"],
              "overload": overload, "goals": goals}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(goals, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
