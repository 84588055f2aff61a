"""Which languages a translation goes between, as the tokens a model is given.

A multilingual model (NLLB, importers/hf_nllb.py) reads [source code] + pieces + eos,
and its decoder is given bos and then the target's code (search.forced_start), which is
what picks the language it writes. The codes and their ids are the model's own
(config.json's language_codes). A model of one language pair has none: it takes no
languages, or its own pair's.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from transduce.config import ConfigError


class LanguageError(ConfigError):
    """A language the model does not translate; `side` is "source" or "target"."""

    def __init__(self, message: str, side: str):
        super().__init__(message)
        self.side = side


@dataclass(frozen=True)
class Direction:
    source_prefix: tuple[int, ...] = ()   # ids before a source's pieces
    forced: tuple[int, ...] = ()          # ids every output starts with, after bos
    languages: tuple[str, str] | None = None   # a multilingual model's (source, target)


def direction(codes: dict[str, int] | None, pair: tuple[str, str] | None,
              source: str | None, target: str | None) -> Direction:
    """The tokens that translate from `source` into `target` (None: the model's default
    pair, if it records one). codes: the model's language codes -> ids (None: a model of
    one pair, which names `pair` when it records it)."""
    if not codes:
        for side, given, own in (("source", source, pair and pair[0]),
                                 ("target", target, pair and pair[1])):
            if given is not None and own and given != own:
                raise LanguageError(f"{side} language {given!r}: this model translates "
                                    f"{pair[0]} -> {pair[1]} only", side)
        return Direction()
    source = source if source is not None else pair and pair[0]
    target = target if target is not None else pair and pair[1]
    if not source or not target:
        raise LanguageError(f"this model translates between {len(codes)} languages: name "
                            f"the source and the target language (--source-lang and "
                            f"--target-lang; {_examples(codes)})",
                            "target" if source else "source")
    for side, language in (("source", source), ("target", target)):
        if language not in codes:
            raise LanguageError(f"{side} language {language!r} is not one of this model's "
                                f"{len(codes)} language codes ({_examples(codes, language)})",
                                side)
    return Direction((codes[source],), (codes[target],), (source, target))


def _examples(codes: dict[str, int], near: str = "") -> str:
    """A few of the codes: the closest to `near` when there are close ones."""
    close = difflib.get_close_matches(near, codes, n=3) if near else []
    if close:
        return "did you mean " + " or ".join(close) + "?"
    return "such as " + ", ".join(sorted(codes)[:4]) + (", ..." if len(codes) > 4 else "")
