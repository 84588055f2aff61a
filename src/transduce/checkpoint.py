"""Checkpoints on disk, shared by training, decoding, conversion and export. One
directory each, written whole under a temporary name and renamed (atomic.py), so that a
crash, even SIGKILL, never leaves a half-written checkpoint in place:

    RUN/step-000500/
        config.json          {"model": ModelConfig, "train": TrainConfig, and for an
                             average or a conversion "origin": what it was made from}
        model.safetensors    weights (tied matrices stored once)
        spm.model            the tokenizer: SentencePiece for models trained here,
        or tokenizer.json    or a Hugging Face tokenizer for imported ones, whose special
                             ids config.json records as {"tokenizer": {"file":
                             "tokenizer.json", "bos_id", "eos_id", "pad_id"}}, with an
                             instruct model's "chat_template" and "stop_ids"
        spm-target.model     optional: how targets are segmented, when not as sources
                             (an imported Marian model's target.spm; same ids)
        trainer_state.pt     optimizer, step, data position, RNG states (training only)

This module knows the format, not the models: it saves and fills any nn.Module with a
`config`, and `transduce.model.load_model` builds the model a checkpoint describes.
Every unreadable or corrupt file is a CheckpointError naming it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from transduce import atomic, streamed_safetensors
from transduce.config import ConfigError, ModelConfig, TrainConfig
from transduce.data.chat import ChatError, ChatTemplate
from transduce.data.hf_tokenizer import SPECIALS, TOKENIZER_JSON, HFTokenizer
from transduce.data.tokenizer import MODEL_NAME, TARGET_MODEL_NAME, TextTokenizer, \
    TokenizerError, Tokenizer
from transduce.errors import TransduceError, not_there

CONFIG, WEIGHTS, TOKENIZER, TRAINER_STATE = "config.json", "model.safetensors", MODEL_NAME, \
    "trainer_state.pt"
TARGET_TOKENIZER = TARGET_MODEL_NAME
ADAPTERS = "adapter.safetensors"      # a LoRA run's adapters (train/lora.py)
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
    if not path.is_dir():
        raise CheckpointError(not_there(path, "checkpoint or run directory"))
    checkpoints = list_checkpoints(path)
    if not checkpoints:
        raise CheckpointError(f"{path}: no checkpoint found (neither {WEIGHTS} nor step-* "
                              f"directories)")
    return checkpoints[-1]


# What a model carries besides its weights and configuration, written with the latter.
DESCRIBED = ("labels", "classifier_inputs", "sentence_embedding", "languages", "language_codes")


def save(path: Path, model: nn.Module, train_config: TrainConfig | None,
         tokenizer_path: Path | TextTokenizer, trainer_state: dict[str, Any] | None = None,
         origin: dict[str, Any] | None = None, *,
         weights: Mapping[str, torch.Tensor | streamed_safetensors.Pending] | None = None,
         adapters: dict[str, torch.Tensor] | None = None,
         lora: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint directory atomically; an existing one at `path` is replaced.
    tokenizer_path: a SentencePiece model file (stored as spm.model, whatever its name;
    a spm.model's spm-target.model beside it is stored too),
    a tokenizer.json inside a checkpoint (its special ids are taken from there), or a
    tokenizer object (an HFTokenizer is written as tokenizer.json with its special ids, a
    Tokenizer as the bytes it read).
    origin: how a derived checkpoint was made, with "steps" (the training steps behind it).
    A classifier's label names (model.labels) and what it was fine-tuned to classify
    (model.classifier_inputs: "texts" or "pairs"), an encoder's way of pooling sentence
    embeddings (model.sentence_embedding), a translation model's language pair
    (model.languages: source, target) and a multilingual one's language codes
    (model.language_codes: code -> id) are written with its configuration.
    A LoRA run's (train/lora.py): weights, the merged state dict written in place of the
    model's (a Pending tensor is computed as it is written, streamed_safetensors.py);
    adapters, written as adapter.safetensors; lora, its config.json section."""
    write_tokenizer, section = _tokenizer_writer(tokenizer_path)
    described = {name: getattr(model, name, None) for name in DESCRIBED}
    with atomic.atomic_directory(path) as temporary:
        _write_config(temporary, model.config, train_config, origin, section, lora=lora,
                      **described)
        _save_weights(model.state_dict() if weights is None else weights, temporary / WEIGHTS)
        if adapters is not None:
            _save_tensors({name: tensor.detach().to("cpu").contiguous()
                           for name, tensor in adapters.items()}, temporary / ADAPTERS, None)
        write_tokenizer(temporary)
        if trainer_state is not None:
            torch.save(trainer_state, temporary / TRAINER_STATE)
    return path


