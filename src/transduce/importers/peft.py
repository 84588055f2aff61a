"""A PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors) trained on a
Hugging Face Llama, Mistral, Qwen2, GPT-2, BLOOM, GPT-NeoX, StableLM, Phi, GPT-J, BERT,
RoBERTa, DistilBERT, ELECTRA, Marian, NLLB, mBART-50 or T5 model -> our checkpoint of that
model, imported (`import hf-llama`, `hf-gpt2`, `hf-bloom`, `hf-gpt-neox`, `hf-stablelm`,
`hf-phi`, `hf-gptj`, `hf-bert`, `hf-roberta`, `hf-distilbert`, `hf-electra`, `hf-marian`,
`hf-nllb`, `hf-mbart`, `hf-t5`) or the one `export hf` wrote it from, with the adapter
merged into its weights.

Each adapted module's update, scale * B A with scale = alpha / r (alpha / sqrt(r) with
use_rslora; rank_pattern and alpha_pattern read as PEFT reads them), is added to the weight
of the layer (importers/peft_layout.py) it sits on, in our layout (Marian's and Pegasus's
model dimension permuted back, T5's queries scaled back, GPT-NeoX's, StableLM's, Phi's and
GPT-J's query and key rows put in our order of each head's features); GPT-2's c_attn's
rows go to q, k and v, as Phi-3's qkv_proj's do (BLOOM's and GPT-NeoX's
query_key_value's, head by head, likewise), and its gate_up_proj's to the gate and up
projections.
A sequence classifier's head and pooler, trained whole (modules_to_save), replace the
base's (importers/peft_heads.py); a language model's adapters on lm_head and its token
embedding go to its output projection and embedding (importers/peft_vocabulary.py). What
would compute something else (DoRA, trained biases, other modules trained whole, an
adapter on a module we do not adapt) is refused by name, and nothing is written.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from transduce import checkpoint
from transduce.config import ModelConfig
from transduce.importers import ForeignCheckpointError
from transduce.importers.hf_gemma import PROJECTION_FACTOR
from transduce.importers.hf_gpt2 import _read_json
from transduce.importers.peft_heads import HEAD_KINDS, check_modules_to_save, with_heads
from transduce.importers.peft_layout import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, Place,
                                              fused_place_of, fused_rows, is_adaptable,
                                              place_of, residual_order)
from transduce.importers.peft_vocabulary import VOCABULARY_MODULES, vocabulary_updates
from transduce.model import load_model
from transduce.model.positional import heads_in_rotary_order

_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
# An adapted embedding's halves (A (r, V), B (d, r)), and the vocabulary matrices PEFT
# saves beside an adapter on either (peft_vocabulary.py).
_EMBEDDING_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_embedding_([AB])(?:\.[^.]+)?$")
_BASE_LAYER = re.compile(r"^base_model\.model\.(.+)\.base_layer\.weight$")
_WHOLE = re.compile(r"^base_model\.model\.(.+\.(?:weight|bias))$")   # modules_to_save's
# Options whose other value computes something a merged LoRA update does not.
_REFUSED = {"use_dora": False, "bias": "none", "layer_replication": None, "lora_bias": False}


def import_peft(adapter_dir: Path | str, base: Path | str, out: Path | str) -> Path:
    """Merge the PEFT LoRA adapter at `adapter_dir` into a copy of our checkpoint `base`
    (a Transformer of any shape) and write it at `out` -> out."""
    adapter_dir, base = Path(adapter_dir), checkpoint.resolve(Path(base))
    settings = _read_settings(adapter_dir)
    base_config, train_config = checkpoint.read_configs(base)
    arch = base_config.arch
    if arch.startswith("rnn"):
        raise ForeignCheckpointError(f"{base}: arch {arch!r}; a PEFT adapter is merged into a "
                                     f"Transformer")
    check_modules_to_save(settings, arch, adapter_dir / ADAPTER_CONFIG)
    tensors = _read_tensors(adapter_dir, bool(settings.get("modules_to_save")))
    model = load_model(base)
    if tensors.whole and arch == "encoder":
        model = with_heads(model, tensors.whole, adapter_dir / ADAPTER_WEIGHTS,
                           HEAD_KINDS.get(settings.get("task_type"), "texts"))
    model = vocabulary_updates(model, *_vocabulary(settings, tensors, arch, adapter_dir),
                               adapter_dir / ADAPTER_WEIGHTS)
    layers = _layers_by_module(model)
    order = residual_order(model.config)
    query_factor = checkpoint.read_origin(base).get(PROJECTION_FACTOR, 1.0)
    for module, (a, b) in sorted(tensors.pairs.items()):
        if module in VOCABULARY_MODULES:
            continue
        delta = _scale(settings, module) * (b.double() @ a.double())         # (out, in)
        if module.endswith("self_attn.q_proj"):      # an import's folded query scale
            delta = delta * query_factor
        rows = fused_rows(model.config, module)      # BLOOM's, head by head: [q; k; v]
        if rows is not None:
            delta = delta[rows.argsort()]
        _add_update(_our_layers(layers, module, adapter_dir), delta, order, model.config,
                    f"{adapter_dir / ADAPTER_WEIGHTS}: {module}'s update")
    tokenizer = base / ("tokenizer.json" if checkpoint.holds_tokenizer_json(base)
                        else checkpoint.TOKENIZER)
    origin = {"peft_adapter": str(adapter_dir.resolve()), "base": str(base.resolve()),
              **({"steps": steps} if (steps := checkpoint.trained_steps(base)) else {})}
    return checkpoint.save(Path(out), model, train_config, tokenizer, origin=origin)


def _read_settings(adapter_dir: Path) -> dict:
    file = adapter_dir / ADAPTER_CONFIG
    if not file.is_file():
        raise ForeignCheckpointError(f"{adapter_dir}: not a PEFT adapter (no {ADAPTER_CONFIG})")
    settings = _read_json(file)
    kind = settings.get("peft_type")
    if kind != "LORA":
        raise ForeignCheckpointError(f"{file}: peft_type={kind!r}; only LoRA adapters "
                                     f"(\"LORA\") are merged")
    for name, ours in _REFUSED.items():
        if settings.get(name, ours) not in (ours, [], {}, False):
            raise ForeignCheckpointError(f"{file}: {name}={json.dumps(settings[name])} is not "
                                         f"supported (only {json.dumps(ours)}: a low-rank "
                                         f"update of the weights alone)")
    for name in ("r", "lora_alpha"):
        if not isinstance(settings.get(name), (int, float)) or settings[name] <= 0:
            raise ForeignCheckpointError(f"{file}: {name} must be a positive number, "
                                         f"not {settings.get(name)!r}")
    return settings


@dataclass
class AdapterTensors:
    """An adapter's weights file read: module -> (A (r, in), B (out, r)) of its Linear
    layers (pairs) and of its embeddings (A (r, V), B (d, r)); the vocabulary matrices
    saved beside them by module (base_layers); modules_to_save's weights by name."""

    pairs: dict[str, tuple[Tensor, Tensor]]
    embeddings: dict[str, tuple[Tensor, Tensor]]
    base_layers: dict[str, Tensor]
    whole: dict[str, Tensor]


