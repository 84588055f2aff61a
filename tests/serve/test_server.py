"""A real server on 127.0.0.1: many concurrent clients get exactly the offline outputs,
batched; a small queue sheds the excess with 429 and nothing else; SIGTERM drains the
requests in flight, refuses new ones, and the process exits 0."""

import concurrent.futures
import functools
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from transduce import load
from transduce.serve import Limits, create_app
from transduce.serve.server import DrainingServer
from tests.environment import subprocess_env

REPO = Path(__file__).resolve().parents[2]
WORDS = ["uno", "dos", "tres", "casa", "perro", "gato", "rojo", "grande", "el", "come"]


class ServerThread:
    """uvicorn serving an app on a free loopback port, in a thread of this process."""

    def __init__(self, app):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="on"))
        # A daemon: a server that outlives its test (a client's connection held open)
        # must not keep the test process from exiting.
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.02)
        return self

    def __exit__(self, *_):
        self.server.should_exit = True
        self.thread.join(15)
        if self.thread.is_alive():     # connections that do not close: stop waiting for them
            self.server.force_exit = True
            self.thread.join(15)
        self.socket.close()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 7))) for _ in range(count)]


@pytest.mark.parametrize("decoders,processes", [(1, False), (2, False), (2, True)])
def test_concurrent_clients_get_the_offline_outputs_in_order(translator, translation_dir,
                                                               decoders, processes):
    requests = []            # (texts, beam): varied lengths, one to four texts, greedy and beam
    rng = random.Random(1)
    for index in range(32):
        requests.append((sentences(rng.randint(1, 3), seed=index), rng.choice([1, 1, 3])))
    # offline: every sentence of a beam setting in one call, as `transduce translate` would
    offline = {beam: dict(zip(lines, translator.translate(lines, beam=beam))) for beam in (1, 3)
               for lines in [sorted({t for texts, b in requests if b == beam for t in texts})]}
    expected = [[offline[beam][t] for t in texts] for texts, beam in requests]
    for beam, outputs in offline.items():           # and each alone gives the same
        for text in sorted(outputs)[:6]:
            assert translator.translate([text], beam=beam) == [outputs[text]]
    reload = functools.partial(load, translation_dir) if processes else None
    app = create_app(translator, limits=Limits(window_ms=20, max_queue=256, decoders=decoders),
                     reload=reload)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        def ask(request):
            texts, beam = request
            answer = client.post("/v1/translate", json={"texts": texts, "beam": beam})
            assert answer.status_code == 200, answer.text
            return [t["text"] for t in answer.json()["translations"]]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(ask, requests))
        metrics = client.get("/metrics").text
    assert got == expected
    sentences_total = int(re.search(r"^transduce_sentences_total (\d+)$", metrics, re.M)[1])
    assert sentences_total == sum(len(texts) for texts, _ in requests)
    # A request holds at most 3 texts: a batch (or decoding step) of more than 4
    # sentences decoded several requests together.
    batches = int(re.search(r"^transduce_batch_sentences_count (\d+)$", metrics, re.M)[1])
    up_to_4 = int(re.search(r'^transduce_batch_sentences_bucket\{le="4"\} (\d+)$', metrics,
                            re.M)[1])
    assert up_to_4 < batches, "concurrent requests were never batched together"


def test_a_small_queue_sheds_load_with_429_and_no_5xx(translator):
    app = create_app(translator, limits=Limits(max_queue=2, window_ms=0))
    texts = sentences(16, seed=3)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        def ask(_):
            answer = client.post("/v1/translate", json={"texts": texts, "beam": 4})
            return answer.status_code, answer.headers.get("retry-after")

        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(ask, range(24)))
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {200, 429} and statuses.count(429) > 0 and statuses.count(200) >= 3
    assert all(retry and int(retry) >= 1 for status, retry in answers if status == 429)


def test_serve_leaves_the_signal_handlers_as_it_found_them(translator):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = DrainingServer(uvicorn.Config(create_app(translator)))
    with server.capture_signals():
        assert signal.getsignal(signal.SIGTERM) == server._on_signal
        signal.raise_signal(signal.SIGTERM)           # only asks the server to stop
        assert server.should_exit
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_sigterm_drains_in_flight_requests_then_exits_zero(translation_dir, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = subprocess_env()
    process = subprocess.Popen(
        # Small decoding batches, so that each request takes a good second to decode and
        # all four are still in flight when the signal comes, however fast the machine.
        [sys.executable, "-m", "transduce", "serve", "--model", str(translation_dir),
         "--port", str(port), "--threads", "1", "--batch-tokens", "64"], env=environment,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url, process)
        texts = sentences(480, seed=5)

        def ask(part):
            answer = httpx.post(f"{url}/v1/translate", timeout=120,
                                json={"texts": texts[part::4], "beam": 8})
            return answer, time.monotonic()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            slow = [pool.submit(ask, part) for part in range(4)]
            time.sleep(0.3)                    # the requests are queued or decoding
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.3)
            with pytest.raises(httpx.ConnectError):
                httpx.post(f"{url}/v1/translate", json={"texts": ["uno"]}, timeout=5)
            answers, finished = zip(*(future.result() for future in slow))
        assert min(finished) > signalled, "no request was in flight at SIGTERM"
        assert [a.status_code for a in answers] == [200] * 4
        assert all(len(a.json()["translations"]) == 120 for a in answers)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        output = process.stdout.read()
    assert f"Listening on {url}" in output
    assert f"Serving {translation_dir.name}: a translation model" in output
    assert "Waiting for connections to close" in output or "Shutting down" in output


def _wait_until_up(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the server did not start")
