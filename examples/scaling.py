"""Why the scores are divided by sqrt(d_k), measured (seeds 000 and 003).

For q and k with independent components of mean 0 and variance 1, q . k has variance d_k:
the larger the head, the larger the scores, the closer softmax comes to a one-hot vector,
and the smaller the gradient that reaches the queries. For each d_k this measures, with
and without the 1/sqrt(d_k) scale:

  - var(q . k), for random unit-variance q, k ("random") and for queries and keys from
    Xavier-initialised projections of unit-variance inputs, d_model = 4 d_k ("projected");
  - the entropy of softmax over S keys (log S is uniform, 0 is one-hot);
  - softmax's gain: ||dL/dz|| / ||dL/dp||, the share of the gradient arriving at the
    weights p that softmax passes on to its inputs z (the scaled or unscaled scores), for
    a loss that reads the output through fixed random weights of variance 1/d_k (so that
    dL/dp has the same scale at every d_k). As softmax saturates, its Jacobian
    diag(p) - p p^T goes to zero, and so does the gain;
  - and the norm of the gradient reaching the queries, dL/dq = dL/dz k (/ sqrt(d_k)).

    python examples/scaling.py [--keys 64] [--trials 200] [--out docs/figures/scaling.png]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

HEAD_SIZES = [16, 32, 64, 128, 256]


def queries_and_keys(d_k: int, keys: int, trials: int, projected: bool,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """-> q (trials, 1, d_k), k (trials, keys, d_k) with unit-variance components."""
    if not projected:
        return (torch.randn(trials, 1, d_k, generator=generator),
                torch.randn(trials, keys, d_k, generator=generator))
    d_model = 4 * d_k
    w_q, w_k = (torch.empty(d_model, d_k) for _ in range(2))
    for w in (w_q, w_k):
        bound = math.sqrt(6.0 / (d_model + d_k))           # Xavier uniform
        w.uniform_(-bound, bound, generator=generator)
    x = torch.randn(trials, keys, d_model, generator=generator)
    return x[:, :1] @ w_q, x @ w_k


def measure(d_k: int, keys: int, trials: int, scaled: bool, projected: bool) -> dict:
    generator = torch.Generator().manual_seed(d_k)
    q, k = queries_and_keys(d_k, keys, trials, projected, generator)
    v = torch.randn(trials, keys, d_k, generator=generator)
    read = torch.randn(trials, 1, d_k, generator=generator) / math.sqrt(d_k)  # the loss's
    q.requires_grad_(True)
    scores = q @ k.transpose(1, 2)                              # (trials, 1, S)
    if scaled:
        scores = scores / math.sqrt(d_k)
    scores.retain_grad()
    weights = scores.softmax(dim=-1)
    weights.retain_grad()
    (weights @ v * read).sum().backward()
    entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1)
    return {"d_k": d_k, "scaled": scaled, "projected": projected,
            "score_variance": float(scores.detach().var()),
            "entropy": float(entropy.detach().mean()),
            "max_weight": float(weights.detach().max(dim=-1).values.mean()),
            "softmax_gain": float((scores.grad.norm(dim=-1) / weights.grad.norm(dim=-1)).mean()),
            "query_grad_norm": float(q.grad.norm(dim=-1).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("docs/figures/scaling.png"))
    args = parser.parse_args()
    rows = [measure(d_k, args.keys, args.trials, scaled, projected)
            for projected in (False, True) for scaled in (True, False) for d_k in HEAD_SIZES]
    print(f"S = {args.keys} keys (uniform entropy log S = {math.log(args.keys):.2f}), "
          f"{args.trials} queries per cell\n")
    print("| q, k | scale | d_k | var(score) | softmax entropy | largest weight | softmax gain | ||dL/dq|| |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'projected' if r['projected'] else 'random'} | "
              f"{'1/sqrt(d_k)' if r['scaled'] else 'none'} | {r['d_k']} | "
              f"{r['score_variance']:.2f} | {r['entropy']:.2f} | {r['max_weight']:.2f} | "
              f"{r['softmax_gain']:.3f} | {r['query_grad_norm']:.3g} |")
    plot(rows, args.keys, args.out)


def plot(rows: list[dict], keys: int, out: Path) -> None:
    from matplotlib.figure import Figure   # no pyplot: no global state

    figure = Figure(figsize=(13, 3.4))
    panels = [("score_variance", "var(q . k)", True), ("entropy", "softmax entropy (nats)", False),
              ("softmax_gain", "softmax gain ||dL/dz|| / ||dL/dp||", True)]
    for i, (field, label, log) in enumerate(panels):
        axes = figure.add_subplot(1, 3, i + 1)
        for projected in (False, True):
            for scaled in (True, False):
                line = [r for r in rows if r["projected"] == projected and r["scaled"] == scaled]
                axes.plot([r["d_k"] for r in line], [r[field] for r in line], marker="o",
                          linestyle="-" if scaled else "--",
                          label=f"{'projected' if projected else 'random'}, "
                                f"{'scaled' if scaled else 'unscaled'}")
        if field == "entropy":
            axes.axhline(math.log(keys), color="grey", linewidth=0.8)
        axes.set_xscale("log", base=2)
        if log:
            axes.set_yscale("log")
        axes.set_xlabel("d_k")
        axes.set_title(label)
    figure.axes[0].legend(fontsize=7)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