def _read_tensors(adapter_dir: Path, heads: bool) -> AdapterTensors:
    """The adapter's weights file, read (heads: modules_to_save is set); keys of nothing
    a merge computes are refused by name."""
    file = adapter_dir / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ForeignCheckpointError(f"{adapter_dir}: no {ADAPTER_WEIGHTS} (an adapter saved "
                                     f"with safe_serialization=False: load and save it again "
                                     f"with PEFT's default)")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as error:
        raise ForeignCheckpointError(f"{file}: unreadable ({error})") from None
    halves: dict[str, dict[str, Tensor]] = {}
    embedding_halves: dict[str, dict[str, Tensor]] = {}
    base_layers: dict[str, Tensor] = {}
    whole: dict[str, Tensor] = {}
    for key, tensor in tensors.items():
        found, embedding = _KEY.match(key), _EMBEDDING_KEY.match(key)
        base_layer, trained = _BASE_LAYER.match(key), _WHOLE.match(key)
        if found is not None:
            halves.setdefault(found[1], {})[found[2]] = tensor
        elif embedding is not None:
            embedding_halves.setdefault(embedding[1], {})[embedding[2]] = tensor
        elif base_layer is not None and base_layer[1] in VOCABULARY_MODULES:
            base_layers[base_layer[1]] = tensor
        elif heads and trained is not None:
            whole[trained[1]] = tensor
        else:
            raise ForeignCheckpointError(f"{file}: {key} is not a LoRA matrix (lora_A or "
                                         f"lora_B); only LoRA's updates are merged")
    pairs, embeddings = (_paired(file, found) for found in (halves, embedding_halves))
    unknown = sorted(set(embeddings) - set(VOCABULARY_MODULES))
    if unknown:
        raise ForeignCheckpointError(f"{file}: an adapter on the embedding {unknown[0]}; only a "
                                     f"language model's token embedding is merged")
    return AdapterTensors(pairs, embeddings, base_layers, whole)


