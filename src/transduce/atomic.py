"""Write files and directories so that a crash, even SIGKILL, never leaves half of one.

Everything is written under a temporary name beside its destination, flushed to disk,
then renamed into place. A file is replaced with one rename. A directory that already
exists is swapped with the new one in a single step where Linux offers it
(renameat2 with RENAME_EXCHANGE); elsewhere the old one is renamed aside first, so the
destination is, at every moment, absent or complete, never half-written.

Temporary names start with ".tmp-" followed by the destination's name, so leftovers of
a killed writer can be found and removed (`remove_temporaries`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

from transduce.errors import TransduceError

_PREFIX = ".tmp-"


class OutputPathError(TransduceError, OSError):
    """The destination cannot be written: a directory where a file goes, a file where
    a directory goes or under one of its parents."""


def temporary_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place."""
    return path.with_name(f"{_PREFIX}{path.name}-{os.getpid()}")


@contextlib.contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """Yields a temporary path to write; on success it replaces `path` in one rename.
    On an exception the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    check_file_destination(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    try:
        yield temporary
        _fsync(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def write_text(path: Path | str, text: str) -> Path:
    """Write a UTF-8 text file atomically."""
    with atomic_file(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)


def open_permissions(path: Path) -> None:
    """Give a file that its writer created private (safetensors writes 0600) the mode
    open() gives: 0666 less the process's umask, so a shared model is readable by all."""
    path.chmod(0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it (os.umask can only swap)."""
    try:
        for line in Path("/proc/self/status").read_text().split("\n"):
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


@contextlib.contextmanager
def atomic_directory(path: Path | str) -> Iterator[Path]:
    """Yields a fresh temporary directory to fill; on success it takes the place of
    `path` (an existing directory there is replaced whole). On an exception the
    temporary directory is removed and `path` is left as it was."""
    path = Path(path)
    check_directory_destination(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    try:
        yield temporary
        _fsync_tree(temporary)
        _move_into_place(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _fsync(path.parent)


def check_file_destination(path: Path) -> None:
    """Raises OutputPathError unless a file can be written at `path`."""
    if path.is_dir():
        raise OutputPathError(f"{path}: is a directory; name a file to write")
    _check_parents(path)


def check_directory_destination(path: Path) -> None:
    """Raises OutputPathError unless a directory can be written at `path`."""
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{path}: exists and is not a directory")
    _check_parents(path)


def _check_parents(path: Path) -> None:
    for parent in path.absolute().parents:     # nearest first: the first that exists
        if parent.exists():
            if not parent.is_dir():
                raise OutputPathError(f"{path}: {parent} is a file, not a directory")
            return


def remove_temporaries(directory: Path, name_prefix: str = "") -> None:
    """Remove what killed writers left in `directory` (temporaries of names starting
    with name_prefix): they were never renamed into place, so nothing refers to them."""
    if not directory.is_dir():
        return
    for leftover in directory.glob(f"{_PREFIX}{name_prefix}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _move_into_place(new: Path, path: Path) -> None:
    if not path.exists():
        new.rename(path)
        return
    if _exchange(new, path):       # `new` now holds the old directory
        shutil.rmtree(new)
        return
    old = path.with_name(f"{_PREFIX}old-{path.name}-{os.getpid()}")
    path.rename(old)
    new.rename(path)
    shutil.rmtree(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the
    system or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_tree(directory: Path) -> None:
    """Flush every file and directory under `directory`, deepest first."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
