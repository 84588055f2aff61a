"""What the decoding calls (translate, generate, classify, embed) take as text: a list of
str. A single string would be read character by character, and a lone surrogate (from
Python code or a JSON escape) is no text a tokenizer can read; both, and anything that
is not a str, are refused naming the line. generate, classify and embed also take
PromptIds in place of a text: token ids read as they are."""

from __future__ import annotations

from typing import Sequence

from transduce.errors import TransduceError


class TextError(TransduceError, ValueError):
    """Input that is not a sequence of text lines; names the line."""


class PromptIds(tuple):
    """Token ids given in place of a text (OpenAI's completions and embeddings take them),
    read as they are: no bos, [CLS] or [SEP] is added, so that a caller that tokenized a
    text itself (an evaluation harness) is answered about exactly the tokens it sent."""


def ids_problem(ids: Sequence[int], vocab_size: int) -> str | None:
    """What makes `ids` no input of a model of vocab_size ids (none given, or one that is
    no integer of its vocabulary), or None."""
    if not ids:
        return "no token ids (give at least one)"
    for index, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            return f"token {index} is {token!r}, not an id of the model's vocabulary (0 to " \
                   f"{vocab_size - 1})"
    return None


def checked_texts(texts: Sequence[str], what: str = "line", first_number: int = 1, *,
                  ids_too: bool = False) -> list[str]:
    """texts as a list, each a str encodable as UTF-8 (or, ids_too, PromptIds, which the
    caller checks against its vocabulary); else a TextError naming the `what` by its
    number (counted from first_number)."""
    if isinstance(texts, (str, bytes)):
        raise TextError(f"expected a list of {what}s, got one {type(texts).__name__}: pass "
                        f"[text] for a single {what}")
    texts = list(texts)
    for number, text in enumerate(texts, start=first_number):
        if ids_too and isinstance(text, PromptIds):
            continue
        if not isinstance(text, str):
            raise TextError(f"{what} {number}: a {type(text).__name__} ({text!r:.40}), not a str")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise TextError(f"{what} {number}: a lone surrogate at character {error.start + 1}"
                            f" ({text[error.start]!r}), which is no text") from None
    return texts