def _paired(file: Path, halves: dict[str, dict[str, Tensor]]
            ) -> dict[str, tuple[Tensor, Tensor]]:
    """module -> (A, B), each module's two halves found."""
    unpaired = sorted(module for module, pair in halves.items() if len(pair) != 2)
    if unpaired:
        raise ForeignCheckpointError(f"{file}: {unpaired[0]} has lora_A or lora_B, not both")
    return {module: (pair["A"], pair["B"]) for module, pair in halves.items()}


def _vocabulary(settings: dict, tensors: AdapterTensors, arch: str, adapter_dir: Path
                ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A language model's vocabulary matrices in the adapter: module -> its scaled update
    (V, d), and module -> a weight that replaces the base's (saved beside an adapter on
    it, or trained whole: modules_to_save)."""
    deltas = {module: _scale(settings, module) * (b.double() @ a.double())      # (V, d)
              for module, (a, b) in tensors.pairs.items() if module in VOCABULARY_MODULES}
    deltas.update({module: _scale(settings, module) * (b.double() @ a.double()).T
                   for module, (a, b) in tensors.embeddings.items()})
    saved = dict(tensors.base_layers)
    for name, tensor in tensors.whole.items() if arch == "decoder" else ():
        module = name.removesuffix(".weight")
        if module not in VOCABULARY_MODULES:
            raise ForeignCheckpointError(f"{adapter_dir / ADAPTER_WEIGHTS}: {name} is neither a "
                                         f"LoRA matrix nor a vocabulary matrix trained whole")
        saved[module] = tensor
    return deltas, saved


def _scale(settings: dict, module: str) -> float:
    """alpha / r for this module, its rank and alpha from the patterns where one names it
    (the first pattern that matches the end of its name, as PEFT picks)."""
    def pick(pattern: dict, default: float) -> float:
        for key, value in (pattern or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    rank = pick(settings.get("rank_pattern"), settings["r"])
    alpha = pick(settings.get("alpha_pattern"), settings["lora_alpha"])
    return alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _layers_by_module(model) -> dict[str, list[tuple[Place, torch.nn.Linear]]]:
    """Hugging Face module -> our layers in it, each with its place there (GPT-2's
    c_attn holds three; in Llama's layout, Phi-3's fused modules hold three and two)."""
    modules: dict[str, list] = {}
    for name, layer in model.named_modules():
        if is_adaptable(name):
            for place in (place_of(model.config, name), fused_place_of(model.config, name)):
                if place is not None:
                    modules.setdefault(place.module, []).append((place, layer))
    return modules


def _our_layers(layers: dict, module: str, adapter_dir: Path) -> list:
    """The layers an adapted module is, its name with or without the head class's prefix
    (LlamaModel's "layers.0..." is LlamaForCausalLM's "model.layers.0...", BertModel's
    "encoder.layer.0..." BertForSequenceClassification's "bert.encoder.layer.0...")."""
    for name in (module, *(f"{prefix}.{module}" for prefix in ("model", "transformer", "bert",
                                                               "roberta", "gpt_neox"))):
        if name in layers:
            return layers[name]
    raise ForeignCheckpointError(f"{adapter_dir / ADAPTER_WEIGHTS}: an adapter on {module}, "
                                 f"which is not an attention or feed-forward matrix of the "
                                 f"base model's layers")


@torch.no_grad()
def _add_update(found: list, delta: Tensor, order: Tensor | None, config: ModelConfig,
                what: str) -> None:
    """Add a module's update (out, in) to the weights of our layers in it: all of it to
    one layer, or each part's rows to its own (GPT-2's c_attn's q, k and v; Phi-3's
    qkv_proj's and gate_up_proj's); in our layout where the export changes a weight
    (`order`: its permutation of the model dimension; each head's query and key rows in
    the format's rotary order)."""
    sizes = tuple(layer.weight.shape[0] for _, layer in sorted(found, key=lambda f: f[0].part))
    expected = (sum(sizes), found[0][1].weight.shape[1])
    if tuple(delta.shape) != expected:
        raise ForeignCheckpointError(f"{what} has shape {tuple(delta.shape)}, the base's "
                                     f"weight {expected}")
    for place, layer in found:
        start = sum(sizes[:place.part])
        update = delta[start:start + sizes[place.part]] / place.weight_scale
        if order is not None and place.reads_residual:
            update = update[:, order.argsort()]
        if order is not None and place.writes_residual:
            update = update[order.argsort()]
        if place.rotary_rows:
            update = heads_in_rotary_order(update, config.head_dim, config.rotary_dims,
                                           interleaved=place.rotary_pairs)
        layer.weight += update.to(layer.weight.dtype)