def _save_weights(state: Mapping[str, torch.Tensor | streamed_safetensors.Pending],
                  file: Path) -> None:
    """The weights as safetensors' save_model writes them (a tensor under two names, a
    tied matrix, is stored once and the other name recorded in the metadata), except that
    distinct views into one buffer are copied apart: on a GPU, cuDNN packs an RNN's
    weights into one buffer, which save_model refuses. A CPU tensor that is the whole of
    its buffer is written from where it is: a model is saved without a second copy.
    Pending tensors are computed one at a time as they are written."""
    tensors: dict[str, torch.Tensor | streamed_safetensors.Pending] = {}
    metadata: dict[str, str] = {}
    first_name: dict[tuple, str] = {}
    for name, tensor in state.items():
        if isinstance(tensor, streamed_safetensors.Pending):
            tensors[name] = tensor
            continue
        view = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and view in first_name:
            metadata[name] = first_name[view]
            continue
        first_name[view] = name
        tensor = tensor.detach()
        whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes
        if tensor.device.type != "cpu" or not whole:
            tensor = tensor.to("cpu", copy=True).contiguous()
        tensors[name] = tensor
    if any(isinstance(t, streamed_safetensors.Pending) for t in tensors.values()):
        streamed_safetensors.write(file, tensors, metadata or None)
    else:
        _save_tensors(tensors, file, metadata or None)


def _save_tensors(tensors: dict[str, torch.Tensor], file: Path, metadata: dict | None) -> None:
    save_file(tensors, str(file), metadata=metadata)
    atomic.open_permissions(file)   # safetensors creates it 0600


def _tokenizer_writer(tokenizer: Path | TextTokenizer):
    """-> (a function writing the tokenizer file into a directory, the config.json
    "tokenizer" section or None). Checked before anything is written."""
    if isinstance(tokenizer, HFTokenizer):
        return (lambda directory: tokenizer.save(directory / TOKENIZER_JSON),
                _tokenizer_section(tokenizer))
    if isinstance(tokenizer, Tokenizer):
        return _sentencepiece_writer(tokenizer), None
    source = Path(tokenizer)
    if source.name == TOKENIZER_JSON:
        loaded = load_tokenizer(source.parent)
        if not isinstance(loaded, HFTokenizer) or loaded.path != source:
            raise CheckpointError(f"{source}: a tokenizer.json needs its special ids; pass "
                                  f"the HFTokenizer, or a tokenizer.json of a checkpoint")
        return (lambda directory: shutil.copyfile(source, directory / TOKENIZER_JSON),
                _tokenizer_section(loaded))
    if not source.is_file():
        raise CheckpointError(f"{source}: no such tokenizer file")
    target = source.with_name(TARGET_TOKENIZER)
    target = target if source.name == TOKENIZER and target.is_file() else None

    def write(directory: Path) -> None:
        shutil.copyfile(source, directory / TOKENIZER)
        if target is not None:        # the targets' segmentation beside it (tokenizer.py)
            shutil.copyfile(target, directory / TARGET_TOKENIZER)
    return write, None


def _sentencepiece_writer(tokenizer: Tokenizer):
    """Writes the model as it was read (and its targets' beside it, if it has one)."""
    target = tokenizer.target_tokenizer

    def write(directory: Path) -> None:
        (directory / TOKENIZER).write_bytes(tokenizer.model_bytes)
        if target is not tokenizer:
            (directory / TARGET_TOKENIZER).write_bytes(target.model_bytes)
    return write


def _tokenizer_section(tokenizer: HFTokenizer) -> dict[str, Any]:
    """The special ids, and an instruct model's chat template and end tokens."""
    chat = {} if tokenizer.chat_template is None else \
        {"chat_template": tokenizer.chat_template.to_dict()}
    stops = {"stop_ids": list(tokenizer.stop_ids)} if tokenizer.stop_ids else {}
    return {"file": TOKENIZER_JSON, **tokenizer.specials, **chat, **stops}


