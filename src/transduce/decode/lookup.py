"""Prompt lookup: a speculative search's drafts (speculative.py) copied from the text
itself, no second model. Where a continuation repeats text it has seen (quoting or
editing its prompt, a summary, code, a formulaic document, a loop), the tokens that
followed the latest earlier occurrence of its last n tokens are a good guess of the
next ones.
"""

from __future__ import annotations

# The longest n-gram looked up first; shorter ones down to a single token after it.
LOOKUP_NGRAM = 3


class NgramIndex:
    """A token sequence that grows, and for each of its n-grams (n = 1..max_n) where the
    token after its latest occurrence stands, so that a draft is one dict look-up."""

    distributions = None        # a draft is chosen for certain


    def __init__(self, tokens: list[int], max_n: int = LOOKUP_NGRAM):
        self.tokens: list[int] = []
        self.max_n = max_n
        self.follower: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens: each becomes the follower of the n-grams that end before it."""
        for token in tokens:
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self.follower[n][tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def draft(self, count: int) -> list[int]:
        """At most `count` tokens: those after the latest earlier occurrence of the
        sequence's last n tokens, for the longest n that occurred before ([]: none)."""
        if count <= 0:
            return []
        for n in range(min(self.max_n, len(self.tokens)), 0, -1):
            start = self.follower[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + count]
        return []
