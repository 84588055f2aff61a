"""A completion's logprobs in OpenAI's shapes, from its scores (serve/scoring.py): per
token of the text, its piece of the text, where the piece begins, its
log-probability and the likeliest tokens in its place, each named by the text it would
write there. Text completions list the prompt's own tokens first with echo, then the
completion's, then the end token that stopped it; a chat reply lists its content's."""

from __future__ import annotations

from dataclasses import dataclass

from transduce.data.tokenizer import TextTokenizer
from transduce.decode.generate import Generator, PromptIds
from transduce.decode.token_logprobs import TokenLogprobs
from transduce.decode.token_spans import decoded_after, last_text_tokens, token_offsets, \
    token_strings
from transduce.serve.schemas import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


@dataclass(frozen=True)
class Prompted:
    """One prompt of a request: its ids as the model reads them (what the jobs take, so
    that it is tokenized once), how many of those lead the prompt's own (a bos the model
    adds: 1), and its text."""

    ids: list[int]
    added: int
    text: str

    @classmethod
    def of(cls, tokenizer: TextTokenizer, prompt: str | PromptIds,
           ids: list[int]) -> "Prompted":
        """A text prompt and its ids (Generator.encode's), or PromptIds read as they
        are (their text is what they decode to)."""
        if isinstance(prompt, PromptIds):
            return cls(ids, 0, tokenizer.decode(ids))
        return cls(ids, len(ids) - len(tokenizer.encode([prompt])[0]), prompt)


@dataclass
class _Token:
    place: int          # in the scored sequence (the prompt's ids, then the completion)
    string: str
    offset: int


def choice_logprobs(generator: Generator, prompted: Prompted, completion: list[int],
                    text: str, context: list[int], scores: TokenLogprobs,
                    echo: bool) -> CompletionLogprobs:
    """The logprobs of one choice: `completion` the tokens generated (the end token
    last, if one stopped it), `text` what they wrote after `context`, `scores` those
    of the prompt's ids and the completion as one sequence."""
    tokenizer = generator.tokenizer
    tokens: list[_Token] = []
    start = len(prompted.ids)
    if echo:
        tokens += _spans(tokenizer, prompted.ids[prompted.added:], prompted.text,
                         prompted.ids[:prompted.added], prompted.added, 0)
    shift = len(prompted.text) if echo else 0
    written = len(completion) - (bool(completion) and completion[-1] in generator.end_ids)
    tokens += _spans(tokenizer, completion[:written], text, context, start, shift)
    tokens += [_Token(start + written, tokenizer.piece(token), shift + len(text))
               for token in completion[written:]]
    sequence = prompted.ids + completion
    specials = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, *generator.end_ids}
    return CompletionLogprobs(
        tokens=[t.string for t in tokens],
        token_logprobs=[scores.logprobs[t.place - 1] if t.place else None for t in tokens],
        top_logprobs=[_top(tokenizer, sequence, t, scores, specials) if t.place else None
                      for t in tokens],
        text_offset=[t.offset for t in tokens])


def reply_logprobs(generator: Generator, prompt: list[int], reply: list[int], text: str,
                   scores: TokenLogprobs, top: int) -> ChatLogprobs:
    """The logprobs of a chat reply: `reply` its tokens (the end token, not content, left
    out), `text` what they wrote (decoded alone), `scores` those of the prompt's ids and
    the reply as one sequence; `top` alternatives in each place."""
    tokenizer = generator.tokenizer
    sequence = prompt + reply
    specials = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, *generator.end_ids}
    content = []
    for token in _spans(tokenizer, reply, text, [], len(prompt), 0):
        best = _top(tokenizer, sequence, token, scores, specials, own=False)
        content.append(TokenLogprob(
            token=token.string, logprob=scores.logprobs[token.place - 1],
            bytes=list(token.string.encode()),
            top_logprobs=[TopLogprob(token=name, logprob=value, bytes=list(name.encode()))
                          for name, value in best.items()]))
    return ChatLogprobs(content=content)


def _spans(tokenizer: TextTokenizer, ids: list[int], text: str, context: list[int],
           first_place: int, shift: int) -> list[_Token]:
    """ids that write `text` after `context`, from place first_place of the sequence,
    their pieces and offsets (moved by `shift`)."""
    offsets = token_offsets(tokenizer, ids, text, context)
    return [_Token(first_place + i, piece, shift + offset)
            for i, (piece, offset) in enumerate(zip(token_strings(text, offsets), offsets))]


def _top(tokenizer: TextTokenizer, sequence: list[int], token: _Token,
         scores: TokenLogprobs, specials: set[int], own: bool = True) -> dict[str, float]:
    """The likeliest tokens in the token's place, best first, by the text each would
    write after the tokens before it (a special token by its name), the token itself
    among them by its own piece if `own`; of two writing the same text, the likelier."""
    place = token.place
    best = dict(scores.top[place - 1])
    if own:
        best.setdefault(sequence[place], scores.logprobs[place - 1])
    before = last_text_tokens(tokenizer, sequence[:place], specials)
    out: dict[str, float] = {}
    for candidate, logprob in sorted(best.items(), key=lambda pair: -pair[1]):
        if candidate == sequence[place]:
            name = token.string
        elif candidate in specials:
            name = tokenizer.piece(candidate)
        else:
            name = decoded_after(tokenizer, before, [candidate])
        out.setdefault(name, logprob)
    return out