def _write_config(directory: Path, model_config: ModelConfig, train_config: TrainConfig | None,
                  origin: dict[str, Any] | None, tokenizer: dict[str, Any] | None = None,
                  labels: list[str] | None = None, classifier_inputs: str | None = None,
                  languages: tuple[str, str] | None = None,
                  language_codes: dict[str, int] | None = None,
                  sentence_embedding: dict[str, Any] | None = None,
                  lora: dict[str, Any] | None = None) -> None:
    values = {"model": model_config.to_dict(),
              "train": None if train_config is None else train_config.to_dict(),
              **({"origin": origin} if origin else {}),
              **({"tokenizer": tokenizer} if tokenizer else {}),
              **({"labels": list(labels)} if labels else {}),
              **({"classifier_inputs": classifier_inputs} if classifier_inputs else {}),
              **({"languages": dict(zip(("source", "target"), languages))} if languages else {}),
              **({"language_codes": dict(language_codes)} if language_codes else {}),
              **({"sentence_embedding": dict(sentence_embedding)} if sentence_embedding
                 else {}),
              **({"lora": dict(lora)} if lora else {})}
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


def read_labels(path: Path) -> list[str] | None:
    """A classifier checkpoint's label names, in the order of its output classes (None:
    not a classifier)."""
    labels = _read_config_json(path).get("labels")
    if labels is not None and (not isinstance(labels, list)
                               or not all(isinstance(label, str) for label in labels)):
        raise CheckpointError(f"{Path(path) / CONFIG}: \"labels\" must be a list of strings")
    return labels


CLASSIFIER_INPUTS = ("texts", "pairs")   # what a classifier was fine-tuned on


def read_classifier_inputs(path: Path) -> str | None:
    """What a classifier checkpoint was fine-tuned to classify: "texts" (one per line) or
    "pairs" (a text and its second text); None: not recorded (imported classifiers,
    checkpoints from before it was recorded)."""
    inputs = _read_config_json(path).get("classifier_inputs")
    if inputs is not None and inputs not in CLASSIFIER_INPUTS:
        raise CheckpointError(f"{Path(path) / CONFIG}: \"classifier_inputs\" must be "
                              f"\"texts\" or \"pairs\", got {inputs!r}")
    return inputs


POOLINGS = ("mean", "cls")   # sentence embeddings: mean over real tokens, or [CLS]'s state


def read_sentence_embedding(path: Path) -> dict[str, Any] | None:
    """How an encoder's sentence embeddings are made by default, {"pooling": "mean" or
    "cls", "normalize": bool}, when it records it (an imported sentence-transformers
    model: BGE pools [CLS], all-MiniLM and E5 the mean; None: not recorded)."""
    values = _read_config_json(path).get("sentence_embedding")
    if values is not None and (not isinstance(values, dict)
                               or values.get("pooling") not in POOLINGS
                               or not isinstance(values.get("normalize"), bool)):
        raise CheckpointError(f"{Path(path) / CONFIG}: \"sentence_embedding\" must be "
                              f"{{\"pooling\": \"mean\" or \"cls\", \"normalize\": true or "
                              f"false}}, got {values!r}")
    return values


def read_lora_section(path: Path) -> dict[str, Any] | None:
    """A LoRA run's checkpoint's "lora" section (train/lora.py): its base checkpoint,
    rank, scale and adapted layers; None for any other checkpoint."""
    section = _read_config_json(path).get("lora")
    if section is not None and not isinstance(section, dict):
        raise CheckpointError(f"{Path(path) / CONFIG}: \"lora\" must be an object")
    return section


def read_languages(path: Path) -> tuple[str, str] | None:
    """(source, target) a translation checkpoint was trained on (None: not recorded,
    as in checkpoints from before it was, or imported ones)."""
    languages = _read_config_json(path).get("languages")
    if languages is None:
        return None
    if not isinstance(languages, dict) or \
            not all(isinstance(languages.get(side), str) for side in ("source", "target")):
        raise CheckpointError(f"{Path(path) / CONFIG}: \"languages\" must be "
                              f'{{"source": "es", "target": "en"}}, got {languages!r}')
    return languages["source"], languages["target"]


