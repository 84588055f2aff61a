"""Several training processes (torchrun: gloo on CPU, nccl on CUDA) acting as one; with
one process every helper here is a no-op."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, int]:
    """-> (world size, this process's rank), from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return world, int(os.environ.get("RANK", "0"))


def shutdown_distributed(world: int) -> None:
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def sum_over_processes(values: list[float], world: int, device: torch.device) -> list[float]:
    if world == 1:
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def any_true(flag: bool, world: int, device: torch.device) -> bool:
    """Whether any process says so: all stop together."""
    return sum_over_processes([float(flag)], world, device)[0] > 0


def gather(value: object, world: int) -> list[object]:
    """Every process's value, in rank order."""
    if world == 1:
        return [value]
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered
