"""`transduce generate`: continue prompts with a decoder-only model.

Prompts come from --prompt (repeatable) or standard input, one per line; each gives one
output line, in order. With --chat, each prompt is a user's message to an instruct model
(with --system's message before it), laid out by the model's chat template (which reads
--template-var's variables too), and the line is the model's reply (`transduce chat`
holds a conversation). A newline inside a continuation is written as the two characters
\\n (and a backslash as \\\\), so that N prompts always give N lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from transduce.cli.options import add_dtype_option, add_engine_option, add_kv_dtype_option, \
    fraction, non_negative_float, non_negative_int, positive_int, sampling_seed
from transduce.config import ConfigError, choices
from transduce.decode.options import DraftSchedule

if TYPE_CHECKING:
    from transduce.data.chat import Chat, Message

STDIN_BATCH_LINES = 64
DRAFT_TOKENS = 4       # a draft model's tokens a step, unless --draft-tokens says


def register(commands) -> None:
    generate = commands.add_parser("generate", help="continue prompts with a language model")
    generate.add_argument("--model", type=Path, required=True,
                          help="checkpoint, run directory or ONNX export")
    generate.add_argument("--prompt", action="append", default=None,
                          help="a prompt (repeatable; default: one per line of standard input)")
    add_sampling_options(generate)
    generate.add_argument("--beam", type=positive_int, default=1, help="beam search (1: off)")
    generate.add_argument("--alpha", type=non_negative_float, default=0.6,
                          help="beam search's length penalty exponent")
    generate.add_argument("--batch-sentences", type=positive_int, default=8,
                          help="prompts generated together")
    generate.add_argument("--stream", action="store_true",
                          help="print each continuation word by word as it is generated")
    generate.add_argument("--chat", action="store_true",
                          help="each prompt is a user's message to an instruct model, laid "
                               "out by its chat template; print the reply")
    generate.add_argument("--system", default=None,
                          help="with --chat: a system message before each user message")
    add_template_var_option(generate, "with --chat: ")
    add_dtype_option(generate)
    add_kv_dtype_option(generate)
    add_engine_option(generate)
    generate.set_defaults(handler=generate_command)


def add_template_var_option(command: argparse.ArgumentParser, prefix: str = "") -> None:
    """--template-var NAME=VALUE, shared with `transduce chat`."""
    command.add_argument("--template-var", dest="template_vars", action="append", default=[],
                         type=template_var, metavar="NAME=VALUE",
                         help=f"{prefix}a variable of the chat template, VALUE read as JSON "
                              f"where it is (enable_thinking=false), else as text; repeatable")


def template_var(text: str) -> tuple[str, Any]:
    """NAME=VALUE -> (NAME, VALUE as JSON, or the text where it is none)."""
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def chat_variables(args: argparse.Namespace, generator) -> dict[str, Any]:
    """--template-var's variables, checked against the generator's chat template (a
    ChatError names the bad one)."""
    from transduce.data.chat import template_variables

    template = getattr(generator.tokenizer, "chat_template", None)
    return template_variables(dict(args.template_vars), "--template-var",
                              tokens=template.tokens if template else ())


def add_sampling_options(command: argparse.ArgumentParser) -> None:
    """The settings of how each token is chosen, shared with `transduce chat`."""
    command.add_argument("--max-new-tokens", type=positive_int, default=64)
    command.add_argument("--temperature", type=non_negative_float, default=0.0,
                         help="0: greedy search; above 0: sampling")
    command.add_argument("--top-k", type=non_negative_int, default=0,
                         help="sample among the k most likely tokens (0: all)")
    command.add_argument("--top-p", type=fraction, default=1.0,
                         help="sample within the smallest set of this probability (nucleus)")
    command.add_argument("--min-p", type=non_negative_float, default=0.0,
                         help="sample among tokens at least this times as likely as the "
                              "likeliest (min-p, 0 to 1; 0: all)")
    command.add_argument("--seed", type=sampling_seed, default=None, help="repeatable sampling")
    command.add_argument("--repetition-penalty", type=_positive_float, default=1.0,
                         help="> 1 discourages tokens already in prompt or output (1: off)")
    command.add_argument("--frequency-penalty", type=float, default=0.0,
                         help="-2 to 2: lower a token's logit by this times how often the "
                              "continuation has it (OpenAI's; 0: off)")
    command.add_argument("--presence-penalty", type=float, default=0.0,
                         help="-2 to 2: lower a token's logit by this once the "
                              "continuation has it (OpenAI's; 0: off)")
    command.add_argument("--logit-bias", type=_token_bias, action="append", default=[],
                         metavar="ID=BIAS",
                         help="add BIAS (-100 to 100) to token ID's logit; -100 bans it "
                              "(repeatable)")
    command.add_argument("--stop", action="append", default=[],
                         help="end a continuation where this string appears (repeatable)")
    command.add_argument("--json-schema", type=_json_schema, default=None, metavar="FILE",
                         help="every continuation is an instance of this JSON Schema, "
                              "generated token by token within it")
    command.add_argument("--json", action="store_true",
                         help="every continuation is a JSON object (--json-schema's "
                              "{\"type\": \"object\"})")
    command.add_argument("--prompt-lookup", type=non_negative_int, default=0, metavar="K",
                         help="draft up to K tokens a step by copying what followed the "
                              "last few tokens where they occurred before, and keep those "
                              "the model confirms in one pass: greedy search's output, or a "
                              "sample of the same distribution, faster where the text "
                              "repeats what it has read (0: off)")
    command.add_argument("--draft-model", type=Path, default=None, metavar="PATH",
                         help="a smaller language model of the same tokenizer drafts tokens "
                              "that are kept where the model confirms them in one pass "
                              "(speculative decoding): greedy search's output, or a sample "
                              "of the same distribution")
    command.add_argument("--draft-tokens", type=non_negative_int, default=None, metavar="K",
                         help=f"with --draft-model: tokens it drafts a step (default "
                              f"{DRAFT_TOKENS})")
    command.add_argument("--draft-schedule", default="constant", choices=choices(DraftSchedule),
                         help="constant: K drafted tokens a step; adaptive: one fewer after "
                              "a step that rejected one, two more after a step that kept "
                              "all, within 1..K")


def draft_settings(args: argparse.Namespace) -> tuple[Path | None, int]:
    """--draft-model and the tokens it drafts a step (0 without it)."""
    if args.draft_model is None:
        if args.draft_tokens:
            raise ConfigError("--draft-tokens: the tokens a draft model drafts; give "
                              "--draft-model too (or draft by --prompt-lookup)")
        return None, 0
    return args.draft_model, DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens


def _token_bias(text: str) -> tuple[int, float]:
    """--logit-bias's ID=BIAS."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a token id and a bias, as "
                                         f"50256=-100") from None


