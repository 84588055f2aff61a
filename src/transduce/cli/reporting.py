"""How the command line says what the library warns about: one line on standard error,
`transduce: warning: ...`, naming the input file where a warning or error is about one
of its lines. Warnings from elsewhere (PyTorch, NumPy) keep Python's own format."""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Iterator

from transduce.errors import InputTooLong, LineTruncated, TransduceWarning


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
            print(f"transduce: warning: {named}{message}", file=file or sys.stderr)

        warnings.showwarning = show
        try:
            yield
        except InputTooLong as error:
            if not prefix:
                raise
            raise InputTooLong(f"{prefix}{error}") from None
