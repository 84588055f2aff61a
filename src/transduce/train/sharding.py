"""Fully sharded data parallel training (TrainConfig.fsdp; torch.distributed.fsdp's
fully_shard): each process holds 1/N of every parameter, gradient and Adam moment and
gathers a layer's weights just before it runs, for models whose weights, gradients and
optimizer state do not fit one device. Checkpoints stay the ordinary full format:
the first process gathers the full weights and optimizer state and saves them as a
single process would, and a resumed run scatters them again, so every other command
(translate, average, export, a resume without FSDP) reads them unchanged.

torch.distributed's FSDP, DTensor and checkpoint modules take about a second to import:
the functions that use them import them, and only a sharded run calls those, so every
other `transduce train` starts that much sooner."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from transduce.config import ConfigError, ModelConfig, TrainConfig
from transduce.model import Model, empty_model


def check_fsdp_config(model_config: ModelConfig, train_config: TrainConfig, world: int) -> None:
    """Refuse, naming the option, what sharded training cannot do."""
    c = train_config
    if not c.fsdp:
        return
    if world < 2:
        raise ConfigError("TrainConfig.fsdp shards the model across torchrun processes; this "
                          "is one process: start it with torchrun --nproc_per_node N (N >= 2) "
                          "or pass --no-fsdp")
    if c.compile:
        raise ConfigError("TrainConfig.fsdp does not combine with compile: compiling a "
                          "sharded model is not supported here; pass --no-compile")
    if c.ema_decay:
        raise ConfigError(f"TrainConfig.fsdp does not combine with ema_decay={c.ema_decay}: "
                          f"the moving average would hold the full weights in every "
                          f"process; pass --ema-decay 0 (average checkpoints instead)")
    if model_config.arch.startswith("rnn"):
        raise ConfigError(f"TrainConfig.fsdp shards Transformer layers; arch "
                          f"{model_config.arch!r} has none (use DDP: --no-fsdp)")


def shard(net: torch.nn.Module, model: Model) -> None:
    """Shard every encoder and decoder layer of `model` as a unit of its own, then the
    rest (embeddings, heads, final norms) with `net`, the module stepped (the model, or
    an encoder's objective around it), whose forward gathers them."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for stack in (getattr(model, "encoder", None), getattr(model, "decoder", None)):
        for layer in getattr(stack, "layers", ()):
            cross = getattr(layer, "cross_attn", None)
            if cross is not None:
                # The decoder projects the source into each layer's keys and values
                # before any layer runs: that method must gather the weights too.
                fully_shard(cross)
                register_fsdp_forward_method(cross, "project_kv")
            fully_shard(layer)
    fully_shard(net)


@contextlib.contextmanager
def gradient_sync(net: torch.nn.Module, sync: bool) -> Iterator[None]:
    """The sharded DistributedDataParallel.no_sync: without sync, a batch's gradients
    accumulate unreduced until the step's last batch reduces them all at once."""
    if sync:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(net, FSDPModule)
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


@torch.no_grad()
def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> None:
    """clip_grad_norm_ over sharded gradients: each process holds part of every
    gradient, so the norm is a sum over all of them before it scales any."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)


def plain_model(model: Model) -> Model:
    """An unsharded model of the same configuration on the CPU, for the full weights
    (uninitialised: they are loaded next, and no random number is drawn)."""
    plain = empty_model(model.config)
    if getattr(model, "labels", None) is not None:
        plain.labels = list(model.labels)
        plain.classifier_inputs = getattr(model, "classifier_inputs", None)
    if getattr(model, "languages", None) is not None:
        plain.languages = model.languages
    if getattr(model, "language_codes", None) is not None:
        plain.language_codes = dict(model.language_codes)
    return plain


def gather_model(model: Model, main: bool) -> Model | None:
    """The full weights in an unsharded CPU copy, in the first process (None in the
    others). Every process must call it: the shards are gathered from all."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_gathered())
    if not main:
        return None
    plain = plain_model(model)
    plain.load_state_dict(state)
    return plain


def gather_optimizer(model: Model, optimizer: torch.optim.Optimizer, main: bool) -> dict | None:
    """The full optimizer state, in the format of an unsharded optimizer's state_dict()
    (parameters numbered), in the first process (None in the others). Every process
    must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_gathered())
    return numbered(state, model) if main else None


def scatter(model: Model, optimizer: torch.optim.Optimizer, weights: dict | None,
            optimizer_state: dict | None) -> None:
    """Load a full state (the first process's; None in the others) into the sharded
    model and optimizer: each process keeps its shards. Every process must call it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    # Only the first process's full state is read. strict off: the names of tied weights
    # are loaded once (unaliased); the full state was checked against the model when it
    # was read.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, unaliased(weights, model) if weights is not None else {},
                         options=options)
    state = named(optimizer_state, model) if optimizer_state is not None else {}
    set_optimizer_state_dict(model, optimizer, state, options=options)


def _gathered():
    """Gathered into the first process, on the CPU: what it saves needs no room on the
    device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def unaliased(weights: dict, model: torch.nn.Module) -> dict:
    """A full state dict without the second names of tied weights: loading one name
    fills the shared parameter (loading an alias too fails on sharded parameters)."""
    names = {name for name, _ in model.named_parameters()} | \
        {name for name, _ in model.named_buffers()}
    return {name: tensor for name, tensor in weights.items() if name in names}


def numbered(state: dict, model: torch.nn.Module) -> dict:
    """An optimizer state keyed by parameter names (torch.distributed.checkpoint's) ->
    keyed by position in model.parameters(), as Optimizer.state_dict() writes it."""
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    groups = [{**group, "params": [index[name] for name in group["params"]]}
              for group in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": groups}


def named(state: dict, model: torch.nn.Module) -> dict:
    """The inverse of numbered()."""
    names = [name for name, _ in model.named_parameters()]
    groups = [{**group, "params": [names[i] for i in group["params"]]}
              for group in state["param_groups"]]
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": groups}
