"""Export a LoRA run's adapters (train/lora.py) as a PEFT adapter: adapter_config.json and
adapter_model.safetensors, which peft.PeftModel.from_pretrained puts on the Hugging Face
export of the checkpoint the run started from (`export hf BASE`), giving the run's
model: a language model's, or an encoder's (a classifier's head and pooler, trained
whole, go as PEFT's modules_to_save: BertForSequenceClassification's classifier and
pooler, RobertaForSequenceClassification's classifier). Where our layers and theirs lie
is importers/peft_layout.py.

GPT-2's q, k and v are one module, c_attn: our three adapters of rank r (or those of
them that were trained) become one of rank 3r there, A stacked and B block-diagonal,
which adds the same three updates; its rank and alpha are given in rank_pattern and
alpha_pattern, so that alpha / rank is the run's scale everywhere.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from transduce import atomic, checkpoint
from transduce.config import ModelConfig
from transduce.export.common import ExportError
from transduce.export.hf_decoder import check_decoder_exportable
from transduce.export.hf_encoder import (bert_state_dict, check_bert_exportable, is_roberta,
                                         roberta_state_dict)
from transduce.importers.peft_layout import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX,
                                              encoder_prefix, is_gpt2_layout, place_of,
                                              qkv_sizes)
from transduce.model import empty_model, load_model
from transduce.written import write_export_marker


def export_peft(path: Path | str, out: Path | str) -> Path:
    """Write the adapters of the LoRA checkpoint at `path` (or of a run's latest) as a
    PEFT adapter directory at `out` -> out."""
    path = checkpoint.resolve(Path(path))
    section = checkpoint.read_lora_section(path)
    if section is None:
        raise ExportError(f"{path}: not a LoRA run's checkpoint (train --init with "
                          f"--lora-rank writes those; a merged or averaged one has no "
                          f"adapters left): export hf writes a whole model")
    config, train_config = checkpoint.read_configs(path)
    if config.arch not in ("decoder", "encoder"):
        raise ExportError(f"{path}: export peft writes a language model's or an encoder's "
                          f"adapters; this is arch {config.arch!r}: export hf writes it merged")
    # The adapter is for `export hf` of the base, which must hold the model (meta: no memory).
    check = check_decoder_exportable if config.arch == "decoder" else check_bert_exportable
    check(empty_model(config, "meta"))
    try:
        adapters = load_file(str(path / checkpoint.ADAPTERS))
    except (SafetensorError, OSError) as error:
        raise ExportError(f"{path / checkpoint.ADAPTERS}: unreadable adapters ({error})") \
            from None
    rank, scale = int(section["rank"]), float(section["scale"])
    modules = _module_adapters(config, adapters, rank)
    settings = _adapter_config(config, modules, rank, scale,
                               train_config.lora_dropout if train_config else 0.0)
    whole = _trained_whole(path, config) if section.get("trained_whole") else {}
    if whole:
        settings |= {"task_type": "SEQ_CLS", "modules_to_save": _modules_to_save(config)}
    tensors = {f"{PREFIX}{module}.lora_{part}.weight": tensor.contiguous()
               for module, pair in modules.items() for part, tensor in zip("AB", pair)}
    with atomic.atomic_directory(out) as temporary:
        save_file(tensors | {f"{PREFIX}{name}": tensor for name, tensor in whole.items()},
                  str(temporary / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        atomic.open_permissions(temporary / ADAPTER_WEIGHTS)     # safetensors writes 0600
        (temporary / ADAPTER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n",
                                                encoding="utf-8")
        write_export_marker(temporary, "peft-lora", checkpoint.trained_steps(path),
                            base=section["base"])
    return Path(out)


def _modules_to_save(config: ModelConfig) -> list[str]:
    """The modules of a sequence classifier a LoRA run trains whole: BERT's classifier and
    pooler, or RoBERTa's classification head, which holds both."""
    return ["classifier"] if encoder_prefix(config) == "roberta." else ["classifier", "pooler"]


def _trained_whole(path: Path, config: ModelConfig) -> dict[str, Tensor]:
    """Those modules' weights under transformers' names, as `export hf` writes them."""
    model = load_model(path)
    state = roberta_state_dict(model) if is_roberta(model) else bert_state_dict(model)
    kept = tuple(f"{encoder_prefix(config)}{name}." if name == "pooler" else f"{name}."
                 for name in _modules_to_save(config))
    return {name: tensor for name, tensor in state.items() if name.startswith(kept)}


def _module_adapters(config: ModelConfig, adapters: dict[str, Tensor], rank: int
                     ) -> dict[str, tuple[Tensor, Tensor]]:
    """Hugging Face module -> its adapter (A (R, in), B (out, R)); a fused module's parts
    stacked along the rank, each part's B in its own rows."""
    parts: dict[str, dict[int, tuple[Tensor, Tensor]]] = defaultdict(dict)
    for name in sorted(adapters):
        if name.endswith(".lora_a"):
            layer = name.removesuffix(".lora_a")
            place = place_of(config, layer)
            parts[place.module][place.part] = (adapters[name], adapters[f"{layer}.lora_b"])
    modules = {}
    for module, held in parts.items():
        if len(held) == 1 and 0 in held and not module.endswith("c_attn"):
            modules[module] = held[0]
            continue
        sizes, order = qkv_sizes(config), sorted(held)
        a = torch.cat([held[part][0] for part in order])                  # (k r, in)
        b = torch.zeros(sum(sizes), rank * len(order), dtype=a.dtype)      # (q + k + v, k r)
        for column, part in enumerate(order):
            start = sum(sizes[:part])
            b[start:start + sizes[part], column * rank:(column + 1) * rank] = held[part][1]
        modules[module] = (a, b)
    return modules


def _adapter_config(config: ModelConfig, modules: dict[str, tuple[Tensor, Tensor]], rank: int,
                    scale: float, dropout: float) -> dict:
    """PEFT's LoraConfig for these modules: alpha / r is the run's scale, also where a
    fused module's rank is a multiple of r (every layer adapts the same parts)."""
    gpt2 = config.arch == "decoder" and is_gpt2_layout(config)     # Conv1D's layout
    fused_ranks = {a.shape[0] for module, (a, _) in modules.items() if module.endswith("c_attn")}
    fused = {}
    if fused_ranks:
        fused_rank, = fused_ranks
        fused = {"rank_pattern": {"c_attn": fused_rank},
                 "alpha_pattern": {"c_attn": fused_rank * scale}}
    task = "CAUSAL_LM" if config.arch == "decoder" else None      # SEQ_CLS: a classifier's
    return {"peft_type": "LORA", "task_type": task, "base_model_name_or_path": None,
            "r": rank, "lora_alpha": rank * scale, "lora_dropout": dropout,
            "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": gpt2,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "rank_pattern": {},
            "alpha_pattern": {}, **fused}
