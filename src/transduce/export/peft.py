"""Export a LoRA run's adapters (train/lora.py) as a PEFT adapter: adapter_config.json and
adapter_model.safetensors, which peft.PeftModel.from_pretrained puts on the Hugging Face
export of the checkpoint the run started from (`export hf BASE`), giving the run's
model: a language model's, an encoder's (a classifier's head and pooler, trained whole, go
as PEFT's modules_to_save: BertForSequenceClassification's classifier and pooler,
RobertaForSequenceClassification's classifier, DistilBertForSequenceClassification's
pre_classifier and classifier) or an encoder-decoder's (Marian, Pegasus,
NLLB or T5, whichever `export hf` writes). Where our layers and theirs lie, and how an
export's permuted or scaled weights change an adapter, is importers/peft_layout.py.

GPT-2's q, k and v are one module, c_attn: our three adapters of rank r (or those of
them that were trained) become one of rank 3r there, A stacked and B block-diagonal,
which adds the same three updates; its rank and alpha are given in rank_pattern and
alpha_pattern, so that alpha / rank is the run's scale everywhere. BLOOM's
query_key_value likewise, B's rows then put head by head as its weight's are (GPT-NeoX's
too, each head's query and key rows in its rotary order, as StableLM's, Phi's and
GPT-J's), and
ModernBERT's Wqkv (q, k, v) and Wi (linear1, linear3: rank 2r), whose classifiers,
taggers and answerers train its head (our pooler and its norm) and classifier whole.
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
from transduce.export.hf_encoder import check_bert_exportable, hf_state_dict
from transduce.importers.encoder_names import encoder_names
from transduce.importers.peft_layout import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX,
                                              Place, fused_rows, fused_sizes, is_gpt2_layout,
                                              place_of, residual_order, translation_family)
from transduce.model import empty_model, load_model
from transduce.model.positional import heads_in_rotary_order
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
    if config.arch.startswith("rnn"):
        raise ExportError(f"{path}: export peft writes a Transformer's adapters; this is arch "
                          f"{config.arch!r}")
    _check_base_exportable(path, config)
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
        settings |= {"task_type": "QUESTION_ANS" if config.question_answering else
                     "TOKEN_CLS" if config.token_classifier else "SEQ_CLS",
                     "modules_to_save": _modules_to_save(config)}
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


def _check_base_exportable(path: Path, config: ModelConfig) -> None:
    """The adapter is for `export hf` of the base, which must hold the model: checked on
    a model without memory (meta), or on the run's own for an encoder-decoder (the checks
    read its output bias, which LoRA leaves as the base's)."""
    if config.arch == "decoder":
        check_decoder_exportable(empty_model(config, "meta"))
    elif config.arch == "encoder":
        from transduce.export.hf_modernbert import check_modernbert_exportable, \
            is_modernbert_layout
        check = check_modernbert_exportable if is_modernbert_layout(config) \
            else check_bert_exportable
        check(empty_model(config, "meta"))
    elif translation_family(config) == "t5":
        from transduce.export import hf_t5
        hf_t5.check_exportable(load_model(path))
    elif translation_family(config) in ("m2m100", "mbart"):
        from transduce.export import hf_nllb
        hf_nllb.check_exportable(load_model(path), checkpoint.load_tokenizer(path))
    else:
        from transduce.export import hf
        hf.check_exportable(load_model(path))


def _modules_to_save(config: ModelConfig) -> list[str]:
    """The modules of a sequence classifier a LoRA run trains whole: BERT's classifier and
    pooler, RoBERTa's classification head, which holds both, DistilBERT's pre_classifier
    and classifier; a token classifier's classifier alone, a question answerer's
    qa_outputs (in every family); ModernBERT's head and classifier, for every task."""
    if config.prediction_head:
        return list(encoder_names(config).modules_to_save)
    if config.question_answering:
        return ["qa_outputs"]
    if config.token_classifier:
        return ["classifier"]
    return list(encoder_names(config).modules_to_save)


