"""Pictures of what a run did: loss and learning-rate curves (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_log(run: Path) -> list[dict]:
    path = run / "log.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training log")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def plot_training(run: Path, out: Path | None = None) -> Path:
    """Training and dev loss against step on the left, the learning rate on the right."""
    records = read_log(run)
    train = [r for r in records if r.get("event") == "train"]
    dev = [r for r in records if r.get("event") == "dev"]
    figure, (loss_axis, lr_axis) = plt.subplots(1, 2, figsize=(11, 4))
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
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
