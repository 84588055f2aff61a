"""The tiles of a length, walked in a form torch.compile keeps general."""

from __future__ import annotations

from collections.abc import Iterator


def tiles(length: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each `size`-long tile of `length`, the last one possibly shorter.

    Counted, not range(0, length, size): under torch.compile's dynamic shapes a range
    over a length fixes the length itself (a new graph for every length), a count only
    how many tiles there are (one graph for every length up to a tile).
    """
    for index in range(-(-length // size)):
        start = index * size
        yield start, min(start + size, length)
