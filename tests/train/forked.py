"""Two training processes without torchrun's start-up: forked from a process that has
imported torch, torch._dynamo and transduce once, with the environment torchrun gives
its workers.

Why: each process torchrun starts imports torch (2 s of CPU on a 2-core EPYC Zen 3)
and, at the optimizer's first construction, torch._dynamo (3 s), and torchrun itself
imports torch: some 12 s of start-up for a two-process run whose training takes a
few. The suite's two-process runs are started here but one, which torchrun starts as
users do (tests/train/test_loop.py).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

# The forking process: reads one request a line (the script, its arguments, a log per
# rank, the environment to add), forks a worker per rank, and answers with their
# process ids and then their exit codes. A worker whose peer failed is stopped (as
# torchrun stops it) after a few seconds in which it may still report its own error.
FORKER = r"""
import json, os, runpy, signal, sys, time, traceback
import torch, torch._dynamo, torch.distributed  # noqa: F401  (what every worker imports)
import transduce.cli, transduce.train.loop  # noqa: F401

def worker(request, rank):
    os.environ.update(request["env"], RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", ROLE_RANK=str(rank))
    log = os.open(request["logs"][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = [request["script"], *request["args"]]
    code = 1
    try:
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as exit:        # sys.exit(n), as the interpreter would end
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

def wait_all(pids):
    codes, failed_at = {}, None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        if failed_at is not None and time.monotonic() - failed_at > 3.0:
            for other in pids:
                if other not in codes:
                    os.kill(other, signal.SIGTERM)
            failed_at = float("inf")
        time.sleep(0.02)
    return [codes[pid] for pid in pids]

for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    pids = []
    for rank in range(request["world"]):
        pid = os.fork()
        if pid == 0:
            worker(request, rank)
        pids.append(pid)
    print(json.dumps({"pids": pids}), flush=True)
    print(json.dumps({"codes": wait_all(pids)}), flush=True)
"""


class _Forker:
    """The forking process of this test process, started at its first use."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def run(self, request: dict, timeout: float) -> list[int]:
        if self.process is None or self.process.poll() is not None:
            from tests.train.test_loop import CPU_ENV
            self.process = subprocess.Popen([sys.executable, "-c", FORKER], env=CPU_ENV,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True)
            atexit.register(self.process.kill)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pids = json.loads(self._line(timeout))["pids"]
        try:
            return json.loads(self._line(timeout))["codes"]
        except TimeoutError:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.kill()
            raise

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the forked workers did not end within {timeout:.0f} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the forking process ended: see the test's stderr")
        return line


_FORKER = _Forker()


def free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def run_forked(script: Path, args: list[str], world: int = 2,
               timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` as `world` workers of one process group on this machine, as
    torchrun --standalone would start them -> their exit status (the first that is not
    0, as torchrun's) and their output, rank 0's first (all of it in stdout)."""
    logs = [script.parent / f"{script.stem}.rank{rank}.log" for rank in range(world)]
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1",
           "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    codes = _FORKER.run({"script": str(script), "args": [str(a) for a in args],
                         "logs": [str(log) for log in logs], "env": env, "world": world},
                        timeout)
    output = "".join(log.read_text(encoding="utf-8") for log in logs)
    return subprocess.CompletedProcess(["forked", str(script), *args],
                                       next((code for code in codes if code), 0), output, "")
