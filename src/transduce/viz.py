"""Pictures of what runs did: one run's loss and learning-rate curves, and several runs'
dev quality against training minutes.

Figures are drawn on matplotlib's Figure objects, never through pyplot, so plotting
changes no backend or global state of the process (a notebook keeps its own)."""

from __future__ import annotations

import json
from pathlib import Path

from transduce import atomic
from transduce.errors import TransduceError
from transduce.train.log import LOG_NAME, read_log


def plot_training(run: Path, out: Path | None = None) -> Path:
    """Training and dev loss against step on the left, the learning rate on the right."""
    from matplotlib.figure import Figure

    records = read_log(run)
    train = _events(records, "train", ("step", "loss", "lr"), run)
    dev = _events(records, "dev", ("step", "dev_loss"), run)
    if not train:
        raise TransduceError(f"{run / LOG_NAME}: no training steps logged yet (one record "
                             f"every log_every steps); nothing to plot")
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
        dev = _dev_records_with_minutes(read_log(run), run)
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


def _events(records: list[dict], event: str, fields: tuple[str, ...], run: Path) -> list[dict]:
    """The log's records of one event; one without a number in a field drawn is an error
    naming the log and the record."""
    found = [r for r in records if r.get("event") == event]
    for record in found:
        missing = [f for f in fields if type(record.get(f)) not in (int, float)]
        if missing:
            raise TransduceError(f"{run / LOG_NAME}: a {event!r} record without a number for "
                                 f"{', '.join(missing)}: {json.dumps(record)[:120]}")
    return found


def _dev_records_with_minutes(records: list[dict], run: Path) -> list[dict]:
    """Dev evaluations with the training minutes they came at (logs written before dev
    records carried elapsed_s take it from the training record of the same step)."""
    elapsed_at = {r.get("step"): r.get("elapsed_s") for r in records if r.get("event") == "train"}
    dev = []
    for record in _events(records, "dev", ("step", "dev_loss"), run):
        seconds = record.get("elapsed_s", elapsed_at.get(record["step"]))
        if type(seconds) in (int, float):
            dev.append({**record, "minutes": seconds / 60})
    return dev
