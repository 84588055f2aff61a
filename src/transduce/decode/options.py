"""The options of a search, validated where they enter the Python API: a bad value is a
ConfigError naming the option and its allowed range, before any work is done."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping

from transduce.config import (ConfigError, Dtype, ValidatedConfig, check_at_least,
                              check_positive, choices)
from transduce.runtime import cpu_flags

if TYPE_CHECKING:
    import torch

__all__ = ["Dtype", "DecodeDtype", "KvDtype", "SearchOptions", "GenerateOptions"]

KvDtype = Literal["float32", "bfloat16", "int8", "int4"]
# The attention types whose caches hold each token's keys and values, which int8 and
# int4 quantize and a speculative search rewinds (linear attention's running sums not).
KEY_VALUE_CACHES = ("softmax", "sliding")
# A decoding copy's type; auto picks by the hardware (decoding_dtype). int8: float32
# weights but the widest products in int8 (model/int8.py).
DecodeDtype = Literal["auto", "float32", "bfloat16", "int8"]

# How many tokens a speculative search drafts a step (speculative.DraftLength).
DraftSchedule = Literal["adaptive", "constant"]

# What runs a model: auto is ONNX Runtime for an ONNX export, PyTorch for a checkpoint.
Engine = Literal["auto", "torch", "onnxruntime"]


def use_instead(arch: str) -> str:
    """What a model of `arch` is for, said where it was given to the wrong command."""
    return {"decoder": "a language model, use generate",
            "encoder": "an encoder (BERT), use classify or embed"}.get(
        arch, "an encoder-decoder, use translate")

# CPU flags of int8 dot-product instructions (AVX512-VNNI: Zen 4, Cascade Lake and
# later Xeons; AVX-VNNI: Alder Lake and later cores).
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})

# On a CPU with AMX, a language model of this many parameters or more generates in int8
# (decoding_dtype; measured between 5.3M, where bfloat16 wins, and 29.6M, where int8 does).
AMX_INT8_LM_PARAMETERS = 1 << 24


def decoding_dtype(dtype: str, device: torch.device | str,
                   language_model_parameters: int = 0) -> str:
    """The type a model decodes in. "auto" on a CPU with AMX: bfloat16, whose tiles
    multiply several times faster than float32 (on an Emerald Rapids Xeon, two workers,
    batches of 32: the demo model translated 1.91x float32's speed at beam 4 and 1.64x
    greedy, 0.13 and 0.04 BLEU below it, and 1.31x and 1.26x int8's; the presets base
    and big 1.28-1.36x int8 at beam 4, 1.05-1.27x greedy; bench/decode_dtypes.py), but
    int8 for a language model (language_model_parameters given) of
    AMX_INT8_LM_PARAMETERS or more: generating for a few prompts, a step multiplies one
    row each by every weight, read from memory at every step, and int8 reads half the
    bytes (1.34-1.55x bfloat16 at one prompt from 29.6M to 160M parameters, 0.88-1.07x
    at eight; 0.81x and 0.74x at 5.3M). On another CPU with VNNI, int8 (on a Zen 4,
    where bfloat16 was 1.13x at beam 4 but 0.87x greedy, int8 ran 1.11-1.15x and
    0.99-1.08x, 0.01 and 0.09 BLEU below float32; on a Zen 5, int8 ran 1.18-1.34x
    bfloat16 at beam 4 from `small` to `big` and 1.13-1.49x generating from 29.6M
    parameters up, bench/decode_dtypes.py). On an x86 CPU with AVX2 but no VNNI, int8 as
    well: oneDNN's products there give the rows 7 bits (model/int8.py), and on a 2-core
    Zen 3 int8 translated 1.30x, 1.56x and 1.82x float32 at beam 4 from `small` to `big`
    (1.18-1.75x greedy), 0.02 and 0.06 BLEU below it at beam 4 and greedy on the test
    verses (`small`, 12 minutes of the budget recipe), and embedded 1.27x with
    bert-base's shape (bench/encode.py); a language model's products take the int8 rows
    kernel there (model/int8_rows.py), with which it generated 2.37-2.74x float32 at one
    prompt and 1.31-1.40x at eight from 5.3M to 160M parameters (oneDNN's: 0.67-1.00x),
    so a language model generates in int8 only where that kernel builds. Else float32,
    and float32 on GPUs (not measured). The CPU is read once, from its flags."""
    import torch   # the command line reads these options without torch

    from transduce.model import int8_rows
    from transduce.model.int8 import int8_available

    on_cpu = torch.device(device).type == "cpu"
    if dtype == "auto":
        flags = cpu_flags() if on_cpu else frozenset()
        if "amx_bf16" in flags:
            large = language_model_parameters >= AMX_INT8_LM_PARAMETERS
            return "int8" if large and int8_available() else "bfloat16"
        if flags & VNNI_FLAGS or "avx2" in flags and (
                not language_model_parameters or int8_rows.KERNEL.available()):
            return "int8" if int8_available() else "float32"
        return "float32"
    if dtype not in choices(DecodeDtype):
        raise ConfigError(f"dtype={dtype!r}: choose one of {', '.join(choices(DecodeDtype))}")
    if dtype == "int8" and not (on_cpu and int8_available()):
        where = "this PyTorch build lacks oneDNN's int8 ops" if on_cpu else \
            f"the device is {torch.device(device)}"
        raise ConfigError(f"dtype='int8' decodes on a CPU through oneDNN's int8 products; {where}")
    return dtype


@dataclass(frozen=True)
class SearchOptions(ValidatedConfig):
    """beam: hypotheses kept per sentence (1 is greedy search); alpha: the GNMT length
    penalty's exponent; nbest: hypotheses returned per sentence (at most beam);
    batch_tokens: source tokens per batch counting padding; batch_sentences: at most
    this many lines per batch (0: no cap); max_length: output tokens at most per
    sentence (None: the source's length + 50), within the model's positions;
    no_doubles: a token never directly follows itself (search.forbid_doubles)."""

    beam: int = 4
    alpha: float = 0.6
    nbest: int = 1
    batch_tokens: int = 4096
    batch_sentences: int = 0
    max_length: int | None = None
    no_doubles: bool = False

    def __post_init__(self) -> None:
        self._check_bools()
        self._check_floats_finite()
        check_positive(self, "beam", "nbest", "batch_tokens")
        if self.max_length is not None:
            check_positive(self, "max_length")
        check_at_least(self, 0, "alpha")
        if isinstance(self.batch_sentences, bool) or not isinstance(self.batch_sentences, int) \
                or self.batch_sentences < 0:
            raise ConfigError(f"SearchOptions.batch_sentences={self.batch_sentences!r}: must be "
                              f"an integer >= 0 (0: no cap)")
        if self.nbest > self.beam:
            raise ConfigError(f"SearchOptions.nbest={self.nbest}: must be at most "
                              f"beam={self.beam} (a beam search finds at most beam hypotheses)")


@dataclass(frozen=True)
class GenerateOptions(ValidatedConfig):
    """How a language model continues a prompt (decode/generate.py).

    max_new_tokens: generated tokens at most (fewer where the model's context ends);
    temperature 0 is greedy search, above 0 sampling, narrowed by top_k (0: no limit)
    and top_p (nucleus) and min_p (tokens at least min_p times as likely as the
    likeliest; 0: all); seed makes sampling repeat; repetition_penalty > 1 discourages
    tokens already in the prompt or the output (1: off); frequency_penalty and
    presence_penalty (OpenAI's, -2 to 2; 0: off) lower a token's logit by the first times
    how often the continuation has written it, and by the second once it has;
    logit_bias: {token id: -100 to 100} added to those tokens' logits (-100 bans one,
    100 all but forces it; decode/penalties.py; kept as sorted (id, bias) pairs, so that
    options stay hashable); stop: strings that end a generation
    where they first appear (left out of the text); beam > 1 is beam search (alpha its
    length penalty; no sampling, penalties, bias or streaming);
    batch_sentences: prompts generated together (left-padded); prompt_lookup K > 0:
    greedy search or sampling drafts up to K tokens a step by copying what followed the
    latest earlier occurrence of its last few tokens, and keeps those the model confirms
    in one pass; draft_tokens K > 0: the same with K tokens drafted by the Generator's
    draft model (decode/speculative.py: greedy search's output, or a sample of sampling's
    distribution, each prompt generated alone); draft_schedule: "adaptive" drafts fewer
    tokens after a step that rejected one and more after one that kept all, within 1..K
    (speculative.DraftLength), "constant" K every step; json_schema: a JSON Schema (a
    dict, or its JSON text; {"type": "object"} is any JSON object) that every
    continuation is an instance of, generated token by token within it
    (decode/constrained.py; kept as its JSON text, so that options stay hashable);
    grammar: the same for JSON with text around it (decode/reply_grammar.py: a forced
    tool call's form)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    beam: int = 1
    alpha: float = 0.6
    batch_sentences: int = 8
    prompt_lookup: int = 0
    draft_tokens: int = 0
    draft_schedule: DraftSchedule = "constant"
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    json_schema: Mapping[str, Any] | bool | str | None = None
    grammar: Mapping[str, Any] | str | None = None

    def __post_init__(self) -> None:
        self._check_floats_finite()
        check_positive(self, "max_new_tokens", "beam", "batch_sentences")
        check_at_least(self, 0, "temperature", "top_k", "alpha")
        for name in ("prompt_lookup", "draft_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"GenerateOptions.{name}={value!r}: must be an integer >= 0 "
                                  f"(0: off)")
        if self.draft_schedule not in choices(DraftSchedule):
            raise ConfigError(f"GenerateOptions.draft_schedule={self.draft_schedule!r}: choose "
                              f"one of {', '.join(choices(DraftSchedule))}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"GenerateOptions.top_p={self.top_p}: must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"GenerateOptions.min_p={self.min_p}: must be in [0, 1] (0: off)")
        if self.seed is not None and not is_sampling_seed(self.seed):
            raise ConfigError(f"GenerateOptions.seed={self.seed!r}: must be an integer from 0 "
                              f"to 2**63 - 1, or None")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"GenerateOptions.repetition_penalty={self.repetition_penalty}: "
                              f"must be positive (1: off)")
        if isinstance(self.stop, list):   # from the Python API or a JSON request
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s
                                                   for s in self.stop):
            raise ConfigError(f"GenerateOptions.stop={self.stop!r}: must be a sequence of "
                              f"non-empty strings")
        self._check_penalties()
        if self.beam > 1 and (self.temperature > 0 or self.penalized):
            raise ConfigError(f"GenerateOptions.beam={self.beam}: beam search ranks whole "
                              f"continuations; it takes no temperature, penalties or "
                              f"logit_bias")
        self._check_drafts()
        self._check_grammars()

    def _check_grammars(self) -> None:
        """A json_schema or a grammar that can be followed (json_schema.SchemaError
        otherwise), kept as its JSON text; not both; beam search and drafts follow
        neither."""
        from transduce.decode.json_schema import compile_schema
        from transduce.decode.reply_grammar import compile_grammar

        for name, compile_one in (("json_schema", compile_schema), ("grammar", compile_grammar)):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as error:
                    raise ConfigError(f"GenerateOptions.{name}: not JSON ({error})") from None
            compile_one(value, f"GenerateOptions.{name}")
            object.__setattr__(self, name, json.dumps(value, ensure_ascii=False))
            for option in ("beam", "prompt_lookup", "draft_tokens"):
                if getattr(self, option) > (option == "beam"):
                    raise ConfigError(f"GenerateOptions.{option}={getattr(self, option)}: a "
                                      f"{name} is followed by greedy search and sampling "
                                      f"one token at a time")
        if self.json_schema is not None and self.grammar is not None:
            raise ConfigError("GenerateOptions.grammar: give it or json_schema, not both")

    @property
    def reply_grammar(self) -> str | None:
        """What every continuation must be, as reply_grammar.py's JSON text (None: any
        text)."""
        if self.json_schema is not None:
            return f'{{"json": {self.json_schema}}}'
        return self.grammar

    def _check_penalties(self) -> None:
        """OpenAI's ranges: penalties from -2 to 2, biases from -100 to 100 by token id."""
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"GenerateOptions.{name}={getattr(self, name)}: must be "
                                  f"from -2 to 2 (0: off)")
        if self.logit_bias is None:
            return
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) \
            else self.logit_bias                          # pairs, as to_dict() writes them
        if isinstance(pairs, (str, bytes)) or not all(
                isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in pairs):
            raise ConfigError(f"GenerateOptions.logit_bias={self.logit_bias!r}: must map "
                              f"token ids to biases from -100 to 100")
        bias = {}
        for token, value in pairs:
            if isinstance(token, str) and token.isdigit():     # a JSON object's keys
                token = int(token)
            if type(token) is not int or token < 0:
                raise ConfigError(f"GenerateOptions.logit_bias: {token!r} is not a token id "
                                  f"(an integer >= 0)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not -100 <= value <= 100:
                raise ConfigError(f"GenerateOptions.logit_bias[{token}]={value!r}: must be a "
                                  f"number from -100 to 100")
            bias[token] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())) or None)

    def _check_drafts(self) -> None:
        """Drafts (prompt lookup's or a draft model's, not both) serve greedy search and
        sampling, one token a step at a time, penalized or not."""
        if self.prompt_lookup and self.draft_tokens:
            raise ConfigError(f"GenerateOptions.prompt_lookup={self.prompt_lookup} and "
                              f"draft_tokens={self.draft_tokens}: drafts come from prompt "
                              f"lookup or from a draft model; choose one")
        name = "prompt_lookup" if self.prompt_lookup else "draft_tokens"
        if getattr(self, name) and self.beam > 1:
            raise ConfigError(f"GenerateOptions.{name}={getattr(self, name)}: drafted tokens "
                              f"speed up greedy search and sampling (beam 1); a draft is "
                              f"kept only where they would choose it")

    @property
    def drafts(self) -> int:
        """Tokens drafted a step, by prompt lookup or a draft model (0: none)."""
        return self.prompt_lookup or self.draft_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether logits are changed before a token is chosen (decode/penalties.py)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or self.logit_bias is not None)


