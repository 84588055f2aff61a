"""A LoRA run (TrainConfig.lora_rank > 0, model/lora.py): adapters beside the frozen
weights of --init's checkpoint.

Every checkpoint of the run holds the model with its adapters merged (model.safetensors,
a plain checkpoint that decoding, serving and every export read as any other) and the
adapters alone (adapter.safetensors, what `export peft` writes out). The trainer state
holds Adam's moments of the adapters only. Resuming rebuilds the model from the frozen
weights, read again from the checkpoint the run started from (config.json's "lora"
section names it), and the saved adapters; the merged weights saved beside them check
that the frozen ones are still the run's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig, TrainConfig, parse_lora_targets
from transduce.model.lora import (LoRALinear, LoRASettings, add_adapters, adapter_layers,
                                  adapter_weights, has_adapters, merged_weights,
                                  unadapted_state)
from transduce.streamed_safetensors import DTYPES_BY_CODE, Pending

# What fine-tuning a head trains whole beside the adapters: the new head (a classifier's,
# a tagger's, an answerer's), and a classifier's pooler under it, which masked-LM
# pre-training never trains (next-sentence prediction does; RoBERTa has none trained).
TRAINED_WHOLE = {"classify": ("classifier.", "pooler."), "tag": ("classifier.",),
                 "answer": ("classifier.",)}


def trained_whole(config: ModelConfig, task: str) -> tuple[str, ...]:
    """The prefixes of the parameters a LoRA run of `task` trains whole: TRAINED_WHOLE's,
    and for a model whose every head reads through its prediction head (ModernBERT's:
    the pooler and its norm, fresh over a masked LM) those too."""
    whole = TRAINED_WHOLE.get(task, ()) if config.arch == "encoder" else ()
    if whole and config.prediction_head:
        whole = tuple(dict.fromkeys((*whole, "pooler.", "pooler_norm.")))
    return whole


def check_lora_run(model_config: ModelConfig, train_config: TrainConfig,
                   init: Path | None, resumed: Path | None) -> None:
    """What a LoRA run cannot be, said before anything is loaded. resumed: the latest
    checkpoint of the run that resumes, which trains as it started."""
    if resumed is not None:
        _check_resumed(checkpoint.read_lora_section(resumed), train_config, resumed)
    if not train_config.lora_rank:
        return
    if init is None and resumed is None:
        raise ConfigError("--lora-rank adapts the weights of a trained model: give --init "
                          "(an imported or trained checkpoint)")
    if train_config.fsdp:
        raise ConfigError("--lora-rank with --fsdp: the adapters are small enough to "
                          "replicate; train them with DistributedDataParallel (no --fsdp)")
    if model_config.arch.startswith("rnn"):
        raise ConfigError("--lora-rank adapts a Transformer's attention and feed-forward "
                          "layers; an RNN encoder-decoder has none")


def check_base_dtype(train_config: TrainConfig, trains_in: str) -> None:
    """Frozen weights kept in bfloat16 are read by products in bfloat16 alone: the run
    must train under bfloat16 autocast (trains_in: its dtype, "auto" resolved). Weights
    kept in int8 or nf4 are dequantized to the dtype of any run."""
    if train_config.lora_base_dtype == "bfloat16" and trains_in != "bfloat16":
        raise ConfigError(f"--lora-base-dtype bfloat16 keeps the frozen weights in the dtype "
                          f"bfloat16 autocast multiplies in; this run trains in {trains_in} "
                          f"(--dtype {train_config.dtype}): give --dtype bfloat16")


def _check_resumed(section: dict | None, train_config: TrainConfig, path: Path) -> None:
    def described(rank: int, targets: str | None) -> str:
        return f"LoRA adapters of rank {rank} on {targets}" if rank else "every weight"

    saved = (int(section["rank"]), section.get("targets")) if section else (0, None)
    given = (train_config.lora_rank,
             train_config.lora_targets if train_config.lora_rank else None)
    if saved != given:
        raise ConfigError(f"--resume continues the run of {path}, which trains "
                          f"{described(*saved)}; the configuration given trains "
                          f"{described(*given)} (--lora-rank, --lora-targets)")


def adapt(model: nn.Module, train_config: TrainConfig, base: Path) -> None:
    """Add the run's adapters (the same in every process: drawn from the run's seed) and
    freeze every other weight but the heads the task trains whole. base: the checkpoint
    whose weights the adapters sit beside, recorded in every checkpoint of the run."""
    c = train_config
    settings = LoRASettings(c.lora_rank, c.lora_alpha, parse_lora_targets(c.lora_targets),
                            c.lora_dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(train_config.seed)
        add_adapters(model, settings)
    whole = trained_whole(model.config, train_config.task)
    for name, parameter in model.named_parameters():
        if name.startswith(whole):
            parameter.requires_grad_(True)
    if train_config.lora_base_dtype != "float32":
        counted = model.num_parameters()
        for layer in adapter_layers(model).values():
            layer.keep_frozen_in(train_config.lora_base_dtype)
        model.source_parameters = counted      # quantized weights are buffers
    model.lora_base, model.lora_targets = str(base.resolve()), train_config.lora_targets


def base_of_run(path: Path) -> Path:
    """The checkpoint a LoRA run's adapters sit beside, as its checkpoint at `path`
    records it; a clear error if it is gone."""
    section = checkpoint.read_lora_section(path)
    if section is None or not isinstance(section.get("base"), str):
        raise checkpoint.CheckpointError(f"{path}: a LoRA run's checkpoint without the "
                                         f"\"lora\" section naming its base checkpoint")
    base = Path(section["base"])
    if not (base / checkpoint.CONFIG).is_file():
        raise checkpoint.CheckpointError(f"{path}: resuming a LoRA run reads the frozen "
                                         f"weights of the checkpoint it started from, {base}, "
                                         f"which is no longer there")
    return base


def saved_parts(model: nn.Module) -> dict[str, Any]:
    """checkpoint.save's keyword arguments for a model with adapters: the merged
    weights, the adapters and the "lora" section (none for a plain model)."""
    if not has_adapters(model):
        return {}
    layers = adapter_layers(model)
    first = next(iter(layers.values()))
    whole = [name for name, parameter in model.named_parameters()
             if parameter.requires_grad and not name.endswith((".lora_a", ".lora_b"))]
    section = {"base": model.lora_base, "rank": first.lora_a.shape[0], "scale": first.scale,
               "targets": model.lora_targets, "layers": sorted(layers),
               "trained_whole": sorted(whole)}
    return {"weights": _merged_state(model), "adapters": adapter_weights(model),
            "lora": section}


def _merged_state(model: nn.Module) -> Mapping[str, torch.Tensor | Pending]:
    """The checkpoint's merged weights. Where the run keeps the frozen weights in less
    precision, each adapted weight is merged into the base checkpoint's when the
    checkpoint writes it (Pending): one float matrix in memory at a time, never the whole
    float model that the model in 4 or 8 bits stands in for."""
    if _kept_as_base(model):
        return merged_weights(model)
    layers = adapter_layers(model)
    base = Path(model.lora_base) / checkpoint.WEIGHTS
    state: dict[str, torch.Tensor | Pending] = dict(unadapted_state(model))
    with safe_open(str(base), framework="pt", device="cpu") as handle:
        for name, layer in layers.items():
            stored = handle.get_slice(f"{name}.weight")
            state[f"{name}.weight"] = Pending(
                DTYPES_BY_CODE[stored.get_dtype()], tuple(stored.get_shape()),
                functools.partial(_merged_into_base, layer, base, f"{name}.weight"))
            if layer.bias is not None:
                state[f"{name}.bias"] = handle.get_tensor(f"{name}.bias")
    return state


def _kept_as_base(model: nn.Module) -> bool:
    """Whether the run keeps every frozen weight as the base checkpoint has it (float32)."""
    return all(layer.frozen_format == "float32" for layer in adapter_layers(model).values())


def _merged_into_base(layer: LoRALinear, base: Path, name: str) -> torch.Tensor:
    with safe_open(str(base), framework="pt", device="cpu") as handle:
        return layer.merged_weight(handle.get_tensor(name))


@contextlib.contextmanager
def _originals(model: nn.Module) -> Iterator[Callable[[str], torch.Tensor] | None]:
    """name -> the base checkpoint's tensor, where the run keeps the frozen weights in
    less precision than the base's (the merged checkpoints keep the base's); else None."""
    if _kept_as_base(model):
        yield None
        return
    with safe_open(str(Path(model.lora_base) / checkpoint.WEIGHTS), framework="pt",
                   device="cpu") as handle:
        yield handle.get_tensor


def restore_adapters(model: nn.Module, path: Path, device: torch.device) -> None:
    """Load a checkpoint's adapters, and the heads trained whole, into `model` (its frozen
    weights already read from the run's base), then check that the merged result is the
    checkpoint's merged weights: another base checkpoint at the recorded path would
    resume silently wrong."""
    file = path / checkpoint.ADAPTERS
    try:
        stored = load_file(str(file), device=str(device))
    except (SafetensorError, OSError) as error:
        raise checkpoint.CheckpointError(f"{file}: unreadable adapters ({error})") from None
    targets = adapter_weights(model)
    if set(stored) != set(targets) or any(stored[k].shape != targets[k].shape for k in stored):
        raise checkpoint.CheckpointError(f"{file}: the adapters do not fit the run's "
                                         f"configuration (--lora-rank, --lora-targets)")
    whole = {name: parameter for name, parameter in model.named_parameters()
             if parameter.requires_grad and name not in targets}
    with torch.no_grad(), safe_open(str(path / checkpoint.WEIGHTS), framework="pt",
                                    device=str(device)) as handle:
        for name, tensor in stored.items():
            targets[name].copy_(tensor)
        for name, parameter in whole.items():
            parameter.copy_(handle.get_tensor(name))
    _check_merged(model, path)


def _check_merged(model: nn.Module, path: Path) -> None:
    """Layer by layer (one merged weight at a time in memory)."""
    with safe_open(str(path / checkpoint.WEIGHTS), framework="pt", device="cpu") as handle, \
            _originals(model) as originals:
        for name, layer in adapter_layers(model).items():
            saved = handle.get_tensor(f"{name}.weight").float()
            original = None if originals is None else originals(f"{name}.weight")
            ours = layer.merged_weight(original).float().cpu()
            if not torch.allclose(ours, saved, rtol=1e-4, atol=1e-6):
                raise checkpoint.CheckpointError(
                    f"{path}: its adapters added to the weights of {model.lora_base} do not "
                    f"give its merged weights ({name}): that checkpoint is not the one the "
                    f"run started from")
