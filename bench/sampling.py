"""The cost of drawing a token: temperature, top-k, top-p (nucleus) and min-p filtering
and the draw, ours against the full sort a nucleus was found by before and against
transformers' logits warpers, on a trained language model's own next-token logits.

The logits are the model's after every position of --lines lines of a text corpus's
--split (each line [bos] + its tokens, read in one causal pass), so the distributions
are what generation meets, peaked after most tokens and flat after some. Each case
(temperature, top_k, top_p, min_p) runs every peer over the same rows, --batch rows a call,
interleaved over --repeats rounds; counted: rows a second (a row is one prompt's step).
Peers:
- ours: Sampler.weights then Sampler.draw (decode/sampling.py), the nucleus looked for
  among the likeliest NUCLEUS_CANDIDATES first;
- full sort: the same with the nucleus found by sorting every token (what
  filter_logits did before);
- transformers: TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
  MinPLogitsWarper, softmax and torch.multinomial.
Every peer's kept tokens are checked equal to ours (transformers' up to rows where
rounding differs at the nucleus's edge, counted). Also: the nuclei's sizes.

    python bench/sampling.py --model runs/lm/ema --data data/bible-text [--lines 64] \
        [--batch 1 8] [--repeats 5] [--out bench/results/sampling-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce.data.corpus import read_lines  # noqa: E402
from transduce.decode import sampling  # noqa: E402
from transduce.decode.generate import Generator  # noqa: E402
from transduce.decode.sampling import Sampler  # noqa: E402

CASES = [(1.0, 0, 0.9, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 0, 0.95, 0.0), (1.0, 50, 1.0, 0.0),
         (1.0, 50, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (1.0, 0, 0.95, 0.05)]


def corpus_logits(generator: Generator, lines: list[str]) -> torch.Tensor:
    """The model's logits after every token of each line: (N, V) float32."""
    rows = []
    with torch.inference_mode():
        for ids in generator.encode(lines):
            rows.append(generator.model(torch.tensor([ids]))[0].float())
    return torch.cat(rows)


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by sorting every token (filter_logits before NUCLEUS_CANDIDATES)."""
    ordered, order = probs.sort(dim=-1, descending=True)
    in_sorted = ordered.cumsum(dim=-1) - ordered < top_p
    in_sorted[:, 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, in_sorted)


def transformers_draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.generation.logits_process import (MinPLogitsWarper,
                                                        TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.multinomial(scores.softmax(dim=-1), 1)[:, 0], scores.isfinite()


def compare(logits: torch.Tensor, case: tuple[float, int, float, float], batch: int,
            repeats: int) -> dict:
    temperature, top_k, top_p, min_p = case
    sampler = Sampler(temperature, top_k, top_p, seed=0, min_p=min_p)
    chunks = list(logits.split(batch))
    kept: dict[str, list[torch.Tensor]] = {}

    def ours(nucleus=sampling.nucleus, name="ours"):
        def run():
            sampling.nucleus, original = nucleus, sampling.nucleus
            try:
                kept[name] = []
                for chunk in chunks:
                    weights = sampler.weights(chunk)
                    sampler.draw(weights, list(range(len(chunk))))
                    kept[name].append(weights > 0)
            finally:
                sampling.nucleus = original
        return run

    def theirs():
        kept["transformers"] = [transformers_draw(chunk, *case)[1] for chunk in chunks]

    peers = {"ours": ours(), "full sort": ours(sorted_nucleus, "full sort"),
             "transformers": theirs}
    times = time_interleaved(peers, repeats)
    rate = {name: len(logits) / statistics.median(times[name]) for name in peers}
    mine = torch.cat(kept["ours"])
    differing = {name: int((torch.cat(kept[name]) != mine).any(dim=-1).sum()) for name in peers}
    sizes = mine.sum(dim=-1).float()
    result = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
              "batch": batch,
              "rows": len(logits), "rows_per_s": rate,
              "over_full_sort": rate["ours"] / rate["full sort"],
              "over_transformers": rate["ours"] / rate["transformers"],
              "rows_kept_differently": differing,
              "nucleus_size": {"median": sizes.median().item(),
                               "p90": sizes.quantile(0.9).item(), "max": sizes.max().item(),
                               "share_within_64": (sizes <= 64).float().mean().item()}}
    print(f"T={temperature} top_k={top_k} top_p={top_p} min_p={min_p} batch {batch}: ours "
          f"{rate['ours']:,.0f} rows/s, {result['over_full_sort']:.2f}x the full sort, "
          f"{result['over_transformers']:.2f}x transformers; nucleus median "
          f"{sizes.median():.0f}, p90 {sizes.quantile(0.9):.0f}; rows kept differently "
          f"{differing}", flush=True)
    assert differing["full sort"] == 0, "the full sort kept other tokens"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("data/bible-text"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/sampling-cpu.json"))
    args = parser.parse_args()
    generator = Generator.load(args.model, dtype="float32")
    logits = corpus_logits(generator, read_lines(args.data / f"{args.split}.txt")[:args.lines])
    rows = [compare(logits, case, batch, args.repeats) for case in CASES for batch in args.batch]
    result = {"benchmark": "sampling", "model": str(args.model),
              "vocabulary": logits.shape[-1], "data": str(args.data), "split": args.split,
              "nucleus_candidates": list(sampling.NUCLEUS_CANDIDATES),
              "machine": machine_info(torch.get_num_threads()), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
