"""Speculative decoding (prompt lookup, a draft model) against greedy search or
sampling: one language model, the same prompts on every side, interleaved.

Two kinds of prompt, from the lines of a text corpus's --split:
- continue: a line's first --prompt-words words, continued; the continuation repeats
  its prompt or itself only where the text does;
- quote: --context lines, then the first --prompt-words words of the first of them
  again, continued; the continuation quotes what it has read, as an edit of a document,
  a summary or an answer over a passage does. The lines are laid out as packed training
  reads its stream (`--pack-length`: each line between bos and eos), so a model trained
  on blocks across lines reads them as it was trained to.

Peers: greedy search one prompt at a time (as prompt lookup runs), greedy search in
batches of --batch prompts (the Generator's default), prompt lookup drafting up to
K tokens a step for each K of --drafts, and prompt lookup with K = --modules whose steps
of several tokens run through the model's modules instead of the written-out decoder
step (model/decoder_step.py, MAX_STEP_TOKENS; what it ran before the step took them),
and with --draft-model, a smaller language model of the same tokenizer drafting K tokens
a step for each K of --drafts; each speculative side once for each --schedules (a
constant K, or adaptive: fewer drafts after a rejection, speculative.DraftLength). All
count generated tokens per second, the
median of --repeats interleaved rounds, and every side's tokens are checked to be
greedy search's. For each side: the model's passes (decode steps) per generated token,
and for prompt lookup the share of its drafted tokens kept.

With --temperature T > 0 every side samples instead (--top-p, seed 0): the speculative
sides draw other samples of the same distribution, so each side counts its own
generated tokens (a sample may end sooner or later) and no equality is checked.

    python bench/lookup.py --model runs/lm/ema --data data/bible-text [--prompts 64] \
        [--new-tokens 64] [--drafts 2 4 8] [--modules 4] [--dtype float32] \
        [--draft-model runs/lm-small/ema] [--temperature 0.8 --top-p 0.95]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce.data.corpus import read_lines  # noqa: E402
from transduce.decode import speculative  # noqa: E402
from transduce.decode.generate import Generator, PromptIds  # noqa: E402
from transduce.decode.options import GenerateOptions  # noqa: E402
from transduce.model import decoder_step  # noqa: E402
from transduce.runtime import keep_freed_memory  # noqa: E402


def prompts_of(kind: str, lines: list[str], tokenizer, args: argparse.Namespace
               ) -> list[PromptIds]:
    """--prompts prompts of `kind` ("continue" or "quote") from the corpus's lines, as
    ids: [bos] + the opening of a line, or [bos] line [eos] for each line of the context
    and then [bos] + the opening of the first."""
    bos, eos = tokenizer.bos_id, tokenizer.eos_id

    def opening(line: str) -> list[int]:
        return [bos, *tokenizer.encode([" ".join(line.split()[:args.prompt_words])])[0]]

    if kind == "continue":
        return [PromptIds(opening(line)) for line in lines[:args.prompts]]
    prompts = []
    for first in range(0, args.prompts * args.context, args.context):
        context = lines[first:first + args.context]
        ids = [token for line in tokenizer.encode(context) for token in [bos, *line, eos]]
        prompts.append(PromptIds(ids + opening(context[0])))
    return prompts


def named(schedule: str) -> str:
    """A side's name's mention of its draft schedule (none for the constant K)."""
    return "" if schedule == "constant" else f", {schedule}"


class CountedSteps:
    """The model's decode_step, counting its calls (not the draft model's) and, inside a
    speculative search, the drafted and kept tokens (speculative.greedy_verified and
    sampled_verified wrapped)."""

    def __init__(self, generator: Generator):
        self.steps = self.drafted = self.kept = 0
        step = generator.model.decode_step

        def counted_step(tokens, state):
            self.steps += 1
            return step(tokens, state)

        def counted(verified):
            def verify(draft, *rest):
                new = verified(draft, *rest)
                self.drafted, self.kept = self.drafted + len(draft), self.kept + len(new) - 1
                return new
            return verify

        generator.model.decode_step = counted_step
        speculative.greedy_verified = counted(speculative.greedy_verified)
        speculative.sampled_verified = counted(speculative.sampled_verified)

    def reset(self) -> None:
        self.steps = self.drafted = self.kept = 0


def compare(kind: str, prompts: list[PromptIds], generator: Generator, counter: CountedSteps,
            args: argparse.Namespace) -> dict:
    mode = "greedy" if not args.temperature else "sampling"
    alone = f"{mode}, one prompt at a time"
    sides = {alone: GenerateOptions(batch_sentences=1),
             f"{mode}, batches of {args.batch}": GenerateOptions(batch_sentences=args.batch),
             **{f"prompt lookup, K = {k}{named(schedule)}":
                GenerateOptions(prompt_lookup=k, draft_schedule=schedule)
                for k in args.drafts for schedule in args.schedules}}
    modules = f"prompt lookup, K = {args.modules}, steps through the modules"
    if args.modules:
        sides[modules] = GenerateOptions(prompt_lookup=args.modules,
                                         draft_schedule=args.schedules[0])
    if args.draft_model:
        sides.update({f"draft model, K = {k}{named(schedule)}":
                      GenerateOptions(draft_tokens=k, draft_schedule=schedule)
                      for k in args.drafts for schedule in args.schedules})
    sides = {name: dataclasses.replace(options, max_new_tokens=args.new_tokens,
                                       temperature=args.temperature, top_p=args.top_p, seed=0)
             for name, options in sides.items()}
    outputs: dict[str, list[list[int]]] = {}

    def call(name: str):
        def run():
            covered = decoder_step.MAX_STEP_TOKENS
            decoder_step.MAX_STEP_TOKENS = 1 if name == modules else covered
            try:
                rows = generator.generate_rows(prompts, sides[name])
            finally:
                decoder_step.MAX_STEP_TOKENS = covered
            outputs[name] = [row.tokens for row in rows]
        return run

    times = time_interleaved({name: call(name) for name in sides}, args.repeats)
    tokens = {name: sum(map(len, outputs[name])) for name in sides}  # a sample's own count
    passes, kept = {}, {}
    for name in sides:                       # once more, untimed, counting the passes
        counter.reset()
        call(name)()
        passes[name] = counter.steps / tokens[name]
        kept[name] = counter.kept / counter.drafted if counter.drafted else None
    reference = outputs[alone]
    same = None if args.temperature else \
        {name: sum(a == b for a, b in zip(outputs[name], reference)) for name in sides}
    rate = {name: tokens[name] / statistics.median(times[name]) for name in sides}
    base = rate[alone]
    for name in sides:
        share = "" if kept[name] is None else f", {100 * kept[name]:.0f}% of drafts kept"
        check = f"{tokens[name]} tokens" if same is None else \
            f"{same[name]}/{len(prompts)} outputs greedy search's"
        print(f"{kind}: {name}: {rate[name]:.1f} tokens/s ({rate[name] / base:.2f}x), "
              f"{passes[name]:.2f} passes a token{share}; {check}", flush=True)
    return {"prompts": kind, "generated_tokens": tokens, "tokens_per_s": rate,
            "over_one_at_a_time": {n: rate[n] / base for n in sides},
            "seconds": times, "passes_per_token": passes, "drafts_kept": kept,
            "outputs_equal_to_greedy": same,
            "example": generator.tokenizer.decode(list(prompts[0]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("data/bible-text"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=6)
    parser.add_argument("--context", type=int, default=3, help="lines before a quote")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", choices=("constant", "adaptive"),
                        default=["constant", "adaptive"],
                        help="draft schedules of the speculative sides (the first: --modules')")
    parser.add_argument("--modules", type=int, default=4,
                        help="K of the side whose steps run through the modules (0: none)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft-model", type=Path, default=None,
                        help="a smaller language model of the same tokenizer: its sides too")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="> 0: every side samples (seed 0) instead of greedy search")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/lookup-cpu.json"))
    args = parser.parse_args()
    keep_freed_memory()        # what `transduce generate` does for its process
    generator = Generator.load(args.model, dtype=args.dtype, draft=args.draft_model)
    counter = CountedSteps(generator)
    lines = read_lines(args.data / f"{args.split}.txt")
    rows = [compare(kind, prompts_of(kind, lines, generator.tokenizer, args), generator,
                    counter, args)
            for kind in ("continue", "quote")]
    draft = generator.draft
    result = {"benchmark": "lookup", "model": str(args.model),
              "parameters": generator.model.num_parameters(), "dtype": args.dtype,
              "draft_model": args.draft_model and str(args.draft_model),
              "draft_parameters": draft and draft.model.num_parameters(),
              "data": str(args.data), "split": args.split, "new_tokens": args.new_tokens,
              "temperature": args.temperature, "top_p": args.top_p,
              "machine": machine_info(torch.get_num_threads()), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
