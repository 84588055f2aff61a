"""Prompts in, continuations out: a decoder-only model generating with its KV cache.

    generator = transduce.decode.generate.Generator.load("runs/gpt")
    generator.generate(["In the beginning"], max_new_tokens=40)          # -> [str]
    for text in generator.stream("In the beginning", temperature=0.8, seed=1):
        print(text, end="", flush=True)                                   # whole words
    generator.chat([{"role": "user", "content": "Hi!"}])   # an instruct model's reply

A prompt is a text, continued as it is, a Chat (data/chat.py), a conversation that the
model's chat template lays out with the opening of the assistant's turn, so that what
the model generates is its reply, or PromptIds, token ids read as they are.

N prompts in give N continuations out, in order. Prompts are sorted by length and
generated in left-padded batches (model/decoder_only.py): each row's positions and mask
make it generate what it would alone. A prompt is cached in one pass (prefill); each
step then feeds one token per row, and rows that finish leave the batch.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence, Union

import torch
from torch import Tensor

from transduce import checkpoint
from transduce.config import ConfigError, choices
from transduce.data.chat import Chat
from transduce.data.tokenizer import TextTokenizer
from transduce.decode.constrained import GrammarRow, TokenGrammar, Vocabulary, constrained
from transduce.decode.inputs import PromptIds, checked_texts, ids_problem
from transduce.decode.draft_model import DraftModel
from transduce.decode.lookup import NgramIndex
from transduce.decode.onnx_engine import check_onnx_settings, runs_on_onnxruntime
from transduce.decode.onnx_lm_engine import OnnxLanguageModel
from transduce.decode.options import (KEY_VALUE_CACHES, DecodeDtype, Engine, GenerateOptions,
                                      KvDtype, decoding_dtype, is_sampling_seed, use_instead)
from transduce.decode.penalties import Penalties
from transduce.decode.reply_grammar import compile_grammar
from transduce.decode.sampling import Sampler, prompt_seeds
from transduce.decode.search import beam_search
from transduce.decode.speculative import Drafter, speculative_steps
from transduce.decode.token_bytes import special_ids, token_bytes
from transduce.decode.token_logprobs import TokenLogprobs, token_logprobs
from transduce.decode.token_spans import decoded_after, last_text_tokens
from transduce.errors import TransduceError, TransduceWarning
from transduce.model import DecoderOnly, load_model
from transduce.model.packed import decoding_copy


class PromptError(TransduceError, ValueError):
    """A prompt the model cannot continue (ids it lacks, or PromptTooLong); names it."""


class PromptTooLong(PromptError):
    """A prompt that fills the model's context, leaving no place to continue it."""


@dataclass
class Continuation:
    """One row's generated text as it grows: the tokens, the text they decode to after
    the prompt's last tokens (cut at a stop string), and how much of it has been
    streamed. The text is decoded again only when it is read, or at every step when a
    stop string has to be looked for. prompt + text is what the whole sequence reads."""

    tokenizer: TextTokenizer
    stops: tuple[str, ...]
    context: list[int] = field(default_factory=list)   # the prompt's last tokens
    ends: frozenset[int] = frozenset()   # tokens that end it as eos does (stop_ids)
    tokens: list[int] = field(default_factory=list)
    limit: int | None = None          # tokens at most (where the context ends)
    finished: bool = False
    ended: bool = False               # finished by eos, an end token or a stop string
    end_token: int | None = None      # the token that ended it, if one did
    grammar: GrammarRow | None = None   # what its text must be (GenerateOptions.reply_grammar)
    streamed: int = 0
    _text: str = ""
    _decoded: int = 0     # tokens behind _text

    def add(self, token: int) -> None:
        """Take one generated token; eos (or an end token) or a stop string finishes the
        row."""
        if token == self.tokenizer.eos_id or token in self.ends:
            self.finished = self.ended = True
            self.end_token = token
            return
        self.tokens.append(token)
        if self.stops:
            self._decode()
        if self.grammar is not None:
            self.grammar.add(token)
            if self.grammar.ended:                # its JSON closed: nothing may follow
                self.finished = self.ended = True
        if self.limit is not None and len(self.tokens) >= self.limit:
            self.finished = True

    def set_tokens(self, tokens: list[int]) -> None:
        """A whole continuation at once (beam search)."""
        self.tokens, self.finished = list(tokens), True
        self.ended = self.limit is None or len(self.tokens) < self.limit

    @property
    def finish_reason(self) -> str:
        """"stop" where it ended by itself (an end token or a stop string), "length"
        where it was cut at its limit (OpenAI's names)."""
        _ = self.text        # decoded: a stop string in a beam's continuation is found
        return "stop" if self.ended else "length"

    @property
    def text(self) -> str:
        if self._decoded != len(self.tokens):
            self._decode()
        return self._text

    def _decode(self) -> None:
        text = decoded_after(self.tokenizer, self.context, self.tokens)
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            text, self.finished, self.ended = text[:min(found)], True, True
        self._text, self._decoded = text, len(self.tokens)

    def take(self) -> str:
        """The text that is final now and not yet streamed: whole words (up to the last
        whitespace), never a partial UTF-8 character and never what could still turn
        out to be the start of a stop string. Once finished, all of the rest."""
        text = self.text
        end = len(text) if self.finished else self._stable_end(text)
        new = text[self.streamed:end] if end > self.streamed else ""
        self.streamed = max(self.streamed, end)
        return new

    def _stable_end(self, text: str) -> int:
        text = text.rstrip("\ufffd")             # bytes of a character still arriving
        words_end = max(text.rfind(space) for space in (" ", "\n", "\t")) + 1
        held = max((k for stop in self.stops for k in range(1, len(stop))
                    if text.endswith(stop[:k])), default=0)
        return min(words_end, len(text) - held)


