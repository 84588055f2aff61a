"""Where a training run stands, and how it is saved and resumed exactly: weights,
optimizer, data position and every process's RNG state, in one checkpoint directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from transduce import checkpoint
from transduce.config import TrainConfig
from transduce.data.batching import Batcher
from transduce.train import sharding
from transduce.train.distributed import any_true, barrier, gather
from transduce.train.ema import WeightAverage
from transduce.train.lora import has_adapters, restore_adapters, saved_parts


@dataclass
class Position:
    """Where the run stands: what resuming needs besides weights and optimizer."""

    step: int = 0
    epoch: int = 0
    batch: int = 0          # batches of `epoch` already consumed
    tokens: int = 0         # target tokens trained on (scored ones)
    seconds: float = 0.0    # training time before this process started


class BatchStream:
    """The batches of epoch after epoch, deterministic from (seed, epoch, batch): any
    Batcher (sentence pairs, text lines, packed blocks) resumes from a Position."""

    def __init__(self, batcher: Batcher, position: Position):
        self.batcher, self.position = batcher, position
        self._epochs = {position.epoch: batcher.epoch_batches(position.epoch)}

    def take(self, count: int) -> list[np.ndarray]:
        return [indices for _, indices in self.take_keyed(count)]

    def take_keyed(self, count: int) -> list[tuple[tuple[int, int], np.ndarray]]:
        """The next `count` batches, each with its key (epoch, batch position): what
        seeds a batch's own randomness (an encoder's masks) so that it resumes exactly."""
        taken = self.peek_keyed(count)
        epoch, batch = taken[-1][0]
        self.position.epoch, self.position.batch = epoch, batch + 1
        self._epochs = {epoch: self._epochs[epoch]}
        return taken

    def peek_keyed(self, count: int) -> list[tuple[tuple[int, int], np.ndarray]]:
        """What take_keyed(count) would return, the position left where it is (the loop
        prepares the next step's batch with it, train/prefetch.py)."""
        epoch, batch = self.position.epoch, self.position.batch
        taken = []
        while len(taken) < count:
            if batch >= len(self._batches_of(epoch)):
                epoch, batch = epoch + 1, 0
            taken.append(((epoch, batch), self._batches_of(epoch)[batch]))
            batch += 1
        return taken

    def _batches_of(self, epoch: int) -> Sequence[np.ndarray]:
        """An epoch's batches, made once: the next epoch's stay for take_keyed when
        peek_keyed has reached into it."""
        if epoch not in self._epochs:
            self._epochs[epoch] = self.batcher.epoch_batches(epoch)
        return self._epochs[epoch]


def save_training_checkpoint(out: Path, model: torch.nn.Module, train_config: TrainConfig,
                             tokenizer_path: Path, optimizer: torch.optim.Optimizer,
                             position: Position, elapsed: float, world: int, rank: int,
                             ema: WeightAverage | None = None, *, sharded: bool = False
                             ) -> Path:
    """RUN/step-N with everything resuming needs; the first process writes it, all wait.
    elapsed: seconds this process has trained, added to the position's. sharded (FSDP):
    the full weights and optimizer state are gathered into the first process first, so
    the checkpoint is the one an unsharded run writes."""
    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    every_rng = gather(rng, world)
    path = checkpoint.step_dir(out, position.step)
    if sharded:
        optimizer_state = sharding.gather_optimizer(model, optimizer, rank == 0)
        model = sharding.gather_model(model, rank == 0)
    elif rank == 0:
        optimizer_state = optimizer.state_dict()
    if rank == 0:
        state = {"position": {**asdict(position), "seconds": position.seconds + elapsed},
                 "optimizer": optimizer_state, "rng": every_rng, "world_size": world,
                 **({"ema": ema.state_dict()} if ema is not None else {})}
        checkpoint.save(path, model, train_config, tokenizer_path, state, **saved_parts(model))
        checkpoint.keep_last(out, train_config.keep_last)
    barrier(world)
    return path


def restore(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
            device: torch.device, *, world: int = 1, sharded: bool = False
            ) -> tuple[Position, dict]:
    """Weights, optimizer, data position and RNG of the run's latest checkpoint.
    -> the position, and the whole trainer state (for what else the run keeps).
    sharded (FSDP): the first process reads the full state and scatters it."""
    latest = checkpoint.resolve(out)
    state = checkpoint.load_trainer_state(latest, device)
    if sharded:
        _scatter_checkpoint(latest, model, optimizer, state["optimizer"], rank, world, device)
    else:   # a LoRA run's frozen weights were read from its base: the adapters are read
        load = restore_adapters if has_adapters(model) else checkpoint.load_weights
        load(model, latest, device)
        _load_optimizer(optimizer, state["optimizer"], latest)
    rng = state["rng"][rank] if rank < len(state["rng"]) else state["rng"][0]
    # The state was read onto `device`; random states are set from CPU byte tensors.
    torch.set_rng_state(rng["torch"].cpu())
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"].cpu())
    return Position(**state["position"]), state


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict, latest: Path) -> None:
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as error:
        raise checkpoint.CheckpointError(f"{latest / checkpoint.TRAINER_STATE}: optimizer state "
                                         f"does not fit this model ({error})") from None


def _scatter_checkpoint(latest: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        optimizer_state: dict, rank: int, world: int,
                        device: torch.device) -> None:
    """Load a full checkpoint into a sharded model and optimizer. The first process
    checks it on an unsharded copy before anything is sent, and every process learns
    whether it fits, so that none waits forever for a scatter that will not come."""
    weights, error = None, None
    if rank == 0:
        try:
            plain = sharding.plain_model(model)
            checkpoint.load_weights(plain, latest)
            _load_optimizer(_adam_like(plain, optimizer), optimizer_state, latest)
            weights = plain.state_dict()
        except checkpoint.CheckpointError as failure:
            error = failure
    if any_true(error is not None, world, device):
        raise error or checkpoint.CheckpointError(f"{latest}: the first process could not "
                                                  f"load it (see its error)")
    sharding.scatter(model, optimizer, weights, optimizer_state if rank == 0 else None)


def _adam_like(model: torch.nn.Module, optimizer: torch.optim.Optimizer
               ) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s kind over `model`, to check a saved state against."""
    return type(optimizer)(model.parameters(), **optimizer.defaults)


def save_weight_average(out: Path, model: torch.nn.Module, ema: WeightAverage,
                        train_config: TrainConfig, tokenizer_path: Path, steps: int) -> Path:
    """RUN/ema: the moving average of the weights as a checkpoint of its own."""
    origin = {"ema_decay": ema.decay, "steps": steps}
    averaged = ema.averaged_model(model)
    return checkpoint.save(out / "ema", averaged, train_config, tokenizer_path, origin=origin,
                           **saved_parts(averaged))
