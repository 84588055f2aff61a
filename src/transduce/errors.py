"""The base classes of what the project reports about its input: errors (bad input
rather than a bug) and warnings (input changed to fit, a fast path left out).

The command line prints either as one line, never a traceback: errors with an exit
status, warnings as `transduce: warning: ...`. Importing this module costs nothing (no
torch), so the command line can catch them without loading the library.
"""

from __future__ import annotations

from pathlib import Path


class TransduceError(Exception):
    """Bad input, a missing file or tool: the message names the file, line, field or
    option and says what is wrong."""


class InputTooLong(TransduceError, ValueError):
    """A line longer than the model can read, refused (strict); names the line."""


class TransduceWarning(UserWarning):
    """Something a user should know that does not stop the work: the command line
    prints it as one line."""


class KernelBuilding(TransduceWarning):
    """A C++ kernel is being compiled for this CPU, once: why a first call pauses. The
    command line prints it as `transduce: note: ...`."""


class LineTruncated(TransduceWarning):
    """A line longer than the model can read was cut to fit; names the line."""


def not_there(path: Path | str, expected: str = "file") -> str:
    """Why `path` is not the file (or "directory") expected, for an error message that
    names it: missing, or the other kind of thing."""
    path = Path(path)
    if expected == "file" and path.is_dir():
        return f"{path}: a directory, where a file was expected"
    if expected != "file" and path.exists() and not path.is_dir():
        return f"{path}: a file, where a {expected} was expected"
    return f"{path}: no such {expected}"
