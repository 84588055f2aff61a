"""How the command line says what the library warns about: one line on standard error,
`transduce: warning: ...`, naming the input file where a warning or error is about one
of its lines. Warnings from elsewhere (PyTorch, NumPy) keep Python's own format. Running
out of memory is one line too, naming the options that size the work."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import warnings
from pathlib import Path
from typing import Iterator

from transduce.errors import InputTooLong, KernelBuilding, LineTruncated, TransduceWarning


@contextlib.contextmanager
def one_line_warnings(input_path: Path | None = None) -> Iterator[None]:
    """Within: the project's warnings print as one line each; with input_path, those
    about a line (truncated) and a refused line name the file as well. The previous
    warning printer is back afterwards."""
    prefix = f"{input_path}: " if input_path is not None else ""
    with warnings.catch_warnings():
        python_format = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if not issubclass(category, TransduceWarning):
                python_format(message, category, filename, lineno, file, line)
                return
            named = prefix if issubclass(category, LineTruncated) else ""
            kind = "note" if issubclass(category, KernelBuilding) else "warning"
            print(f"transduce: {kind}: {named}{message}", file=file or sys.stderr)

        warnings.showwarning = show
        try:
            yield
        except InputTooLong as error:
            if not prefix:
                raise
            raise InputTooLong(f"{prefix}{error}") from None


# The options that size what a command holds in memory at once, in the order to try.
MEMORY_OPTIONS = ("beam", "batch_tokens", "batch_sentences", "max_tokens", "max_new_tokens")


def out_of_memory(error: BaseException, args: argparse.Namespace) -> str | None:
    """One line for an allocation that failed (PyTorch's CPU or CUDA allocator, or
    Python's), with the size asked for and the command's options that would lower it;
    None for any other error."""
    text = str(error)
    failed = isinstance(error, MemoryError) or isinstance(error, RuntimeError) and \
        re.search(r"out of memory|can't allocate memory", text, re.IGNORECASE)
    if not failed:
        return None
    asked = re.search(r"allocate (\d+) bytes", text)
    size = f"{int(asked.group(1)) / 1e9:.1f} GB" if asked else \
        next(iter(re.findall(r"allocate ([\d.]+ [KMGT]iB)", text)), None)
    message = "out of memory" + (f" (an allocation of {size} failed)" if size else "")
    options = [f"--{name.replace('_', '-')} (now {value})" for name in MEMORY_OPTIONS
               if (value := getattr(args, name, None)) not in (None, 0)]
    return message + (f"; lower {' or '.join(options)}" if options else "")


def stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (`... | head`), the
    one broken pipe that is the reader's choice rather than a failure."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):   # not a file descriptor (captured)
        return False


def stop_writing_stdout() -> None:
    """Point standard output at /dev/null, so the interpreter's last flush of what is
    still buffered does not fail on the closed pipe as well."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