def read_language_codes(path: Path) -> dict[str, int] | None:
    """A multilingual translation model's language codes -> their token ids (None: a
    model of one language pair). A source starts with its language's code, and the
    decoder is given the target's code after bos (decode/languages.py)."""
    codes = _read_config_json(path).get("language_codes")
    if codes is not None and (not isinstance(codes, dict) or not codes or not all(
            isinstance(code, str) and isinstance(i, int) and not isinstance(i, bool)
            for code, i in codes.items())):
        raise CheckpointError(f"{Path(path) / CONFIG}: \"language_codes\" must map codes "
                              f"to token ids, such as {{\"eng_Latn\": 4}}, got {codes!r}")
    return codes


def holds_tokenizer_json(path: Path) -> bool:
    """Whether a checkpoint directory's tokenizer is a tokenizer.json (an imported
    checkpoint's, or a model trained on from one) rather than our SentencePiece model."""
    path = Path(path)
    return (path / CONFIG).is_file() and _read_config_json(path).get("tokenizer") is not None


def load_tokenizer(path: Path) -> TextTokenizer:
    """The tokenizer a checkpoint directory holds: the tokenizer.json its config.json's
    "tokenizer" section names, with the special ids recorded there, else spm.model."""
    path = Path(path)
    section = _read_config_json(path).get("tokenizer") if (path / CONFIG).is_file() else None
    if section is not None:
        return _load_hf_tokenizer(path, section)
    if (path / TOKENIZER).is_file():
        return Tokenizer(path / TOKENIZER)
    if (path / TOKENIZER_JSON).is_file():
        raise CheckpointError(f"{path}: {TOKENIZER_JSON} without its special ids ({CONFIG} "
                              f"has no \"tokenizer\" section)")
    raise CheckpointError(f"{path}: no tokenizer ({TOKENIZER} or {TOKENIZER_JSON})")


def _load_hf_tokenizer(path: Path, section: Any) -> HFTokenizer:
    where = f"{path / CONFIG}: \"tokenizer\""
    if not isinstance(section, dict) or section.get("file") != TOKENIZER_JSON:
        raise CheckpointError(f"{where} must be an object with \"file\": "
                              f"\"{TOKENIZER_JSON}\", got {section!r}")
    missing = [key for key in SPECIALS if not isinstance(section.get(key), int)]
    if missing:
        raise CheckpointError(f"{where} lacks integer {', '.join(missing)}")
    mask = section.get("mask_id")      # optional: found by its name when not recorded
    if mask is not None and (isinstance(mask, bool) or not isinstance(mask, int)):
        raise CheckpointError(f"{where}: mask_id must be an integer, got {mask!r}")
    if not (path / TOKENIZER_JSON).is_file():
        raise CheckpointError(f"{path}: no tokenizer ({TOKENIZER_JSON}, which {CONFIG} names)")
    tokenizer = HFTokenizer.from_file(path / TOKENIZER_JSON, bos=section["bos_id"],
                                      eos=section["eos_id"], pad=section["pad_id"], mask=mask)
    return _with_chat(tokenizer, section, where)


def _with_chat(tokenizer: HFTokenizer, section: dict[str, Any], where: str) -> HFTokenizer:
    """The tokenizer with the chat template and end tokens its section records."""
    template, stops = section.get("chat_template"), section.get("stop_ids", [])
    if template is None and not stops:
        return tokenizer
    if not isinstance(stops, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in stops):
        raise CheckpointError(f"{where}: stop_ids must be a list of ids, got {stops!r:.60}")
    try:
        chat = None if template is None else \
            ChatTemplate.from_dict(template, f"{where}: chat_template")
        return tokenizer.with_chat(chat, stops)
    except (ChatError, TokenizerError) as error:
        raise CheckpointError(str(error)) from None


def load_weights(model: nn.Module, path: Path, device: torch.device | str = "cpu") -> None:
    """Fill `model` with the weights of checkpoint directory `path`; they must match it
    name for name and shape for shape. One tensor is read at a time and copied into
    place, so that loading needs the model's memory and one tensor's more, not two
    models'. A tied matrix, stored once, fills every name that shares it."""
    file = Path(path) / WEIGHTS
    targets = model.state_dict()            # the model's own storage, under every name
    try:
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            stored = set(handle.keys())
            _check_names(file, targets, stored)
            filled: dict[int, str] = {}         # storage -> the name that filled it
            for name in sorted(stored):
                _fill(file, name, targets[name], handle.get_tensor(name), filled)
    except CheckpointError:
        raise
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        lines = str(error).strip().splitlines()
        more = f" ... ({len(lines) - 4} more lines)" if len(lines) > 4 else ""
        raise CheckpointError(f"{file}: unreadable or corrupt weights ({type(error).__name__}: "
                              f"{' '.join(lines[:4])}{more})") from None
    _check_finite(file, model)