def _trained_whole(path: Path, config: ModelConfig) -> dict[str, Tensor]:
    """Those modules' weights under transformers' names, as `export hf` writes them."""
    from transduce.export.hf_modernbert import is_modernbert_layout, modernbert_state_dict

    kept = tuple(f"{name}." for name in _modules_to_save(config)) \
        if config.token_classifier or config.question_answering else \
        tuple(f"{theirs}." for theirs in encoder_names(config).classifier_head)
    state = (modernbert_state_dict if is_modernbert_layout(config) else hf_state_dict)(
        load_model(path))
    return {name: tensor for name, tensor in state.items() if name.startswith(kept)}


def _module_adapters(config: ModelConfig, adapters: dict[str, Tensor], rank: int
                     ) -> dict[str, tuple[Tensor, Tensor]]:
    """Hugging Face module -> its adapter (A (R, in), B (out, R)); a fused module's parts
    stacked along the rank, each part's B in its own rows."""
    parts: dict[str, dict[int, tuple[Tensor, Tensor]]] = defaultdict(dict)
    order = residual_order(config)
    for name in sorted(adapters):
        if name.endswith(".lora_a"):
            layer = name.removesuffix(".lora_a")
            place = place_of(config, layer)
            parts[place.module][place.part] = _as_exported(
                place, adapters[name], adapters[f"{layer}.lora_b"], order, config)
    modules = {}
    for module, held in parts.items():
        sizes = fused_sizes(config, module)
        if sizes is None:
            modules[module] = held[0]
            continue
        order = sorted(held)
        a = torch.cat([held[part][0] for part in order])                  # (k r, in)
        b = torch.zeros(sum(sizes), rank * len(order), dtype=a.dtype)      # (q + k + v, k r)
        for column, part in enumerate(order):
            start = sum(sizes[:part])
            b[start:start + sizes[part], column * rank:(column + 1) * rank] = held[part][1]
        rows = fused_rows(config, module)
        modules[module] = (a, b if rows is None else b[rows])
    return modules


def _as_exported(place: Place, a: Tensor, b: Tensor, order: Tensor | None,
                 config: ModelConfig) -> tuple[Tensor, Tensor]:
    """An adapter (A (r, in), B (out, r)) as `export hf` changes its layer's weight: the
    model dimension permuted by `order` where the layer reads or writes it, each head's
    query and key rows in the format's rotary order, B scaled as the weight is (their
    update, scale * B A, is then the exported weight's)."""
    if order is not None and place.reads_residual:
        a = a[:, order]
    if order is not None and place.writes_residual:
        b = b[order]
    if place.rotary_rows:
        b = heads_in_rotary_order(b, config.head_dim, config.rotary_dims, to_theirs=True,
                                  interleaved=place.rotary_pairs)
    return a, (b * place.weight_scale if place.weight_scale != 1 else b)


def _adapter_config(config: ModelConfig, modules: dict[str, tuple[Tensor, Tensor]], rank: int,
                    scale: float, dropout: float) -> dict:
    """PEFT's LoraConfig for these modules: alpha / r is the run's scale, also where a
    fused module's rank is a multiple of r (every layer adapts the same parts)."""
    gpt2 = config.arch == "decoder" and is_gpt2_layout(config)     # Conv1D's layout
    fused_ranks = {module.rpartition(".")[2]: a.shape[0] for module, (a, _) in modules.items()
                   if fused_sizes(config, module) is not None}
    fused = {"rank_pattern": fused_ranks,
             "alpha_pattern": {name: rank * scale for name, rank in fused_ranks.items()}} \
        if fused_ranks else {}
    # An encoder's none; a classifier's SEQ_CLS (export_peft).
    task = {"decoder": "CAUSAL_LM", "transformer": "SEQ_2_SEQ_LM"}.get(config.arch)
    return {"peft_type": "LORA", "task_type": task, "base_model_name_or_path": None,
            "r": rank, "lora_alpha": rank * scale, "lora_dropout": dropout,
            "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": gpt2,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "rank_pattern": {},
            "alpha_pattern": {}, **fused}