# Schemas whose grammars a Generator keeps (the oldest made is dropped first).
CACHED_GRAMMARS = 16


class ReplyIds(list):
    """A Chat's prompt ids (Generator.encode): what follows is the assistant's reply."""


Prompt = Union[str, Chat, PromptIds]


class Generator:
    """A decoder-only model with its tokenizer, ready to generate."""

    def __init__(self, model: DecoderOnly | OnnxLanguageModel, tokenizer: TextTokenizer,
                 device: torch.device | str = "cpu", dtype: DecodeDtype = "float32",
                 kv_dtype: KvDtype | None = None, *, in_place: bool = False,
                 draft: "Generator | None" = None):
        """A PyTorch model is copied for decoding in `dtype` ("bfloat16": a bfloat16 copy;
        the model passed in is left as it is, unless in_place: see Translator); kv_dtype
        is the caches' type (default: the model's), "int8" quantized per token and head,
        "int4" per group of 32 values.
        An OnnxLanguageModel (an ONNX export) runs as exported, on the CPU.
        draft: a smaller language model's Generator, of the same tokenizer, that drafts
        tokens for `draft_tokens` (decode/speculative.py)."""
        self.draft = draft
        self._grammars: dict[str, TokenGrammar] = {}    # reply grammar text -> its grammar
        self._vocabulary: Vocabulary | None = None       # the tokens' bytes, once needed
        if draft is not None:
            _check_draft(draft, tokenizer, model.config.tgt_vocab_size)
        if isinstance(model, OnnxLanguageModel):
            check_onnx_settings(dtype, kv_dtype, device)
            self.model, self.tokenizer, self.device = model, tokenizer, torch.device("cpu")
            self.dtype, self.cache_dtype = "float32", None
            return
        if not isinstance(model, DecoderOnly):
            arch = model.config.arch
            raise ConfigError(f"generation needs a decoder-only model (arch 'decoder'); this "
                              f"one is arch={arch!r}: {use_instead(arch)}")
        dtype = decoding_dtype(dtype, device, model.num_parameters())
        if kv_dtype is not None and kv_dtype not in choices(KvDtype):
            raise ConfigError(f"kv_dtype={kv_dtype!r}: choose None or one of "
                              f"{', '.join(choices(KvDtype))}")
        if kv_dtype in ("int8", "int4") and model.config.attention_type not in KEY_VALUE_CACHES:
            raise ConfigError(f"kv_dtype={kv_dtype!r} quantizes the keys and values of softmax "
                              f"or sliding-window attention; this model's attention_type is "
                              f"{model.config.attention_type!r}")
        # The copy's Linear weights are packed for oneDNN (model/packed.py): a decode step
        # streams every weight of the model for a few rows, 1.5-2x faster so on CPUs.
        self.model = decoding_copy(model, getattr(torch, dtype), device, in_place=in_place)
        self.tokenizer, self.device, self.dtype = tokenizer, torch.device(device), dtype
        self.cache_dtype = getattr(torch, kv_dtype) if kv_dtype else None

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The tokens that end a continuation: eos, and an instruct model's others."""
        return (self.tokenizer.eos_id, *getattr(self.tokenizer, "stop_ids", ()))

    @classmethod
    def load(cls, path: Path | str, device: torch.device | str = "cpu",
             dtype: DecodeDtype = "float32", kv_dtype: KvDtype | None = None,
             engine: Engine = "auto", draft: Path | str | None = None) -> "Generator":
        """A checkpoint directory, a run directory (its latest checkpoint), or an ONNX
        export (engine "auto" runs it with ONNX Runtime, as Translator.load does).
        draft: a smaller language model of the same tokenizer, loaded alike, to draft
        tokens for `draft_tokens`."""
        drafter = None if draft is None else cls.load(draft, device, dtype, kv_dtype, engine)
        if runs_on_onnxruntime(path, engine):
            return cls(OnnxLanguageModel(path), checkpoint.load_tokenizer(Path(path)), device,
                       dtype, kv_dtype, draft=drafter)
        directory = checkpoint.resolve(Path(path))
        return cls(load_model(directory, device), checkpoint.load_tokenizer(directory), device,
                   dtype, kv_dtype, in_place=True, draft=drafter)

    @property
    def context(self) -> int:
        """Positions the model reads: prompt and continuation together."""
        return self.model.config.max_positions

    def generate(self, prompts: Sequence[Prompt], options: GenerateOptions | None = None,
                 *, first_number: int = 1, seeds: Sequence[int] | None = None,
                 **settings) -> list[str]:
        """The continuation of each prompt. options, or its fields as keyword arguments
        (max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty, stop, beam,
        alpha, batch_sentences). Sampling draws each prompt from its own seed: `seeds`,
        or prompt_seeds(options.seed). Errors count prompts from first_number."""
        return [row.text for row in self.generate_rows(prompts, options,
                                                       first_number=first_number,
                                                       seeds=seeds, **settings)]

    def generate_rows(self, prompts: Sequence[Prompt],
                      options: GenerateOptions | None = None, *, first_number: int = 1,
                      seeds: Sequence[int] | None = None, **settings) -> list[Continuation]:
        """generate()'s continuations whole: their tokens and why each ended, too."""
        options = options or GenerateOptions(**settings)
        ids = self.encode(prompts, first_number)
        seeds = self._seeds(options, seeds, len(ids))
        found: dict[int, Continuation] = {}
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for first in range(0, len(order), options.batch_sentences):
            batch = order[first:first + options.batch_sentences]
            rows = self._generate_batch([ids[i] for i in batch], options,
                                        seeds and [seeds[i] for i in batch])
            found.update(zip(batch, rows))
        return [found[index] for index in range(len(ids))]

    def chat(self, messages: Sequence[dict] | Chat, options: GenerateOptions | None = None,
             *, template_variables: dict | None = None, tools: Sequence[dict] | None = None,
             **settings) -> str:
        """The model's reply to one conversation ({"role": ..., "content": ...} messages,
        the last the user's), laid out by its chat template, which also reads
        template_variables (Qwen3's {"enable_thinking": False}, say) and tools (OpenAI's
        function schemas: data/tool_calls.py reads the calls out of the reply);
        generate()'s settings."""
        chat = Chat.of(messages, variables=template_variables, tools=tools)
        return self.generate([chat], options, **settings)[0]

    def stream(self, prompt: Prompt, options: GenerateOptions | None = None, *,
               number: int = 1, seed: int | None = None, **settings) -> Iterator[str]:
        """The continuation of one prompt as it is generated, in pieces of whole words;
        the pieces joined are generate([prompt], seeds=[seed])[0] (seed None: the
        options' seed). Errors call it prompt `number`."""
        options = options or GenerateOptions(**settings)
        if options.beam > 1:
            raise ConfigError("streaming shows greedy or sampled tokens as they come; beam "
                              "search knows its best continuation only at the end")
        ids = self.encode([prompt], number)
        sampler = self._sampler(options,
                                self._seeds(options, None if seed is None else [seed], 1))
        for rows in self._stepped(ids, options, sampler):
            text = rows[0].take()
            if text:
                yield text

    def stream_batch(self, prompts: Sequence[Prompt],
                     options: GenerateOptions | None = None, *, first_number: int = 1,
                     seeds: Sequence[int] | None = None, **settings) -> Iterator[list[str]]:
        """Several prompts generated in one batch, streamed: after each step, the new text
        of every prompt in whole words ("" where there is none yet); a server streams its
        clients so. Each prompt's pieces joined are its generate() continuation (with the
        same seeds)."""
        for rows in self.stream_rows(prompts, options, first_number=first_number,
                                     seeds=seeds, **settings):
            yield [row.take() for row in rows]

    def stream_rows(self, prompts: Sequence[Prompt],
                    options: GenerateOptions | None = None, *, first_number: int = 1,
                    seeds: Sequence[int] | None = None,
                    **settings) -> Iterator[list[Continuation]]:
        """stream_batch()'s continuations, in the prompts' order, after each step."""
        options = options or GenerateOptions(**settings)
        if options.beam > 1:
            raise ConfigError("streaming shows greedy or sampled tokens as they come; beam "
                              "search knows its best continuation only at the end")
        ids = self.encode(prompts, first_number)
        seeds = self._seeds(options, seeds, len(ids))
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        row_of = {prompt: row for row, prompt in enumerate(order)}
        sampler = self._sampler(options, seeds and [seeds[i] for i in order])
        for rows in self._stepped([ids[i] for i in order], options, sampler):
            yield [rows[row_of[i]] for i in range(len(ids))]

    def encode(self, prompts: Sequence[Prompt], first_number: int = 1
               ) -> list[list[int]]:
        """Each prompt's ids: a text's with bos first where the model was trained so (an
        empty one is bos alone, so the model generates from nothing, as it began its
        training sequences), a Chat's as its template lays it out, PromptIds as they are;
        one that fills the context, or ids the model lacks, is a PromptError naming it."""
        prompts = _checked_prompts(prompts, first_number)
        texts = iter(self.tokenizer.encode([self.chat_text(p) if isinstance(p, Chat) else p
                                            for p in prompts if not isinstance(p, PromptIds)]))
        encoded = []
        for number, prompt in enumerate(prompts, start=first_number):
            if isinstance(prompt, PromptIds):
                ids = self._known_ids(prompt, number)
            else:
                ids = next(texts)
                ids = ReplyIds(ids) if isinstance(prompt, Chat) and ids \
                    else with_bos(ids, self.tokenizer)
            if len(ids) >= self.context:
                raise PromptTooLong(f"prompt {number}: {len(ids)} tokens, but the model "
                                    f"reads {self.context} positions in all (prompt and "
                                    f"continuation)")
            encoded.append(ids)
        return encoded

    def token_logprobs(self, sequences: Sequence[Sequence[int]], top: int = 0
                       ) -> list[TokenLogprobs]:
        """Each token's log-probability given the tokens before it, and the `top`
        likeliest tokens in each place (decode/token_logprobs.py), of sequences of ids
        (a prompt's and its continuation's); a sequence the model cannot read whole is
        a PromptError."""
        for number, sequence in enumerate(sequences, start=1):
            if len(sequence) > self.context + 1:   # the last token is scored, not read
                raise PromptError(f"sequence {number}: {len(sequence)} tokens, but the model "
                                  f"reads {self.context} positions")
        return token_logprobs(self.model, sequences, top, device=self.device)

    def _known_ids(self, prompt: PromptIds, number: int) -> list[int]:
        """PromptIds as a list, refused (PromptError) where empty or holding an id that
        is no integer of the model's vocabulary."""
        problem = ids_problem(prompt, self.model.config.tgt_vocab_size)
        if problem:
            raise PromptError(f"prompt {number}: {problem}")
        return list(prompt)

    def chat_text(self, chat: Chat) -> str:
        """The conversation as the model's chat template writes it, up to the opening of
        the assistant's reply; a model without a template is a ConfigError."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise ConfigError("this model has no chat template: chat needs an instruct "
                              "model imported with its template (tokenizer_config.json's "
                              "chat_template or chat_template.jinja); give it plain prompts")
        return template.render(chat)

    @staticmethod
    def _seeds(options: GenerateOptions, seeds: Sequence[int] | None, count: int
               ) -> list[int] | None:
        """Each prompt's seed (None when nothing is sampled); given ones are checked."""
        if options.greedy:
            return None
        if seeds is None:
            return prompt_seeds(options.seed, count)
        if len(seeds) != count or not all(map(is_sampling_seed, seeds)):
            raise ConfigError(f"seeds: give one integer from 0 to 2**63 - 1 per prompt "
                              f"({count}), not {list(seeds)!r}")
        return list(seeds)

    def _sampler(self, options: GenerateOptions, seeds: list[int] | None) -> Sampler | None:
        """A batch's sampler (None: greedy); row i draws from a generator of its own,
        seeded with seeds[i]."""
        return None if options.greedy else Sampler(options.temperature, options.top_k,
                                                   options.top_p, options.seed, self.device,
                                                   row_seeds=seeds, min_p=options.min_p)

    def _prepare(self, ids: list[list[int]], options: GenerateOptions
                 ) -> tuple[Tensor, Tensor, int, list[Continuation]]:
        """Left-padded prompt (B, P), its mask (B, 1, 1, P), the new tokens of the row
        that may have most, and an empty Continuation per row, limited to the tokens its
        own prompt leaves room for (so that a row gets what it gets alone)."""
        prompt, mask = left_pad(ids, self.model.config.pad_id, self.device)
        longest = max(len(row) for row in ids)
        if options.max_new_tokens > self.context - longest:
            warnings.warn(f"max_new_tokens={options.max_new_tokens}: the model reads "
                          f"{self.context} positions and the longest prompt takes {longest}, "
                          f"so its continuation stops after {self.context - longest} new "
                          f"tokens", TransduceWarning, stacklevel=3)
        rows = [self.continuation(row, options) for row in ids]
        return prompt, mask, max(row.limit for row in rows), rows

    def continuation(self, ids: list[int], options: GenerateOptions) -> Continuation:
        """An empty Continuation of prompt `ids`, limited to the tokens the prompt leaves
        room for in the context, decoded after the prompt's last tokens that follow its
        last special one (which ends decoding); a chat's reply is decoded alone, as
        transformers decodes it (a leading "▁" is the template's separator)."""
        t = self.tokenizer
        context = [] if isinstance(ids, ReplyIds) else last_text_tokens(t, ids, self.end_ids)
        spec = options.reply_grammar
        grammar = None if spec is None else self.grammar(spec).start()
        return Continuation(t, options.stop, context, frozenset(self.end_ids[1:]),
                            limit=min(options.max_new_tokens, self.context - len(ids)),
                            grammar=grammar)

    def grammar(self, spec: str) -> TokenGrammar:
        """A reply grammar's (GenerateOptions.reply_grammar's JSON text) over this model's
        vocabulary, made once per spec (the vocabulary's bytes once per Generator)."""
        grammars = self._grammars
        if spec not in grammars:
            if self._vocabulary is None:
                pieces = token_bytes(self.tokenizer, self.model.config.tgt_vocab_size)
                self._vocabulary = Vocabulary(pieces, self.end_ids, self.device,
                                              special_ids(self.tokenizer))
            if len(grammars) >= CACHED_GRAMMARS:
                grammars.pop(next(iter(grammars)))
            grammars[spec] = TokenGrammar(compile_grammar(json.loads(spec)), self._vocabulary)
        return grammars[spec]

    def _generate_batch(self, ids: list[list[int]], options: GenerateOptions,
                        seeds: list[int] | None = None) -> list[Continuation]:
        if options.beam == 1:
            rows = []
            for rows in self._stepped(ids, options, self._sampler(options, seeds)):
                pass
            return rows
        prompt, mask, max_new, rows = self._prepare(ids, options)
        with torch.inference_mode():
            found = beam_search(self.model, prompt, bos_id=prompt[:, -1],
                                eos_id=_one_or_all(self.end_ids), beam=options.beam,
                                alpha=options.alpha,
                                max_len=torch.tensor([row.limit for row in rows]),
                                cache_dtype=self.cache_dtype, src_mask=mask)
        for row, hypotheses in zip(rows, found):
            row.set_tokens(hypotheses[0].tokens)
        return rows

    def _stepped(self, ids: list[list[int]], options: GenerateOptions,
                 sampler: Sampler | None) -> Iterator[list[Continuation]]:
        """Greedy search or sampling of prompts `ids` (beam 1): yields every prompt's
        Continuation after each step. The prompts are one left-padded batch, or, where
        tokens are drafted (prompt lookup, a draft model), each generated alone by
        speculative decoding, one after another."""
        prompt, mask, max_new, rows = self._prepare(ids, options)
        self.check_vocabulary(options)
        if not options.drafts:
            yield from self._steps(prompt, mask, rows, max_new, self._penalties(ids, options),
                                   sampler)
            return
        if options.draft_tokens and self.draft is None:
            raise ConfigError("draft_tokens drafts with a draft model, and this Generator "
                              "has none: load it with draft=PATH (--draft-model), or draft "
                              "by prompt_lookup")
        _check_rewinds(self.model, "the model")
        for index, (row_ids, row) in enumerate(zip(ids, rows)):
            penalties = self._penalties([row_ids], options)
            drafter = self._drafter(row_ids, row, options, sampler, index, penalties)
            with torch.inference_mode():
                for _ in speculative_steps(self.model,
                                           torch.tensor([row_ids], device=self.device), row,
                                           drafter, options.drafts, self.cache_dtype, sampler,
                                           index, penalties,
                                           options.draft_schedule == "adaptive"):
                    yield rows

    def _penalties(self, ids: list[list[int]], options: GenerateOptions) -> Penalties | None:
        """What changes the logits of prompts `ids`' rows (None where nothing does)."""
        if not options.penalized:
            return None
        penalties = Penalties(len(ids), self.model.config.tgt_vocab_size, self.device)
        penalties.start(0, ids, [options] * len(ids))
        return penalties

    def _drafter(self, ids: list[int], row: Continuation, options: GenerateOptions,
                 sampler: Sampler | None, index: int, penalties: Penalties | None) -> Drafter:
        """What drafts a prompt's tokens: its n-gram index, or the draft model (sampling
        from the prompt's generator, `sampler`'s row `index`, where the model samples;
        its logits changed by the search's penalties)."""
        if options.prompt_lookup:
            return NgramIndex(ids)
        return DraftModel(self.draft.model, ids, row.limit + options.drafts + 1,
                          self.draft.cache_dtype, self.draft.device, sampler, index,
                          penalties)

    def _steps(self, prompt: Tensor, mask: Tensor, rows: list[Continuation], max_new: int,
               penalties: Penalties | None, sampler: Sampler | None
               ) -> Iterator[list[Continuation]]:
        """Greedy search or sampling, one token per running row per step; yields the
        rows after every step. prompt (B, P) left-padded, mask (B, 1, 1, P); penalties:
        what changes the rows' logits (None: nothing)."""
        with torch.inference_mode():
            state = self.model.prefill(prompt, max_new, src_mask=mask,
                                       cache_dtype=self.cache_dtype)
            running = torch.arange(len(rows), device=self.device)        # (A,) row of each
            token = prompt[:, -1:]                                        # (A, 1)
            for step in range(max_new):
                logits = self.model.decode_step(token, state)[:, -1].float()   # (A, V)
                if penalties is not None:
                    logits = penalties(logits)
                indices = running.tolist()
                logits = constrained(logits, [rows[row].grammar for row in indices])
                chosen = logits.argmax(dim=-1) if sampler is None else sampler(logits, indices)
                if penalties is not None:
                    penalties.record(chosen)
                for row, value in zip(indices, chosen.tolist()):
                    rows[row].add(value)        # finished at eos, a stop or its limit
                yield rows
                keep = [i for i, row in enumerate(indices) if not rows[row].finished]
                if not keep:
                    return
                if len(keep) < len(running):
                    kept = torch.tensor(keep, device=self.device)
                    state.reorder(kept)
                    running, chosen = running[kept], chosen[kept]
                    if penalties is not None:
                        penalties.select(kept)
                token = chosen[:, None]


    def check_vocabulary(self, options: GenerateOptions) -> None:
        """A logit_bias names tokens of the model's vocabulary, and the vocabulary writes
        each byte a json_schema or grammar may need: a ConfigError otherwise (made here,
        the grammar is cached for the generation)."""
        vocab = self.model.config.tgt_vocab_size
        unknown = [token for token, _ in options.logit_bias or () if token >= vocab]
        if unknown:
            raise ConfigError(f"GenerateOptions.logit_bias: token {unknown[0]} is not among "
                              f"the model's {vocab} (ids 0 to {vocab - 1})")
        spec = options.reply_grammar
        missing = b"" if spec is None else self.grammar(spec).unwritable()
        if missing:
            name = "json_schema" if options.json_schema is not None else "grammar"
            shown = ", ".join(repr(chr(byte)) for byte in missing[:8])
            raise ConfigError(f"GenerateOptions.{name}: no token of the model's vocabulary "
                              f"writes {shown}{' ...' if len(missing) > 8 else ''} alone, "
                              f"which the JSON may need (a byte-level or byte-fallback "
                              f"vocabulary writes every byte)")