def _check_names(file: Path, targets: dict[str, torch.Tensor], stored: set[str]) -> None:
    """Every name stored is the model's, and every name of the model is stored or shares
    its storage with one that is (a tied matrix is saved under one name)."""
    filled = {targets[name].data_ptr() for name in stored & targets.keys()}
    missing = [name for name in targets.keys() - stored
               if not (targets[name].numel() and targets[name].data_ptr() in filled)]
    unexpected = stored - targets.keys()
    if missing or unexpected:
        raise CheckpointError(f"{file}: weights do not match the configuration "
                              f"(missing {sorted(missing)[:3]}, unexpected "
                              f"{sorted(unexpected)[:3]})")


def _fill(file: Path, name: str, target: torch.Tensor, tensor: torch.Tensor,
          filled: dict[int, str]) -> None:
    """Copy `tensor` into the model's `target`; one the model ties to a name filled
    before must hold the same values (else the file is of an untied model)."""
    if target.shape != tensor.shape:
        raise CheckpointError(f"{file}: {name} has shape {tuple(tensor.shape)} in this file, "
                              f"but {tuple(target.shape)} by the model {CONFIG} describes")
    first = filled.setdefault(target.data_ptr(), name) if target.numel() else name
    if first != name:
        if not torch.equal(target, tensor.to(target.device, target.dtype)):
            raise CheckpointError(f"{file}: {first} and {name} differ, but the model "
                                  f"{CONFIG} describes ties them (tie_embeddings)")
        return
    with torch.no_grad():
        target.copy_(tensor)


def _check_finite(file: Path, model: nn.Module) -> None:
    """A parameter's sum is finite only if every element is, and is 40x cheaper to find
    than isfinite of each (2.8 s for NLLB-600M's shape on 2 cores); only a parameter whose
    sum is not finite, which a large enough finite sum could be, is looked at element by
    element."""
    named = list(model.named_parameters())
    if not named:
        return
    with torch.no_grad():
        sums = torch.stack([weight.sum().float() for _, weight in named])
    suspects = torch.nonzero(~torch.isfinite(sums)).flatten().tolist()   # one host sync
    broken = [named[i][0] for i in suspects if not bool(torch.isfinite(named[i][1]).all())]
    if broken:
        raise CheckpointError(f"{file}: weights that are not finite (NaN or infinity) in "
                              f"{', '.join(broken[:3])}{' ...' if len(broken) > 3 else ''}: "
                              f"the file is corrupt, or the training that wrote it diverged")


