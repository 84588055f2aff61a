"""Lines in, lines out, as they arrive: what `transduce translate` reads from a pipe or a
terminal, and how it writes translations (one line each, or Moses-style n-best lists)."""

from __future__ import annotations

import os
import select
from typing import Iterator, Sequence

from transduce.data.corpus import CorpusError
from transduce.decode.translate import Translation


def line_batches(fd: int, max_lines: int) -> Iterator[list[str]]:
    """Lines from a file descriptor as soon as they arrive: what is already waiting (up
    to max_lines) is translated together, and a typed line is answered without waiting
    for more input. Invalid UTF-8 is an error naming the line."""
    buffer, number = b"", 1
    while True:
        chunk = os.read(fd, 1 << 16)
        buffer += chunk
        while chunk and buffer.count(b"\n") < max_lines and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1 << 16)  # more is waiting: take it without blocking
            buffer += chunk
        ended = not chunk
        *complete, buffer = buffer.split(b"\n")
        if ended and buffer:
            complete.append(buffer)  # a last line without a line end
        for first in range(0, len(complete), max_lines):
            yield _decode_lines(complete[first:first + max_lines], number)
            number += len(complete[first:first + max_lines])
        if ended:
            return


def _decode_lines(raw_lines: list[bytes], first_number: int) -> list[str]:
    decoded = []
    for number, raw in enumerate(raw_lines, start=first_number):
        try:
            decoded.append(raw.rstrip(b"\r").decode("utf-8"))
        except UnicodeDecodeError as error:
            raise CorpusError(f"<stdin>:{number}: invalid UTF-8 at byte "
                              f"{error.start + 1}") from None
    return decoded


def format_best(translations: Sequence[str]) -> str:
    """One line per translation."""
    return "".join(text + "\n" for text in translations)


def format_nbest(results: Sequence[list[Translation]], first_index: int) -> str:
    """Moses style: "index ||| text ||| score", index counted from 0 over the input."""
    return "".join(f"{first_index + offset} ||| {hypothesis.text} ||| {hypothesis.score:.4f}\n"
                   for offset, hypotheses in enumerate(results) for hypothesis in hypotheses)
