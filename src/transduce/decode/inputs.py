"""What the decoding calls (translate, generate, classify, embed) take as text: a list of
str. A single string would be read character by character, and a lone surrogate (from
Python code or a JSON escape) is no text a tokenizer can read; both, and anything that
is not a str, are refused naming the line."""

from __future__ import annotations

from typing import Sequence

from transduce.errors import TransduceError


class TextError(TransduceError, ValueError):
    """Input that is not a sequence of text lines; names the line."""


def checked_texts(texts: Sequence[str], what: str = "line", first_number: int = 1) -> list[str]:
    """texts as a list, each a str encodable as UTF-8; else a TextError naming the
    `what` by its number (counted from first_number)."""
    if isinstance(texts, (str, bytes)):
        raise TextError(f"expected a list of {what}s, got one {type(texts).__name__}: pass "
                        f"[text] for a single {what}")
    texts = list(texts)
    for number, text in enumerate(texts, start=first_number):
        if not isinstance(text, str):
            raise TextError(f"{what} {number}: a {type(text).__name__} ({text!r:.40}), not a str")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise TextError(f"{what} {number}: a lone surrogate at character {error.start + 1}"
                            f" ({text[error.start]!r}), which is no text") from None
    return texts
