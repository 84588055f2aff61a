"""Pictures of what runs did: one run's loss and learning-rate curves, and several runs'
dev quality against training minutes.

Figures are drawn on matplotlib's Figure objects, never through pyplot, so plotting
changes no backend or global state of the process (a notebook keeps its own)."""

from __future__ import annotations

from pathlib import Path

from transduce import atomic
from transduce.errors import TransduceError
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
    lr_axis.set(xlabel="step", ylabel="learning rate", title="learning rate")
    lr_axis.grid(alpha=0.3)
    figure.tight_layout()
    out = out or run / "curves.png"
    with atomic.atomic_file(out) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    return out


def plot_quality_over_time(runs: list[Path], out: Path) -> Path:
    """Dev BLEU (greedy, from each run's evaluations) against training minutes, one line
    per run on one figure: which model is ahead at every budget. Runs trained without
    --dev-bleu-sentences have no BLEU to draw; dev loss is drawn beside it."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4))
    bleu_axis, loss_axis = figure.subplots(1, 2)
    drawn = 0
    for run in runs:
        dev = _dev_records_with_minutes(read_log(run))
        if not dev:
            continue
        minutes = [r["minutes"] for r in dev]
        loss_axis.plot(minutes, [r["dev_loss"] for r in dev], "o-", label=run.name)
        if all("dev_bleu_greedy" in r for r in dev):
            bleu_axis.plot(minutes, [r["dev_bleu_greedy"] for r in dev], "o-", label=run.name)
            drawn += 1
    if not drawn:
        raise TransduceError(f"none of {', '.join(map(str, runs))} logged dev BLEU: train with "
                             f"--dev-bleu-sentences N (and --eval-every) to race runs")
    bleu_axis.set(xlabel="training minutes", ylabel="dev BLEU (greedy)", title="quality at budget")
    loss_axis.set(xlabel="training minutes", ylabel="dev loss per target token", title="dev loss")
    for axis in (bleu_axis, loss_axis):
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    with atomic.atomic_file(out) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    return out


def _dev_records_with_minutes(records: list[dict]) -> list[dict]:
    """Dev evaluations with the training minutes they came at (logs written before dev
    records carried elapsed_s take it from the training record of the same step)."""
    elapsed_at = {r["step"]: r["elapsed_s"] for r in records if r.get("event") == "train"}
    dev = []
    for record in records:
        if record.get("event") != "dev":
            continue
        seconds = record.get("elapsed_s", elapsed_at.get(record["step"]))
        if seconds is not None:
            dev.append({**record, "minutes": seconds / 60})
    return dev
