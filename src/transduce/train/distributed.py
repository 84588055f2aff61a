"""Several training processes (torchrun: gloo on CPU, nccl on CUDA) acting as one; with
one process every helper here is a no-op."""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist

from transduce.config import ConfigError


def init_distributed() -> tuple[int, int]:
    """-> (world size, this process's rank), from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # Before the group exists: imported later (DistributedDataParallel's constructor
        # imports it, torch.compile too), torch._dynamo keeps references to the default
        # group for good, and destroy_process_group can no longer free it.
        import torch._dynamo  # noqa: F401
        cuda = torch.cuda.is_available()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda and local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"torchrun started process {local_rank} on a machine with "
                f"{torch.cuda.device_count()} GPU(s): start at most one process per GPU "
                f"(--nproc-per-node), or hide the GPUs (CUDA_VISIBLE_DEVICES='') to train "
                f"in CPU processes over gloo")
        dist.init_process_group("nccl" if cuda else "gloo")
    return world, int(os.environ.get("RANK", "0"))


def shutdown_distributed(world: int, finished: bool = True) -> None:
    """Destroy the process group, for good: its backend's threads (gloo's workers and
    its TCP loop) are joined before this returns, so none of them is still running
    while the interpreter exits. The caller must have dropped what holds the group (a
    DistributedDataParallel module: its reducer; the module sits in a reference cycle,
    hence the collection). finished: every process got here the normal way, so all
    wait for each other first; after an error nobody waits for a process that may be
    gone."""
    if world > 1 and dist.is_initialized():
        _forget_device_meshes()
        gc.collect()
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def _forget_device_meshes() -> None:
    """Empty DTensor's caches (sharded training, FSDP): they keep every device mesh
    their entries name, a mesh keeps its process groups, and a group kept alive keeps
    its gloo threads running past destroy_process_group. Private functions of torch
    2.13, each skipped where this torch lacks it."""
    if "torch.distributed.tensor" not in sys.modules:
        return      # nothing was sharded
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
    from torch.distributed.tensor import debug

    propagator = DTensor._op_dispatcher.sharding_propagator
    topology = getattr(_collective_utils, "MeshTopoInfo", None)
    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),
                  getattr(getattr(topology, "build_from_mesh", None), "cache_clear", None),
                  getattr(getattr(propagator, "_propagate_tensor_meta_cached", None),
                          "cache_clear", None),
                  getattr(_redistribute._gen_transform_infos, "cache_clear", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None)):
        if clear is not None:
            clear()


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
