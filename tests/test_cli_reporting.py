"""The command line's warnings: the library's as one line each (naming the input file
where they are about one of its lines), everyone else's in Python's format, and the
process's warning printer as it was afterwards; running out of memory and Ctrl-C as one
line; a reader that closes the output early ends the command without a word."""

import argparse
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from transduce.cli import decode, main
from transduce.cli.reporting import one_line_warnings, out_of_memory
from transduce.errors import InputTooLong, KernelBuilding, LineTruncated, TransduceWarning


def test_the_librarys_warnings_are_one_line_and_a_lines_names_the_file(capsys):
    with one_line_warnings(Path("in.txt")):
        warnings.warn("line 3: 900 tokens, truncated", LineTruncated)
        warnings.warn("the kernel could not be built", TransduceWarning)
        warnings.warn("compiling the beam step kernel for this CPU", KernelBuilding)
    assert capsys.readouterr().err.splitlines() == [
        "transduce: warning: in.txt: line 3: 900 tokens, truncated",
        "transduce: warning: the kernel could not be built",
        "transduce: note: compiling the beam step kernel for this CPU"]


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


CPU_FAILURE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
               "allocate memory: you tried to allocate 57344000000 bytes. Error code 12")
CUDA_FAILURE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"


@pytest.mark.parametrize("error,expected", [
    (RuntimeError(CPU_FAILURE), "out of memory (an allocation of 57.3 GB failed); lower "
                                "--beam (now 64) or --batch-tokens (now 4096)"),
    (RuntimeError(CUDA_FAILURE), "out of memory (an allocation of 2.00 GiB failed); lower "
                                 "--beam (now 64) or --batch-tokens (now 4096)"),
    (MemoryError(), "out of memory; lower --beam (now 64) or --batch-tokens (now 4096)"),
    (RuntimeError("shapes cannot be multiplied"), None),
    (ValueError("can't allocate memory"), None),
])
def test_running_out_of_memory_is_one_line_naming_the_options_to_lower(error, expected):
    args = argparse.Namespace(beam=64, batch_tokens=4096, batch_sentences=0, input=None)
    assert out_of_memory(error, args) == expected


def test_the_command_line_says_it_ran_out_of_memory_and_lets_other_errors_through(
        monkeypatch, capsys):
    def failing(args):
        raise RuntimeError(CPU_FAILURE)
    monkeypatch.setattr(decode, "translate_command", failing)
    assert main(["translate", "--model", "M", "--beam", "1000000"]) == 1
    assert capsys.readouterr().err == ("transduce: error: out of memory (an allocation of "
                                       "57.3 GB failed); lower --beam (now 1000000) or "
                                       "--batch-tokens (now 4096)\n")

    def broken(args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(decode, "translate_command", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["translate", "--model", "M"])


def test_ctrl_c_is_one_line_and_the_shells_status(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(decode, "translate_command", interrupted)
    assert main(["translate", "--model", "M"]) == 130
    assert capsys.readouterr().err == "transduce: interrupted\n"


def test_a_reader_that_closes_the_output_early_ends_the_command_quietly(tiny_corpus):
    """`transduce data stats ... | head -0`: the reader is gone before the first write."""
    process = subprocess.Popen([sys.executable, "-m", "transduce", "data", "stats", "--data",
                                str(tiny_corpus)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()
    assert process.wait(timeout=120) == 141   # 128 + SIGPIPE, as the shell shows for cat
    assert process.stderr.read() == b""


def test_a_broken_pipe_elsewhere_is_not_taken_for_a_closed_output(monkeypatch):
    def writes_to_a_closed_pipe(args):
        raise BrokenPipeError(32, "Broken pipe")   # a child's pipe, say; stdout is fine
    monkeypatch.setattr(decode, "translate_command", writes_to_a_closed_pipe)
    with pytest.raises(BrokenPipeError):
        main(["translate", "--model", "M"])
