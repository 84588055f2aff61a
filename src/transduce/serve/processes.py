"""Decoding processes: continuous translation streams decoded outside the server's process.

Decoding threads in one process share its interpreter lock with each other and with the
event loop, and between its steps each waits for it: at 32 clients, with two decoding
threads, a tenth of two cores sat idle. A DecoderProcess loads its own copy of the model
and decodes the TranslationStreams of one decoder of the batcher (batcher.py), whose
thread only forwards: the jobs it admits (their texts), the cores it may use, and per
step the jobs done. Two streams of 16 sentences, one per process, decoded 1.11x as fast
as the same two in threads of one process (2-core Zen 4, int8, no HTTP).

The process does not wait for its decoder thread between steps: it steps while
sentences run, reads what arrived in between, and sends one report per step, which the
thread reads in order (RemoteTranslationStream.step). It runs the in-process stream's
search on the same model, loaded the same way: in float32 every sentence gets what it
gets alone (tested through a real server). The server's first decoder stays in its
process (app.py's decoder_processes says why).

A process ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process
group, and the server drains first): it stops when told to, or when its server is gone.
One that dies is started again for the next stream; the jobs it held fail.
"""

from __future__ import annotations

import itertools
import multiprocessing
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterable, Sequence

import torch

from transduce.decode.translate import Translator
from transduce.serve.batcher import Job
from transduce.serve.continuous import TranslationStream

START_TIMEOUT_S = 600.0    # loading, and compiling the decoder step on the warm-up
STOP_TIMEOUT_S = 30.0
WARM_UP_WORDS = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()


class DecoderProcessFailed(RuntimeError):
    """A decoding process could not start, or died while it held jobs."""


class DecoderProcess:
    """One decoding process, started by start() and stopped by close(). load() -> the
    Translator it decodes with: it runs in the new process, so it must pickle (a
    module-level function, or functools.partial of one)."""

    def __init__(self, load: Callable[[], Translator], rank: int):
        self.load, self.rank = load, rank
        self._context = multiprocessing.get_context("spawn")    # no fork of a threaded server
        self.serials = itertools.count()
        self._process: multiprocessing.process.BaseProcess | None = None
        self.connection: Connection | None = None

    def start(self) -> None:
        """Start the process and wait until it has loaded the model and decoded once."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process (wait_ready() waits for it to load)."""
        self.connection, theirs = self._context.Pipe()
        self._process = self._context.Process(target=_decode_here, args=(self.load, theirs),
                                              name=f"transduce-decoder-{self.rank}",
                                              daemon=True)
        self._process.start()
        theirs.close()

    def wait_ready(self) -> None:
        """Wait until the launched process has loaded the model and decoded once; stop it
        and raise DecoderProcessFailed if it cannot."""
        if not self.connection.poll(START_TIMEOUT_S):
            self.close()
            raise DecoderProcessFailed(f"decoding process {self.rank} did not start in "
                                       f"{START_TIMEOUT_S:.0f} s")
        try:
            kind, detail = self.connection.recv()
        except EOFError:
            kind, detail = "failed", f"it exited with status {self._process.exitcode}"
        if kind != "ready":
            self.close()
            raise DecoderProcessFailed(f"decoding process {self.rank} could not load the "
                                       f"model: {detail}")

    def stream(self, beam: int, alpha: float, nbest: int, max_length: int | None,
               languages: tuple[str, str] | None = None,
               no_doubles: bool = False) -> "RemoteTranslationStream":
        """A new stream with these search settings (and a multilingual model's
        languages), decoded by this process (started again first if it has died)."""
        if self._process is None or not self._process.is_alive():
            self.start()
        return RemoteTranslationStream(self, (beam, alpha, nbest, max_length, languages,
                                              no_doubles))

    def close(self) -> None:
        """Tell the process to stop and wait for it (killed if it does not stop)."""
        if self._process is None:
            return
        try:
            self.connection.send(("stop",))
        except OSError:
            pass                                   # it is gone already
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self.connection.close()
        self._process = None

    def gone(self) -> DecoderProcessFailed:
        """The error for the jobs it held when it died."""
        return DecoderProcessFailed(f"decoding process {self.rank} exited (status "
                                    f"{self._process.exitcode}) while it held jobs")


def start_processes(processes: Iterable[DecoderProcess]) -> None:
    """Launch every process, then wait for each (they load side by side); if one fails,
    stop them all and raise."""
    processes = list(processes)
    try:
        for process in processes:
            process.launch()
        for process in processes:
            process.wait_ready()
    except BaseException:
        for process in processes:
            process.close()
        raise