def _json_schema(path: str) -> dict:
    """--json-schema's file, read as JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"{path}: not a readable JSON file "
                                         f"({error})") from None


def penalty_settings(args: argparse.Namespace) -> dict:
    """GenerateOptions' frequency and presence penalties, logit bias and JSON schema from
    the flags."""
    if args.json and args.json_schema is not None:
        raise ConfigError("--json and --json-schema: --json is any object; give one")
    return {"frequency_penalty": args.frequency_penalty,
            "presence_penalty": args.presence_penalty,
            "logit_bias": dict(args.logit_bias) or None,
            "json_schema": {"type": "object"} if args.json else args.json_schema}


def _positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text}: must be positive")
    return value


def generate_command(args: argparse.Namespace) -> int:
    from transduce.data.reasoning import reasoning_markers
    from transduce.decode.generate import Generator, prompt_seeds
    from transduce.decode.options import GenerateOptions

    if (args.system is not None or args.template_vars) and not args.chat:
        option = "--system" if args.system is not None else "--template-var"
        raise ConfigError(f"{option} applies to --chat's conversations: give --chat too")
    draft, draft_tokens = draft_settings(args)
    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop), beam=args.beam, alpha=args.alpha,
        batch_sentences=args.batch_sentences, prompt_lookup=args.prompt_lookup,
        draft_tokens=draft_tokens, draft_schedule=args.draft_schedule, **penalty_settings(args))
    generator = Generator.load(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype,
                               engine=args.engine, draft=draft)
    variables = chat_variables(args, generator) if args.chat else {}
    if args.chat:
        # a model without a template, or a template refusing the variables: before input
        generator.chat_text(user_turn("", args.system, variables=variables))
    seed = prompt_seeds(options.seed, 1)[0]      # one run, one seed: prompt k draws the k-th
    markers = reasoning_markers(generator.tokenizer) if args.chat else None
    done = 0
    for prompts in _prompt_batches(args):
        if args.chat:
            prompts = [user_turn(prompt, args.system, variables=variables)
                       for prompt in prompts]
        seeds = prompt_seeds(seed, len(prompts), start=done)
        groups = reasoning_groups(generator, prompts, options, markers, done + 1)
        if args.stream:
            for prompt, prompt_seed, prompt_options in zip(prompts, seeds, _each(groups)):
                done += 1
                for text in generator.stream(prompt, prompt_options, number=done,
                                             seed=prompt_seed):
                    sys.stdout.write(one_line(text))
                    sys.stdout.flush()
                sys.stdout.write("\n")
        else:
            texts: list[str] = [""] * len(prompts)
            for group_options, rows in groups:
                replies = generator.generate([prompts[row] for row in rows], group_options,
                                             first_number=done + 1 + rows[0],
                                             seeds=[seeds[row] for row in rows])
                for row, text in zip(rows, replies):
                    texts[row] = text
            sys.stdout.write("".join(one_line(text) + "\n" for text in texts))
            done += len(prompts)
        sys.stdout.flush()
    return 0


def reasoning_groups(generator, prompts: list, options, markers, first_number: int
                     ) -> list[tuple[Any, list[int]]]:
    """The prompts (their rows) by the options they generate with: with a reply grammar
    (--json-schema, --json), a thinking model (markers given) reasons freely first and
    its answer is kept to the grammar (data/reasoning.reasoning_first), which depends on
    whether the prompt opened the reasoning block; otherwise all take `options`."""
    from transduce.data.reasoning import reasoning_first

    if markers is None or options.reply_grammar is None:
        return [(options, list(range(len(prompts))))]
    inside = [markers.starts_inside(ids) for ids in generator.encode(prompts, first_number)]
    return [(reasoning_first(options, markers, opened),
             [row for row, flag in enumerate(inside) if flag == opened])
            for opened in dict.fromkeys(inside)]


def _each(groups: list[tuple[Any, list[int]]]) -> list:
    """Each row's options, in row order."""
    options = {row: group_options for group_options, rows in groups for row in rows}
    return [options[row] for row in sorted(options)]


def _prompt_batches(args: argparse.Namespace):
    if args.prompt is not None:
        yield args.prompt
        return
    from transduce.decode.streaming import line_batches

    yield from line_batches(sys.stdin.fileno(), max_lines=STDIN_BATCH_LINES)


def user_turn(text: str, system: str | None, history: Sequence[Message] = (),
              variables: dict[str, Any] | None = None) -> "Chat":
    """A conversation ending in the user's message `text`: the system message, if any,
    the turns before, then this one; `variables` for its template (checked)."""
    from transduce.data.chat import Chat, Message

    first = () if system is None else (Message("system", system),)
    return Chat((*first, *history, Message("user", text)), variables or {})


def one_line(text: str) -> str:
    """A continuation on one output line: backslashes and newlines escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