# Tokens (padding counted) of the batches of a pass over whole texts (embedding,
# classifying, scoring) when a call names none. PyTorch on a CPU runs small batches
# faster: their activations stay in the caches and under glibc's threshold for
# allocating by mmap, whose fresh pages a large tensor pays for at every operator. On a
# 2-core Zen 4, batches of 512 against 4,096 embedded 2.0x as many lines a second with
# bert-base's shape in int8, 1.3x in float32, 1.1x in bfloat16 (bench/encode.py), and
# scored 1.56x and 1.18x as many tokens with gpt2's in int8 and float32
# (bench/scoring.py); 256 to 1,024 ran alike. Where freed memory is kept (the command
# line and the server: runtime.keep_freed_memory), the caches alone: 1.38x and 1.22x
# embedding in int8 and float32. On an Emerald Rapids Xeon with AMX, 512 against 4,096
# embedded 2.62x as many lines in int8, 1.36x in float32, 1.24x in bfloat16. A GPU
# wants large batches.
CPU_PASS_TOKENS = 512
PASS_TOKENS = 4096


def pass_batch_tokens(device: torch.device | str) -> int:
    """The default tokens per batch of a pass over whole texts on `device` (see above)."""
    import torch   # the command line reads these options without torch

    return CPU_PASS_TOKENS if torch.device(device).type == "cpu" else PASS_TOKENS


def is_sampling_seed(value: object) -> bool:
    """Whether `value` seeds a sampler: an integer (not a bool) from 0 to 2**63 - 1, what
    torch.Generator.manual_seed takes."""
    return type(value) is int and 0 <= value < 2**63
