"""Pictures of what a run did: loss and learning-rate curves.

Figures are drawn on matplotlib's Figure objects, never through pyplot, so plotting
changes no backend or global state of the process (a notebook keeps its own)."""

from __future__ import annotations

from pathlib import Path

from transduce import atomic
from transduce.train.log import read_log


def plot_training(run: Path, out: Path | None = None) -> Path:
    """Training and dev loss against step on the left, the learning rate on the right."""
    from matplotlib.figure import Figure

    records = read_log(run)
    train = [r for r in records if r.get("event") == "train"]
    dev = [r for r in records if r.get("event") == "dev"]
    figure = Figure(figsize=(11, 4))
    loss_axis, lr_axis = figure.subplots(1, 2)
    loss_axis.plot([r["step"] for r in train], [r["loss"] for r in train],
                   label="train (label-smoothed)")
    if dev:
        loss_axis.plot([r["step"] for r in dev], [r["dev_loss"] for r in dev], "o-", label="dev")
    loss_axis.set(xlabel="step", ylabel="loss per target token", title=run.name)
    loss_axis.legend()
    loss_axis.grid(alpha=0.3)
    lr_axis.plot([r["step"] for r in train], [r["lr"] for r in train])
    lr_axis.set(xlabel="step", ylabel="learning rate", title="warmup + inverse square root")
    lr_axis.grid(alpha=0.3)
    figure.tight_layout()
    out = out or run / "curves.png"
    with atomic.atomic_file(out) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    return out
