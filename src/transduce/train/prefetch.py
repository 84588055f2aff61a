"""The next batch collated and on its way to the device while the device runs this one.

Why: on a GPU a step is queued, not run, by the host; the host then waits for the
step's loss. Collating a batch (numpy, several milliseconds for 25,000 tokens) after
that wait leaves the GPU idle for as long, every step. Prepared while the step runs,
the batch is there when the loss arrives. Its copy to the GPU is from pinned memory:
one from pageable memory may hold the host until the GPU has run the kernels queued
before it, which is the wait this module is for.

Nothing here reads or advances the batch stream, and collating draws from no global
RNG (an encoder's masks come from a generator seeded by the batch's key), so a run
steps through the same batches, with the same randomness, as without it; a run that
stops drops the prepared batch, and its checkpoint resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

Key = tuple[int, int]   # (epoch, batch position): BatchStream's keys
# (key, indices) -> (the batch on the host, its training FLOPs)
Collate = Callable[[Key, np.ndarray], tuple[Any, float]]


class BatchPrefetch:
    """take() hands the batch prepare() made for that key, or collates it then."""

    def __init__(self, collate: Collate, device: torch.device):
        self.collate, self.device = collate, device
        self.prepared: dict[Key, tuple[Any, float]] = {}

    def prepare(self, key: Key, indices: np.ndarray) -> None:
        """Collate the batch of `key` and start its copy to the device (not waited for);
        what was prepared before and not taken is dropped."""
        self.prepared = {key: self._collated(key, indices)}

    def take(self, key: Key, indices: np.ndarray) -> tuple[Any, float]:
        """-> the batch of `key` on the device and its FLOPs."""
        ready = self.prepared.pop(key, None)
        return ready if ready is not None else self._collated(key, indices)

    def _collated(self, key: Key, indices: np.ndarray) -> tuple[Any, float]:
        batch, flops = self.collate(key, indices)
        if self.device.type == "cuda":
            batch = pinned(batch)
        return batch.to(self.device), flops


def pinned(batch: Any) -> Any:
    """A Batch or EncoderBatch (a dataclass of tensors and Nones) with its tensors in
    page-locked memory, so that copies to a GPU do not wait for the queued kernels."""
    return dataclasses.replace(batch, **{
        field.name: value.pin_memory() for field in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, field.name), Tensor)})
