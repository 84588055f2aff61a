"""The command line's warnings: the library's as one line each (naming the input file
where they are about one of its lines), everyone else's in Python's format, and the
process's warning printer as it was afterwards."""

import warnings
from pathlib import Path

import pytest

from transduce.cli.reporting import one_line_warnings
from transduce.errors import InputTooLong, LineTruncated, TransduceWarning


def test_the_librarys_warnings_are_one_line_and_a_lines_names_the_file(capsys):
    with one_line_warnings(Path("in.txt")):
        warnings.warn("line 3: 900 tokens, truncated", LineTruncated)
        warnings.warn("the kernel could not be built", TransduceWarning)
    assert capsys.readouterr().err.splitlines() == [
        "transduce: warning: in.txt: line 3: 900 tokens, truncated",
        "transduce: warning: the kernel could not be built"]


def test_other_warnings_go_to_the_printer_that_was_there(capsys):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with one_line_warnings():
            warnings.warn("from elsewhere", DeprecationWarning)
    assert [str(w.message) for w in seen] == ["from elsewhere"]
    assert capsys.readouterr().err == ""


def test_a_refused_line_names_the_file_and_the_printer_is_restored():
    before = warnings.showwarning
    with pytest.raises(InputTooLong, match=r"^in.txt: line 2: too long$"):
        with one_line_warnings(Path("in.txt")):
            raise InputTooLong("line 2: too long")
    with pytest.raises(InputTooLong, match=r"^line 2: too long$"):
        with one_line_warnings():
            raise InputTooLong("line 2: too long")
    assert warnings.showwarning is before
