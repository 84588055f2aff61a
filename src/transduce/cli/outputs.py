"""Where a command writes, checked before it does any work: a path where writing would
fail after the work is done (a directory where a file goes, a file where a directory
goes), or would destroy what the user has (the model being read, a directory of
theirs that atomic.atomic_directory would replace whole), is refused by name."""

from __future__ import annotations

from pathlib import Path

from transduce import atomic
from transduce.config import ConfigError
from transduce.written import CONFIG, EXPORT_MARKER, written_by_transduce

FORCE_HELP = f"replace OUT if transduce wrote it (our {CONFIG}, or an export's " \
             f"{EXPORT_MARKER}); anything else there is never replaced"


def check_output_file(path: Path, option: str) -> None:
    """A file the command writes: not a directory, and under directories, not files."""
    _as_option_error(atomic.check_file_destination, path, option)


def check_directory_path(path: Path, option: str) -> None:
    """A directory the command writes into: not a file, and under directories."""
    _as_option_error(atomic.check_directory_destination, path, option)


def check_output_directory(path: Path, option: str, *, force: bool,
                           reads: Path | None = None) -> None:
    """A directory the command writes whole: not the directory it reads (`reads`) nor
    one holding it, not a file, and, if it holds anything, replaced only with --force
    and only if it is a directory these commands write (never, say, a home directory)."""
    check_directory_path(path, option)
    if reads is not None:
        target, source = path.resolve(), reads.resolve()
        if target == source or target in source.parents:
            raise ConfigError(f"{option} {path}: writing there would replace {reads}, "
                              f"which this command reads; choose another directory")
    if not path.exists() or not any(path.iterdir()):
        return
    if not force:
        raise ConfigError(f"{option} {path}: exists and is not empty; pass --force to "
                          f"replace what is there")
    if not written_by_transduce(path):
        raise ConfigError(f"{option} {path}: --force replaces only a directory written by "
                          f"transduce, and {path} holds neither our {CONFIG} nor an "
                          f"export's {EXPORT_MARKER}; remove it yourself if it should go")


def _as_option_error(check, path: Path, option: str) -> None:
    try:
        check(path)
    except atomic.OutputPathError as error:
        raise ConfigError(f"{option} {error}") from None