def _check_rewinds(model: DecoderOnly | OnnxLanguageModel, name: str) -> None:
    """A speculative search forgets rejected drafts; a cache that cannot (linear
    attention's running sums) is a ConfigError. An ONNX export's past is sliced, whatever
    its attention."""
    if isinstance(model, OnnxLanguageModel):
        return
    attention_type = model.config.attention_type
    if attention_type not in KEY_VALUE_CACHES:
        raise ConfigError(f"drafted tokens that {name} rejects are forgotten, which needs "
                          f"the keys and values of softmax or sliding-window attention; "
                          f"{name}'s attention_type is {attention_type!r}")


def _check_draft(draft: "Generator", tokenizer: TextTokenizer, vocab_size: int) -> None:
    """A draft model shares the model's tokenizer and output ids (its drafts mean the
    same) and can forget."""
    if not isinstance(draft, Generator):
        raise ConfigError(f"draft: expected a Generator of a smaller language model, got "
                          f"{type(draft).__name__}")
    if draft.tokenizer.fingerprint != tokenizer.fingerprint:
        raise ConfigError(f"the draft model's tokenizer ({draft.tokenizer.path}) is not the "
                          f"model's ({tokenizer.path}): a draft model must share its "
                          f"vocabulary, token for token")
    if draft.model.config.tgt_vocab_size != vocab_size:
        raise ConfigError(f"the draft model scores {draft.model.config.tgt_vocab_size} "
                          f"tokens and the model {vocab_size}: a draft model must share its "
                          f"output vocabulary")
    _check_rewinds(draft.model, "the draft model")