def load_trainer_state(path: Path, device: torch.device | str = "cpu", *,
                       mmap: bool = False) -> dict[str, Any]:
    """The optimizer, position and RNG states a training checkpoint holds. mmap: its
    tensors mapped from the file, not read, for a caller that wants the position alone
    (an optimizer state is twice the model)."""
    file = Path(path) / TRAINER_STATE
    if not file.is_file():
        raise CheckpointError(f"{path}: no trainer state ({TRAINER_STATE}) to resume from")
    try:
        state = torch.load(file, map_location=device, weights_only=False, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - unpickling a corrupt file raises anything
        raise CheckpointError(f"{file}: unreadable or corrupt trainer state "
                              f"({type(error).__name__}: {error})") from None
    missing = {"position", "optimizer", "rng"} - set(state if isinstance(state, dict) else ())
    if missing:
        raise CheckpointError(f"{file}: unreadable or corrupt trainer state (no "
                              f"{', '.join(sorted(missing))})")
    return state


def read_origin(path: Path) -> dict[str, Any]:
    """How a checkpoint was made (imported, averaged, converted: save's origin), {} for
    one trained here."""
    return _read_config_json(resolve(path)).get("origin") or {}


def trained_steps(path: Path) -> int | None:
    """The training steps behind a checkpoint: its trainer state's step, else the steps
    its origin records (averages and conversions), else None."""
    path = resolve(path)
    if (path / TRAINER_STATE).is_file():
        return int(load_trainer_state(path, mmap=True)["position"]["step"])
    return read_origin(path).get("steps")


AVERAGE_BLOCK_BYTES = 1 << 26     # what average() reads of a tensor from each file at once


def average(checkpoints: list[Path], out: Path) -> Path:
    """The element-wise mean of the checkpoints' weights, as the paper averages the last
    5 (base) or 20 (big) checkpoints; written as a checkpoint without trainer state.
    Summed in float64 a block of rows at a time (_mean_of), so that it needs the mean's
    memory and little more, however many checkpoints there are."""
    if not checkpoints:
        raise CheckpointError("no checkpoints to average")
    configs = {json.dumps(read_configs(p)[0].to_dict(), sort_keys=True) for p in checkpoints}
    if len(configs) != 1:
        raise CheckpointError("the checkpoints have different model configurations")
    files = [path / WEIGHTS for path in checkpoints]
    names, metadata = _names_and_metadata(files[0])
    for file in files[1:]:
        if _names_and_metadata(file)[0] != names:
            raise CheckpointError(f"{file}: other tensors than {checkpoints[0]}")
    mean = {name: _mean_of(name, files) for name in names}
    last = checkpoints[-1]
    model_config, train_config = read_configs(last)
    origin = {"averaged": [str(p) for p in checkpoints], "steps": trained_steps(last)}
    section = _read_config_json(last).get("tokenizer")
    tokenizer_file = TOKENIZER_JSON if section is not None else TOKENIZER
    with atomic.atomic_directory(out) as temporary:
        _write_config(temporary, model_config, train_config, origin, section,
                      read_labels(last), read_classifier_inputs(last), read_languages(last),
                      read_language_codes(last), read_sentence_embedding(last))
        _save_tensors(mean, temporary / WEIGHTS, metadata)
        for name in (tokenizer_file, TARGET_TOKENIZER):
            if name == tokenizer_file or (last / name).is_file():
                shutil.copyfile(last / name, temporary / name)
    return out


@contextlib.contextmanager
def _opened(file: Path) -> Iterator:
    """A safetensors file opened for reading; what fails to read from it is a
    CheckpointError naming it. Opened for what is read and closed after: a file kept
    open keeps every page read from it resident."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: unreadable or corrupt weights ({error})") from None


def _names_and_metadata(file: Path) -> tuple[list[str], dict[str, str] | None]:
    """A safetensors file's tensor names, sorted, and its metadata (which names a tied
    tensor stands for)."""
    with _opened(file) as handle:
        return sorted(handle.keys()), handle.metadata()


def _mean_of(name: str, files: list[Path]) -> torch.Tensor:
    """One tensor's mean over the files, summed in float64 in their order, a block of
    rows (AVERAGE_BLOCK_BYTES in float64) at a time: NLLB's 1 GB embedding needs 64 MB
    more than its mean, not 3 GB."""
    shape = _shape_of(files[0], name)
    if not shape or math.prod(shape) * 8 <= AVERAGE_BLOCK_BYTES:
        return _block_mean(name, files, None)
    step = max(1, AVERAGE_BLOCK_BYTES // (8 * math.prod(shape[1:])))     # rows per block
    mean = None
    for start in range(0, shape[0], step):
        rows = slice(start, start + step)
        block = _block_mean(name, files, rows)
        mean = torch.empty(shape, dtype=block.dtype) if mean is None else mean
        mean[rows] = block
    return mean


def _block_mean(name: str, files: list[Path], rows: slice | None) -> torch.Tensor:
    """The mean of tensor `name`'s `rows` (None: all of it) over the files."""
    first = _read_rows(files[0], name, rows)
    summed = first.double()
    for file in files[1:]:
        summed.add_(_read_rows(file, name, rows))                    # (in float64)
    return summed.div_(len(files)).to(first.dtype)


def _shape_of(file: Path, name: str) -> list[int]:
    """A tensor's shape, read from the file's header."""
    with _opened(file) as handle:
        return handle.get_slice(name).get_shape()


def _read_rows(file: Path, name: str, rows: slice | None) -> torch.Tensor:
    """Rows of one tensor of a safetensors file (None: the whole tensor)."""
    with _opened(file) as handle:
        return handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]
