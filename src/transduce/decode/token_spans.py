"""Which characters of a text each of its tokens wrote: OpenAI's `text_offset`, and
each token's own string, the pieces joined being the text.

A token's text depends on the tokens before it: SentencePiece writes a piece's leading
space except at the start of a text, and byte-level tokens may end inside a UTF-8
character. So a token's piece is what its text adds after the tokens before it, decoded
a window at a time (decoding every prefix whole would take time quadratic in the
length). A token that ends inside a character adds nothing; the token that completes
it carries the whole character.
"""

from __future__ import annotations

from typing import Sequence

from transduce.data.tokenizer import TextTokenizer

# Tokens decoded together to find where one's text begins: a window restarts every
# SPAN_WINDOW tokens, after CONTEXT_TOKENS tokens of context.
SPAN_WINDOW = 32
CONTEXT_TOKENS = 4


def decoded_after(tokenizer: TextTokenizer, context: Sequence[int], tokens: Sequence[int],
                  *, settled: bool = False) -> str:
    """The text `tokens` add after `context`: the space or the joined bytes their first
    piece means there (SentencePiece drops a leading space at the start of a text).
    settled: each side's text up to a character whose bytes are still arriving, so that
    the token completing it carries it."""
    def text(ids: Sequence[int]) -> str:
        decoded = tokenizer.decode(list(ids))
        return decoded.rstrip("\ufffd") if settled else decoded

    if context:
        before, joined = text(context), text([*context, *tokens])
        if joined.startswith(before):
            return joined[len(before):]
    return text(tokens)


def last_text_tokens(tokenizer: TextTokenizer, tokens: Sequence[int],
                     specials: Sequence[int] = ()) -> list[int]:
    """The context a text that follows `tokens` is decoded after: their last
    CONTEXT_TOKENS after the last special token (bos, eos, pad, `specials`), at which a
    decoding stops or restarts."""
    stops = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, *specials}
    last = max((i for i, token in enumerate(tokens) if token in stops), default=-1)
    return list(tokens[max(last + 1, len(tokens) - CONTEXT_TOKENS):])


def token_offsets(tokenizer: TextTokenizer, tokens: Sequence[int], text: str,
                  context: Sequence[int] = ()) -> list[int]:
    """Where each of `tokens` begins in `text` (what they decode to after `context`),
    then len(text): n + 1 offsets, never decreasing, never past the end of the text (a
    text cut at a stop string leaves the tokens after the cut empty)."""
    tokens, context = list(tokens), list(context)
    offsets, anchor = [0], 0
    for end in range(1, len(tokens) + 1):
        if end - anchor > SPAN_WINDOW:
            anchor = end - 1
        before = last_text_tokens(tokenizer, context + tokens[:anchor])
        written = decoded_after(tokenizer, before, tokens[anchor:end], settled=True)
        offsets.append(min(len(text), max(offsets[-1], offsets[anchor] + len(written))))
    offsets[-1] = len(text)
    return offsets


def token_strings(text: str, offsets: Sequence[int]) -> list[str]:
    """Each token's piece of `text` (token_offsets' offsets)."""
    return [text[start:end] for start, end in zip(offsets, offsets[1:])]
