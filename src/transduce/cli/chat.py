"""`transduce chat`: a conversation with an instruct model, at a terminal or through a pipe.

Each line read is the user's next message. The model's reply to the whole conversation so
far, laid out by its chat template, is printed word by word as it is generated, on one
line (a newline in it as \\n, as `generate` writes). Where the conversation would leave
the reply fewer than --max-new-tokens positions of the model's context, its oldest
exchanges are left out, and standard error says so; --system's message always stays.
--template-var sets a variable of the template (a Qwen3's enable_thinking=false).
A thinking model's reasoning (Qwen3's <think> ... </think>, data/reasoning.py) goes to
standard error, on a line of its own, and its answer to standard output, so that a pipe
reads answers alone; the history keeps the reasoning apart, for the template to keep or
drop, as the server's chat does. With --json-schema or --json, such a model reasons
freely and its answer is kept to the schema, as the server's response_format.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transduce.cli.generate import add_sampling_options, add_template_var_option, \
    chat_variables, draft_settings, one_line, penalty_settings, user_turn
from transduce.cli.options import add_dtype_option, add_engine_option, add_kv_dtype_option


def register(commands) -> None:
    chat = commands.add_parser("chat", help="hold a conversation with an instruct model")
    chat.add_argument("--model", type=Path, required=True,
                      help="an instruct model's checkpoint, run directory or ONNX export")
    chat.add_argument("--system", default=None, help="the system message (default: none)")
    add_template_var_option(chat)
    add_sampling_options(chat)
    add_dtype_option(chat)
    add_kv_dtype_option(chat)
    add_engine_option(chat)
    chat.set_defaults(handler=chat_command)


def chat_command(args: argparse.Namespace) -> int:
    from transduce.data.chat import Message
    from transduce.data.reasoning import reasoning_first, reasoning_markers
    from transduce.decode.generate import Generator, prompt_seeds
    from transduce.decode.options import GenerateOptions
    from transduce.decode.streaming import line_batches

    draft, draft_tokens = draft_settings(args)
    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop), prompt_lookup=args.prompt_lookup, draft_tokens=draft_tokens,
        draft_schedule=args.draft_schedule,
        **penalty_settings(args))
    generator = Generator.load(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype,
                               engine=args.engine, draft=draft)
    variables = chat_variables(args, generator)
    # a model without a template, or a template refusing the variables: before input
    generator.chat_text(user_turn("", args.system, variables=variables))
    seed = prompt_seeds(options.seed, 1)[0]
    markers = reasoning_markers(generator.tokenizer)
    history: list[Message] = []
    turn = 0
    _ask()
    for lines in line_batches(sys.stdin.fileno(), max_lines=1):
        for line in lines:
            history = _fitting(generator, history, line, args.system, variables,
                               options.max_new_tokens)
            conversation = user_turn(line, args.system, history, variables)
            inside = markers is not None and markers.starts_inside(
                generator.encode([conversation])[0])
            reply = _Reply(markers, inside)
            for text in generator.stream(conversation, reasoning_first(options, markers, inside),
                                         number=turn + 1,
                                         seed=prompt_seeds(seed, 1, start=turn)[0]):
                reply.show(text)
            history += [Message("user", line), reply.finish()]
            turn += 1
        _ask()
    return 0


class _Reply:
    """A reply shown as it comes: a thinking model's reasoning on standard error, its
    answer on standard output, each on one line (markers None: all answer)."""

    def __init__(self, markers, inside: bool):
        from transduce.data.reasoning import ReasoningStream

        self.stream = None if markers is None else ReasoningStream(inside)
        self.text, self.reasoned = "", False

    def show(self, text: str) -> None:
        self.text += text
        self._write([("content", text)] if self.stream is None else self.stream.feed(text))

    def finish(self):
        """Ends the lines -> the reply as a message of the history."""
        from transduce.data.chat import Message
        from transduce.data.reasoning import split_reasoning

        if self.stream is not None:
            self._write(self.stream.finish())
        self._end_reasoning()
        sys.stdout.write("\n")
        if self.stream is None:
            return Message("assistant", self.text)
        reasoning, answer = split_reasoning(self.text, self.stream.inside)
        return Message("assistant", answer, reasoning)

    def _write(self, parts: list[tuple[str, str]]) -> None:
        for field, text in parts:
            if field == "reasoning_content":
                sys.stderr.write(one_line(text))
                sys.stderr.flush()
                self.reasoned = True
            else:
                self._end_reasoning()
                sys.stdout.write(one_line(text))
                sys.stdout.flush()

    def _end_reasoning(self) -> None:
        if self.reasoned:
            sys.stderr.write("\n")
            self.reasoned = False


def _fitting(generator, history: list, line: str, system: str | None, variables: dict,
             max_new: int) -> list:
    """The history without its oldest exchanges (user message and reply) as long as the
    conversation leaves the reply fewer than max_new positions."""
    while history:
        text = generator.chat_text(user_turn(line, system, history, variables))
        length = len(generator.tokenizer.encode([text])[0])
        if length + max_new <= generator.context:
            break
        history = history[2:]
        print(f"(the conversation is longer than the model's {generator.context} "
              f"positions leave room for: its oldest exchange is left out)", file=sys.stderr)
    return history


def _ask() -> None:
    """A prompt for the next message, at a terminal only."""
    if sys.stdin.isatty():
        sys.stderr.write("> ")
        sys.stderr.flush()
