"""The `transduce` command line: a thin layer over the library.

Each command group's module builds its parsers next to their handlers, and a handler
imports what it needs when it runs, so `transduce --help` loads no torch. Errors that
describe bad input (TransduceError) are printed as one line, never a traceback:
configuration errors exit with status 2, the others with 1. The library's warnings are
one line each too, and so are running out of memory and Ctrl-C (cli/reporting.py); a
reader that closes the output early (`| head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from transduce.cli import chat, data, decode, encode, export, generate, imports, model, \
    serve, train
from transduce.cli.reporting import one_line_warnings, out_of_memory, stdout_reader_gone, \
    stop_writing_stdout
from transduce.config import ConfigError
from transduce.errors import TransduceError

GROUPS = (model, data, train, decode, generate, chat, encode, export, imports, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transduce", description="The Transformer and its family: train, translate, "
                                      "inspect and export sequence-to-sequence models.")
    commands = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with one_line_warnings():
            return args.handler(args)
    except ConfigError as error:
        print(f"transduce: configuration error: {error}", file=sys.stderr)
        return 2
    except TransduceError as error:
        print(f"transduce: error: {error}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as error:
        message = out_of_memory(error, args)
        if message is None:
            raise
        print(f"transduce: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # training stops at a checkpoint by itself (train/signals.py)
        print("transduce: interrupted", file=sys.stderr)
        return 130   # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        stop_writing_stdout()
        return 141   # 128 + SIGPIPE, as for any command whose reader went away