class RemoteTranslationStream:
    """The batcher's Stream (batcher.py) for one key, decoded by a DecoderProcess. Each
    result is (per text, its nbest translations; the time the job was admitted; seconds
    until it was reported done), as TranslationStream gives."""

    exclusive = True     # the process decodes one stream at a time: no lanes beside it

    def __init__(self, process: DecoderProcess, settings: tuple):
        self.process, self._ids = process, itertools.count()
        self.serial = next(process.serials)    # reports of a stream that failed are skipped
        self._jobs: dict[int, tuple[Job, float]] = {}       # number -> (job, admitted at)
        self._cores: int | None = None
        self._send(("open", self.serial, settings))

    @property
    def running(self) -> int:
        return len(self._jobs)

    def admit(self, jobs: Sequence[Job]) -> None:
        now, sent = time.monotonic(), []
        for job in jobs:
            number = next(self._ids)
            self._jobs[number] = (job, now)
            sent.append((number, job.payload))
        self._send(("admit", sent))

    def use_cores(self, count: int) -> None:
        """Decode on `count` intra-op threads from the process's next step on."""
        if count != self._cores:
            self._send(("cores", count))
            self._cores = count

    def step(self) -> list[tuple[Job, Any]]:
        """The jobs done at the process's next step, each with its result."""
        serial = None
        while serial != self.serial:
            try:
                kind, serial, payload = self.process.connection.recv()
            except (EOFError, OSError):
                raise self.process.gone() from None
        if kind == "error":
            raise payload
        now, done = time.monotonic(), []
        for number, translations in payload:
            job, admitted = self._jobs.pop(number)
            done.append((job, (translations, admitted, now - admitted)))
        return done

    def _send(self, message: tuple) -> None:
        try:
            self.process.connection.send(message)
        except OSError:
            raise self.process.gone() from None


@dataclass(eq=False)
class _Job:
    """A job as the process sees it: the parent's number for it and its texts."""
    number: int
    payload: list[str]


def _decode_here(load: Callable[[], Translator], connection: Connection) -> None:
    """The process's life: load, warm up, say ready, then decode what it is sent."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        from transduce.runtime import keep_freed_memory

        keep_freed_memory()                        # as the server's process does
        translator = load()
        _warm_up(translator)
    except BaseException as error:                 # noqa: BLE001 - reported to the parent
        connection.send(("failed", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ready", None))
    try:
        _serve(translator, connection)
    except (EOFError, OSError):
        pass                                       # the server is gone: stop with it


def _warm_up(translator: Translator) -> None:
    """Decode as a server does for a moment (sentences of many lengths joining a running
    search in groups, 4 beams), so that the first requests pay for no compiling: the
    compiled step specialises on the first shapes it sees. A multilingual model
    translates in its default pair, or from and into its first code."""
    codes = translator.language_codes
    languages = None if not codes else (translator.model.languages or (min(codes),) * 2)
    stream = TranslationStream(translator, 4, 0.6, 1, 12, languages)
    texts = [" ".join(WARM_UP_WORDS[:length]) for length in range(2, 26, 2)]
    for start in range(0, len(texts), 4):
        stream.admit([_Job(start + i, [text]) for i, text in enumerate(texts[start:start + 4])])
        stream.step()
    while stream.running:
        stream.step()


def _serve(translator: Translator, connection: Connection) -> None:
    """Step the open stream while it runs, handling between steps what has arrived; wait
    for messages while it does not."""
    stream: TranslationStream | None = None
    serial = None
    while True:
        if stream is None or not stream.running or connection.poll():
            kind, *rest = connection.recv()
            if kind == "stop":
                return
            if kind == "open":
                serial, stream = rest[0], TranslationStream(translator, *rest[1])
            elif kind == "cores":
                torch.set_num_threads(rest[0])
            elif kind == "admit" and stream is not None:   # None: its stream failed
                jobs = [_Job(number, texts) for number, texts in rest[0]]
                admitted, _ = _attempt(serial, connection, stream.admit, jobs)
                stream = stream if admitted else None
            continue
        stepped, done = _attempt(serial, connection, stream.step)
        if stepped:
            connection.send(("step", serial, [(job.number, found[0]) for job, found in done]))
        else:
            stream = None


def _attempt(serial: int, connection: Connection, call: Callable, *args) -> tuple[bool, Any]:
    """(True, call(*args)), or (False, None) with the error sent as the stream's last
    report."""
    try:
        return True, call(*args)
    except Exception as error:                     # noqa: BLE001 - reported to the parent
        connection.send(("error", serial, _picklable(error)))
        return False, None


def _picklable(error: Exception) -> Exception:
    """The error itself where it pickles (a TransduceError stays one: the route answers
    422), else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:                              # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")
