"""Checkpoints: one directory each, written under a temporary name and renamed, so that
a crash (even SIGKILL) never leaves a half-written checkpoint in place.

    RUN/step-000500/
        config.json          {"model": ModelConfig, "train": TrainConfig, and for an
                             average or a conversion "origin": what it was made from}
        model.safetensors    weights (tied matrices stored once)
        spm.model            the tokenizer
        trainer_state.pt     optimizer, step, data position, RNG states (training only)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_model

from transduce.config import ModelConfig, TrainConfig
from transduce.model import Seq2SeqModel, build_model

CONFIG, WEIGHTS, TOKENIZER, TRAINER_STATE = "config.json", "model.safetensors", "spm.model", \
    "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unreadable; the message names it."""


def step_dir(run: Path, step: int) -> Path:
    return run / f"step-{step:07d}"


def list_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    if not run.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / WEIGHTS).is_file()]
    return [p for _, p in sorted(found)]


def save(path: Path, model: Seq2SeqModel, train_config: TrainConfig | None,
         tokenizer_path: Path, trainer_state: dict[str, Any] | None = None,
         origin: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint directory atomically; an existing one at `path` is replaced.
    origin: how a derived checkpoint was made, with "steps" (the training steps behind it)."""
    temporary = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir(parents=True)
    config = {"model": model.config.to_dict(),
              "train": None if train_config is None else train_config.to_dict(),
              **({"origin": origin} if origin else {})}
    (temporary / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_model(model, str(temporary / WEIGHTS))
    shutil.copyfile(tokenizer_path, temporary / TOKENIZER)
    if trainer_state is not None:
        torch.save(trainer_state, temporary / TRAINER_STATE)
    _fsync_dir(temporary)
    if path.exists():
        old = path.with_name(f".old-{path.name}-{os.getpid()}")
        path.rename(old)
        temporary.rename(path)
        shutil.rmtree(old)
    else:
        temporary.rename(path)
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    """Flush the files of a directory (and its entries) to disk before it is renamed."""
    for file in directory.iterdir():
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(run: Path) -> None:
    """Leftovers of a save that was killed midway (they were never renamed into place)."""
    if run.is_dir():
        for leftover in run.glob(".tmp-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)


def keep_last(run: Path, count: int) -> None:
    for old in list_checkpoints(run)[:-count]:
        shutil.rmtree(old)


def read_configs(path: Path) -> tuple[ModelConfig, TrainConfig | None]:
    config_file = path / CONFIG
    if not config_file.is_file():
        raise CheckpointError(f"{path}: not a checkpoint (no {CONFIG})")
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
        model_config = ModelConfig.from_dict(values["model"])
        train_config = None if values.get("train") is None else TrainConfig.from_dict(values["train"])
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{config_file}: unreadable checkpoint configuration ({error})") from None
    return model_config, train_config


def trained_steps(path: Path) -> int | None:
    """The training steps behind a checkpoint: its trainer state's step, else the steps
    its origin records (averages and conversions), else None."""
    path = resolve(path)
    state_file = path / TRAINER_STATE
    if state_file.is_file():
        return int(torch.load(state_file, map_location="cpu", weights_only=False)["position"]["step"])
    try:
        origin = json.loads((path / CONFIG).read_text(encoding="utf-8")).get("origin") or {}
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path / CONFIG}: unreadable ({error})") from None
    return origin.get("steps")


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a run directory meaning its latest checkpoint."""
    if (path / WEIGHTS).is_file():
        return path
    checkpoints = list_checkpoints(path)
    if not checkpoints:
        raise CheckpointError(f"{path}: no checkpoint found (neither {WEIGHTS} nor step-* "
                              f"directories)")
    return checkpoints[-1]


def load_model_from(path: Path, device: torch.device | str = "cpu") -> Seq2SeqModel:
    """The model of a checkpoint (or of a run's latest checkpoint), in eval mode."""
    path = resolve(path)
    model_config, _ = read_configs(path)
    model = build_model(model_config)
    missing, unexpected = load_model(model, str(path / WEIGHTS), device=str(device))
    if missing or unexpected:
        raise CheckpointError(f"{path / WEIGHTS}: weights do not match the configuration "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device).eval()


def average(checkpoints: list[Path], out: Path) -> Path:
    """The element-wise mean of the checkpoints' weights, as the paper averages the last
    5 (base) or 20 (big) checkpoints; written as a checkpoint without trainer state."""
    if not checkpoints:
        raise CheckpointError("no checkpoints to average")
    model = load_model_from(checkpoints[0])
    configs = {json.dumps(read_configs(p)[0].to_dict(), sort_keys=True) for p in checkpoints}
    if len(configs) != 1:
        raise CheckpointError("the checkpoints have different model configurations")
    total = {name: tensor.double() for name, tensor in load_file(str(checkpoints[0] / WEIGHTS)).items()}
    for path in checkpoints[1:]:
        for name, tensor in load_file(str(path / WEIGHTS)).items():
            total[name] += tensor.double()
    state = model.state_dict()
    with torch.no_grad():
        for name, summed in total.items():
            state[name].copy_(summed / len(checkpoints))
    _, train_config = read_configs(checkpoints[-1])
    origin = {"averaged": [str(p) for p in checkpoints], "steps": trained_steps(checkpoints[-1])}
    return save(out, model, train_config, checkpoints[-1] / TOKENIZER, origin=origin)