def _one_or_all(ids: tuple[int, ...]) -> int | tuple[int, ...]:
    """One end token as an int (beam search compares it), several as they are."""
    return ids[0] if len(ids) == 1 else ids


def _checked_prompts(prompts: Sequence[Prompt], first_number: int) -> list[Prompt]:
    """The prompts as a list, each a Chat, PromptIds or a text encodable as UTF-8 (else a
    TextError naming it by its number)."""
    if isinstance(prompts, Chat):
        raise ConfigError("expected a list of prompts, got one Chat: pass [chat]")
    if isinstance(prompts, (str, bytes)):
        return checked_texts(prompts, "prompt", first_number)      # which refuses it
    prompts = list(prompts)
    for number, prompt in enumerate(prompts, start=first_number):
        if not isinstance(prompt, (Chat, PromptIds)):
            checked_texts([prompt], "prompt", number)
    return prompts


def left_pad(ids: list[list[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Token id lists -> prompt (B, P) with each row's tokens last, and its mask
    (B, 1, 1, P), True for real tokens."""
    width = max(len(row) for row in ids)
    prompt = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.bool)
    for i, row in enumerate(ids):
        prompt[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = True
    return prompt.to(device), mask[:, None, None, :].to(device)


def with_bos(ids: list[int], tokenizer: TextTokenizer) -> list[int]:
    """A prompt's ids as the model reads them: bos first where it was trained so, and bos
    alone for an empty prompt (as Hugging Face's generate starts without input ids)."""
    if tokenizer.prepend_bos or not ids:
        return [tokenizer.bos_id, *ids]
    return ids
