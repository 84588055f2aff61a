"""`transduce serve`: a model behind HTTP (see transduce.serve and docs/serving.md)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path

from transduce.cli.options import add_dtype_option, add_kv_dtype_option, non_negative_float, \
    port_number, positive_int, workers_count
from transduce.config import ConfigError


def register(commands) -> None:
    serve = commands.add_parser("serve", help="serve a model over HTTP, with dynamic batching "
                                              "and an attention explorer page")
    serve.add_argument("--model", type=Path, required=True, help="checkpoint or run directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8000)
    serve.add_argument("--name", default=None, help="the model's name in /v1/models "
                                                    "(default: the directory's name)")
    serve.add_argument("--languages", default=None, type=_pair,
                       help="SOURCE:TARGET of a translation model, for LibreTranslate's "
                            "clients (default: the pair its checkpoint records, else es:en)")
    serve.add_argument("--max-chars", type=positive_int, default=5000,
                       help="characters per text (413 over it)")
    serve.add_argument("--max-texts", type=positive_int, default=128,
                       help="texts per request (413 over it)")
    serve.add_argument("--max-queue", type=positive_int, default=256,
                       help="requests waiting for the decoder before 429")
    serve.add_argument("--batch-tokens", type=positive_int, default=4096,
                       help="source tokens per decoded batch, padding counted")
    serve.add_argument("--window-ms", type=_window_ms, default=5.0,
                       help="how long the decoder waits for requests to join a batch "
                            "(0 to 1000)")
    serve.add_argument("--no-batching", action="store_true",
                       help="decode one request at a time (for comparison)")
    serve.add_argument("--static-batches", action="store_true",
                       help="decode whole batches instead of letting sentences join and leave "
                            "the running search (for comparison)")
    serve.add_argument("--decoders", type=workers_count, default="auto",
                       help="decoders that run translations side by side, each on its share "
                            "of the cores and of the running sentences; the second and later "
                            "each in a process with its own copy of the model (auto: 2 for a "
                            "translation model on a CPU with 2+ threads, else 1)")
    serve.add_argument("--max-attention-values", type=positive_int, default=2**25,
                       help="numbers in one /v1/attention answer (413 over it; about 6 "
                            "bytes of JSON each)")
    serve.add_argument("--drain-timeout", type=non_negative_float, default=60.0,
                       help="seconds SIGTERM waits for requests in flight")
    add_dtype_option(serve)
    add_kv_dtype_option(serve)
    serve.add_argument("--no-doubles", action="store_true",
                       help="a translation model's requests that do not say keep a token "
                            "from directly following itself (LibreTranslate's too)")
    serve.add_argument("--threads", type=positive_int, default=None,
                       help="PyTorch threads (default: PyTorch's choice)")
    serve.set_defaults(handler=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    """Load the model and serve it until SIGTERM; in-flight requests are answered first."""
    import torch

    from transduce import load
    from transduce.runtime import keep_freed_memory
    from transduce.serve.app import model_kind
    from transduce.serve.limits import Limits
    from transduce.serve.server import serve

    keep_freed_memory()  # as translate: a process setting, the command line's to make

    limits = Limits(max_chars=args.max_chars, max_texts=args.max_texts,
                    max_queue=args.max_queue, batch_tokens=args.batch_tokens,
                    window_ms=args.window_ms, batching=not args.no_batching,
                    continuous=not args.static_batches,
                    max_attention_values=args.max_attention_values, no_doubles=args.no_doubles)
    if args.threads:
        _check_threads(args.threads)
        torch.set_num_threads(args.threads)
    # Bound first, so that a bad address is said before loading; closed however it ends.
    with _bound_socket(args.host, args.port) as listening:
        loaded = functools.partial(load, dtype=args.dtype, kv_dtype=args.kv_dtype)
        model = _load_in_a_passing_thread(loaded, args.model)
        if args.no_doubles and model_kind(model) != "translation":
            raise ConfigError(f"--no-doubles applies to a translation model; {args.model} is "
                              f"a {model_kind(model)} model")
        decoders = _auto_decoders(model, limits) if args.decoders == "auto" else args.decoders
        limits = dataclasses.replace(limits, decoders=decoders)
        name = args.name or args.model.resolve().name
        reload = functools.partial(loaded, args.model.resolve())     # a decoder's process
        serve(model, name=name, host=args.host, port=args.port, limits=limits,
              languages=args.languages, drain_timeout_s=args.drain_timeout, reload=reload,
              sock=listening)
    return 0


def _bound_socket(host: str, port: int):
    """A TCP socket bound to --host and --port (the server listens on it once the model
    is loaded): a host that does not resolve, a port in use or one not allowed stops the
    command before the model loads, naming the options."""
    import socket

    try:
        family, kind, protocol, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise ConfigError(f"--host {host}: does not resolve ({error.strerror})") from None
    listening = socket.socket(family, kind, protocol)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as uvicorn binds
    try:
        listening.bind(address)
    except OSError as error:
        listening.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there "
                          f"({error.strerror})") from None
    return listening


def _check_threads(threads: int) -> None:
    """More threads than the CPUs this process may run on only make them wait."""
    import os
    import warnings

    from transduce.errors import TransduceWarning

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus and threads > cpus:
        warnings.warn(f"--threads {threads}: more than the {cpus} CPUs this process may use; "
                      f"the threads will take turns on them", TransduceWarning, stacklevel=2)


def _auto_decoders(model, limits) -> int:
    """--decoders auto: two where translations decode in continuous streams on a CPU with
    two threads or more (two streams of 16 sentences on a core each ran 2.05x one of 32
    on both, 2-core Zen 4, int8), else one."""
    from transduce.decode.parallel import auto_workers
    from transduce.serve.continuous import decodes_in_streams

    return auto_workers(model.device.type == "cpu") if decodes_in_streams(model, limits) else 1


def _load_in_a_passing_thread(load, path):
    """The model, loaded by a thread that then ends. Loading runs parallel ops, and the
    OpenMP threads they start belong to the thread that ran them: started by the main
    thread, they stayed and competed with the decoding thread's own for the cores (one
    sentence decoded 2-2.5x slower on 2 cores). A finished thread's team is released."""
    import threading

    result: dict = {}

    def run() -> None:
        try:
            result["model"] = load(path)
        except BaseException as error:      # noqa: BLE001 - raised again in the caller
            result["error"] = error

    thread = threading.Thread(target=run, name="transduce-load")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["model"]


def _pair(text: str) -> tuple[str, str]:
    source, _, target = text.partition(":")
    if not source or not target or ":" in target:
        raise argparse.ArgumentTypeError(f"{text}: expected SOURCE:TARGET, such as es:en")
    return source, target


def _window_ms(text: str) -> float:
    from transduce.serve.limits import MAX_WINDOW_MS    # the serve command imports it anyway

    value = non_negative_float(text)
    if value > MAX_WINDOW_MS:
        raise argparse.ArgumentTypeError(f"{text}: must be at most {MAX_WINDOW_MS} "
                                         f"(milliseconds)")
    return value
