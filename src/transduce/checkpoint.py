"""Checkpoints on disk, shared by training, decoding, conversion and export. One
directory each, written whole under a temporary name and renamed (atomic.py), so that a
crash, even SIGKILL, never leaves a half-written checkpoint in place:

    RUN/step-000500/
        config.json          {"model": ModelConfig, "train": TrainConfig, and for an
                             average or a conversion "origin": what it was made from}
        model.safetensors    weights (tied matrices stored once)
        spm.model            the tokenizer
        trainer_state.pt     optimizer, step, data position, RNG states (training only)

This module knows the format, not the models: it saves and fills any nn.Module with a
`config`, and `transduce.model.load_model` builds the model a checkpoint describes.
Every unreadable or corrupt file is a CheckpointError naming it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from transduce import atomic
from transduce.config import ConfigError, ModelConfig, TrainConfig
from transduce.data.tokenizer import MODEL_NAME
from transduce.errors import TransduceError

CONFIG, WEIGHTS, TOKENIZER, TRAINER_STATE = "config.json", "model.safetensors", MODEL_NAME, \
    "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(TransduceError, RuntimeError):
    """A checkpoint is missing, unreadable or corrupt; the message names the file."""


def step_dir(run: Path, step: int) -> Path:
    return run / f"step-{step:07d}"


def list_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    if not run.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / WEIGHTS).is_file()]
    return [p for _, p in sorted(found)]


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a run directory meaning its latest checkpoint."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return path
    checkpoints = list_checkpoints(path)
    if not checkpoints:
        raise CheckpointError(f"{path}: no checkpoint found (neither {WEIGHTS} nor step-* "
                              f"directories)")
    return checkpoints[-1]


def save(path: Path, model: nn.Module, train_config: TrainConfig | None,
         tokenizer_path: Path, trainer_state: dict[str, Any] | None = None,
         origin: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint directory atomically; an existing one at `path` is replaced.
    origin: how a derived checkpoint was made, with "steps" (the training steps behind it)."""
    with atomic.atomic_directory(path) as temporary:
        _write_config(temporary, model.config, train_config, origin)
        save_model(model, str(temporary / WEIGHTS))
        shutil.copyfile(tokenizer_path, temporary / TOKENIZER)
        if trainer_state is not None:
            torch.save(trainer_state, temporary / TRAINER_STATE)
    return path


def _write_config(directory: Path, model_config: ModelConfig, train_config: TrainConfig | None,
                  origin: dict[str, Any] | None) -> None:
    values = {"model": model_config.to_dict(),
              "train": None if train_config is None else train_config.to_dict(),
              **({"origin": origin} if origin else {})}
    (directory / CONFIG).write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")


def remove_stale_temporaries(run: Path) -> None:
    """Leftovers of a save that was killed midway (they were never renamed into place)."""
    atomic.remove_temporaries(run, "step-")


def keep_last(run: Path, count: int) -> None:
    for old in list_checkpoints(run)[:-count]:
        shutil.rmtree(old)


def read_configs(path: Path) -> tuple[ModelConfig, TrainConfig | None]:
    """The model and training configurations a checkpoint directory records."""
    values = _read_config_json(path)
    try:
        model_config = ModelConfig.from_dict(values["model"])
        train_config = None if values.get("train") is None else TrainConfig.from_dict(values["train"])
    except (KeyError, TypeError, ConfigError) as error:
        raise CheckpointError(f"{path / CONFIG}: unreadable checkpoint configuration "
                              f"({type(error).__name__}: {error})") from None
    return model_config, train_config


def _read_config_json(path: Path) -> dict[str, Any]:
    config_file = Path(path) / CONFIG
    if not config_file.is_file():
        raise CheckpointError(f"{path}: not a checkpoint (no {CONFIG})")
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_file}: unreadable ({error})") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object")
    return values


def load_weights(model: nn.Module, path: Path, device: torch.device | str = "cpu") -> None:
    """Fill `model` with the weights of checkpoint directory `path`; they must match it
    name for name and shape for shape."""
    file = Path(path) / WEIGHTS
    try:
        missing, unexpected = load_model(model, str(file), strict=False, device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"{file}: unreadable or corrupt weights "
                              f"({type(error).__name__}: {error})") from None
    if missing or unexpected:
        raise CheckpointError(f"{file}: weights do not match the configuration "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")


def load_trainer_state(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The optimizer, position and RNG states a training checkpoint holds."""
    file = Path(path) / TRAINER_STATE
    if not file.is_file():
        raise CheckpointError(f"{path}: no trainer state ({TRAINER_STATE}) to resume from")
    try:
        state = torch.load(file, map_location=device, weights_only=False)
    except Exception as error:  # noqa: BLE001 - unpickling a corrupt file raises anything
        raise CheckpointError(f"{file}: unreadable or corrupt trainer state "
                              f"({type(error).__name__}: {error})") from None
    missing = {"position", "optimizer", "rng"} - set(state if isinstance(state, dict) else ())
    if missing:
        raise CheckpointError(f"{file}: unreadable or corrupt trainer state (no "
                              f"{', '.join(sorted(missing))})")
    return state


def trained_steps(path: Path) -> int | None:
    """The training steps behind a checkpoint: its trainer state's step, else the steps
    its origin records (averages and conversions), else None."""
    path = resolve(path)
    if (path / TRAINER_STATE).is_file():
        return int(load_trainer_state(path)["position"]["step"])
    return (_read_config_json(path).get("origin") or {}).get("steps")


def average(checkpoints: list[Path], out: Path) -> Path:
    """The element-wise mean of the checkpoints' weights, as the paper averages the last
    5 (base) or 20 (big) checkpoints; written as a checkpoint without trainer state."""
    if not checkpoints:
        raise CheckpointError("no checkpoints to average")
    configs = {json.dumps(read_configs(p)[0].to_dict(), sort_keys=True) for p in checkpoints}
    if len(configs) != 1:
        raise CheckpointError("the checkpoints have different model configurations")
    total, metadata = _read_tensors(checkpoints[0] / WEIGHTS)
    dtypes = {name: tensor.dtype for name, tensor in total.items()}
    total = {name: tensor.double() for name, tensor in total.items()}
    for path in checkpoints[1:]:
        tensors, _ = _read_tensors(path / WEIGHTS)
        if tensors.keys() != total.keys():
            raise CheckpointError(f"{path / WEIGHTS}: other tensors than {checkpoints[0]}")
        for name, tensor in tensors.items():
            total[name] += tensor.double()
    mean = {name: (summed / len(checkpoints)).to(dtypes[name]) for name, summed in total.items()}
    last = checkpoints[-1]
    model_config, train_config = read_configs(last)
    origin = {"averaged": [str(p) for p in checkpoints], "steps": trained_steps(last)}
    with atomic.atomic_directory(out) as temporary:
        _write_config(temporary, model_config, train_config, origin)
        save_file(mean, str(temporary / WEIGHTS), metadata=metadata)
        shutil.copyfile(last / TOKENIZER, temporary / TOKENIZER)
    return out


def _read_tensors(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """A safetensors file's tensors and metadata (which names a tied tensor stands for)."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata()
        return load_file(str(file)), metadata
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: unreadable or corrupt weights ({error})") from None
