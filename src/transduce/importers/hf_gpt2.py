"""Hugging Face GPT-2 (GPT2LMHeadModel or GPT2Model directories) -> our DecoderOnly.

GPT-2 is the decoder-only model of the "gpt2" preset: pre-norm layers with a final
LayerNorm, learned positions, tanh-approximated GELU, the output tied to the token
embeddings. What differs is only how the weights are laid out:

    wte, wpe                 decoder.embed.embedding, decoder.embed.positions.embedding
    h.N.ln_1, h.N.ln_2       decoder.layers.N.norm1 (before attention), .norm3 (before FFN)
    h.N.attn.c_attn          q_proj | k_proj | v_proj, fused on the output dimension
    h.N.attn.c_proj          self_attn.out_proj
    h.N.mlp.c_fc, c_proj     ffn.linear1, ffn.linear2
    ln_f                     decoder.final_norm

GPT-2's projections are Conv1D modules, x @ W + b with W stored (in, out), the transpose
of nn.Linear's (out, in). Every key is accounted for: the causal-mask buffers
(attn.bias, attn.masked_bias) are skipped, a tied lm_head must equal wte, and anything
else, or anything missing, is an error naming the key. The tokenizer (tokenizer.json, or
vocab.json + merges.txt) travels with the checkpoint; its pad token is the model's pad
id, and its end-of-text token where it names none, as GPT-2's does not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig, preset
from transduce.data.hf_tokenizer import ADDED_TOKENS_JSON, TOKENIZER_JSON, HFTokenizer
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_foreign_options, check_tied_copy, refuse_unread, take_weight, unprefixed_names
from transduce.importers.chat_settings import with_chat_settings
from transduce.model import empty_model

HF_CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX, PYTORCH_BIN, PYTORCH_BIN_INDEX = \
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", \
    "pytorch_model.bin.index.json"
END_OF_TEXT = "<|endoftext|>"

# Hugging Face activation names -> ModelConfig.activation (gelu_new and
# gelu_pytorch_tanh are the same tanh approximation, computed two ways).
ACTIVATIONS = {"gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu": "gelu",
               "relu": "relu"}
# Options whose other value changes what the model computes: name -> the value we have.
FIXED_OPTIONS = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                 "reorder_and_upcast_attn": False, "add_cross_attention": False}
_IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")   # causal-mask buffers


def import_gpt2(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face GPT-2 directory (config.json, model.safetensors or
    pytorch_model.bin, a tokenizer) and write it as our checkpoint at `out`, replacing
    one there; nothing is written unless everything was read and checked."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    hf = _read_json(hf_dir / HF_CONFIG)
    tokenizer = with_chat_settings(read_tokenizer(hf_dir), hf_dir)
    config = model_config(hf, hf_dir / HF_CONFIG, tokenizer)
    tensors, source = read_weights(hf_dir)
    model = empty_model(config)     # every weight is loaded next
    model.load_state_dict(map_weights(tensors, config, hf, source))
    del tensors          # the stored files are let go before the save copies the model
    origin = {"imported": "hf-gpt2", "from": str(hf_dir.resolve()), "steps": None}
    return checkpoint.save(out, model.eval(), None, tokenizer, origin=origin)


def model_config(hf: dict[str, Any], config_file: Path, tokenizer: HFTokenizer) -> ModelConfig:
    """The "gpt2" preset with the sizes and options of a Hugging Face GPT2Config;
    options we cannot reproduce are refused."""
    activation = check_foreign_options(hf, config_file, "gpt2", FIXED_OPTIONS,
                                       "activation_function", "gelu_new", ACTIVATIONS)

    def required(name: str) -> Any:
        if name not in hf:
            raise ForeignCheckpointError(f"{config_file}: no {name!r}")
        return hf[name]

    vocab_size, d_model = required("vocab_size"), required("n_embd")
    try:
        config = preset("gpt2", src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                        max_positions=required("n_positions"), d_model=d_model,
                        num_heads=required("n_head"), num_decoder_layers=required("n_layer"),
                        d_ff=hf.get("n_inner") or 4 * d_model,
                        activation=activation,
                        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                        dropout=hf.get("resid_pdrop", 0.1),
                        attention_dropout=hf.get("attn_pdrop", 0.1))
        if tokenizer.vocab_size > config.tgt_vocab_size:
            raise ForeignCheckpointError(f"{config_file}: vocab_size={vocab_size} is smaller "
                                         f"than the tokenizer's {tokenizer.vocab_size} tokens")
        config = config.replace(pad_id=tokenizer.pad_id)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None
    for name, token_id in (("bos_token_id", tokenizer.bos_id),
                           ("eos_token_id", tokenizer.eos_id)):
        if hf.get(name) is not None and hf[name] != token_id:
            raise ForeignCheckpointError(
                f"{config_file}: {name}={hf[name]} but the tokenizer's "
                f"{name.split('_')[0]} token {tokenizer.piece(token_id)!r} is {token_id}")
    return config


VOCAB_JSON, MERGES = "vocab.json", "merges.txt"    # the byte-level BPE pair's files


def read_tokenizer(hf_dir: Path) -> HFTokenizer:
    """The directory's tokenizer.json, else its vocab.json + merges.txt (and the tokens
    an added_tokens.json adds), with the bos, eos and pad tokens its
    tokenizer_config.json / special_tokens_map.json name (GPT-2's defaults:
    <|endoftext|> for bos and eos; no pad token, so eos pads)."""
    specials, _ = tokenizer_settings(hf_dir, {"bos": END_OF_TEXT, "eos": END_OF_TEXT,
                                              "pad": None})
    if (hf_dir / TOKENIZER_JSON).is_file():
        return HFTokenizer.from_file(hf_dir / TOKENIZER_JSON, **specials)
    if (hf_dir / VOCAB_JSON).is_file() and (hf_dir / MERGES).is_file():
        added = hf_dir / ADDED_TOKENS_JSON
        return HFTokenizer.from_byte_level_bpe(
            hf_dir / VOCAB_JSON, hf_dir / MERGES, **specials,
            added=_read_json(added) if added.is_file() else None)
    raise ForeignCheckpointError(f"{hf_dir}: no tokenizer ({TOKENIZER_JSON}, or {VOCAB_JSON} "
                                 f"and {MERGES})")


class SafetensorsFiles(Mapping):
    """The tensors of safetensors files, each read from its memory-mapped file when
    asked for: an import holds the file's pages, which the kernel may drop, rather
    than a copy of the whole checkpoint in its own memory."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, tuple[Any, Path]] = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            self._where.update({key: (handle, file) for key in handle.keys()})

    def __getitem__(self, key: str) -> Tensor:
        handle, file = self._where[key]
        try:
            return handle.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise ForeignCheckpointError(f"{file}: {key!r} is unreadable ({error})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_weights(hf_dir: Path) -> tuple[Mapping[str, Tensor], Path]:
    """The checkpoint's tensors, from model.safetensors or pytorch_model.bin, or the
    shards either index names (read as they are asked for where the format allows) ->
    (name -> tensor, the file named in errors)."""
    try:
        if (hf_dir / SAFETENSORS).is_file():
            return SafetensorsFiles([hf_dir / SAFETENSORS]), hf_dir / SAFETENSORS
        if (hf_dir / SAFETENSORS_INDEX).is_file():
            return SafetensorsFiles(_shards(hf_dir / SAFETENSORS_INDEX)), \
                hf_dir / SAFETENSORS_INDEX
    except (SafetensorError, OSError) as error:
        raise ForeignCheckpointError(f"{hf_dir}: unreadable safetensors weights "
                                     f"({error})") from None
    if (hf_dir / PYTORCH_BIN).is_file():
        return _read_pickled(hf_dir / PYTORCH_BIN), hf_dir / PYTORCH_BIN
    if (hf_dir / PYTORCH_BIN_INDEX).is_file():     # larger models (NLLB-3.3B) in shards
        tensors = {}
        for shard in _shards(hf_dir / PYTORCH_BIN_INDEX):
            tensors.update(_read_pickled(shard))
        return tensors, hf_dir / PYTORCH_BIN_INDEX
    raise ForeignCheckpointError(f"{hf_dir}: no weights ({SAFETENSORS}, {PYTORCH_BIN} or "
                                 f"the shards {SAFETENSORS_INDEX} or {PYTORCH_BIN_INDEX} "
                                 f"names)")


def _shards(index: Path) -> list[Path]:
    """The shard files an index's weight_map names, each once."""
    shards = _read_json(index).get("weight_map")
    if not isinstance(shards, dict) or not shards or \
            not all(isinstance(name, str) for name in shards.values()):
        raise ForeignCheckpointError(f"{index}: no \"weight_map\" of weights to files")
    return [index.parent / name for name in sorted(set(shards.values()))]


def _read_pickled(file: Path) -> dict[str, Tensor]:
    """A pytorch_model.bin (or a shard of one): a state dict of tensors, read without
    running code (weights_only), memory-mapped where its format allows (torch.save's
    zip files; an older file is read whole)."""
    try:
        try:
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - unpickling a corrupt file raises anything
        raise ForeignCheckpointError(f"{file}: unreadable ({type(error).__name__}: "
                                     f"{error})") from None
    if not isinstance(tensors, dict) or \
            not all(isinstance(t, Tensor) for t in tensors.values()):
        raise ForeignCheckpointError(f"{file}: not a state dict of tensors")
    return dict(tensors)


def map_weights(tensors: dict[str, Tensor], config: ModelConfig, hf: dict[str, Any],
                source: Path) -> dict[str, Tensor]:
    """GPT-2's tensors -> our state dict (float32), each key accounted for and each shape
    checked against what the configuration gives."""
    names = unprefixed_names(tensors, "transformer.", source)
    c, ff = config.d_model, config.d_ff

    def take(name: str, *shape: int) -> Tensor:
        return take_weight(tensors, names, source, name, *shape)

    embedding = take("wte.weight", config.tgt_vocab_size, c)          # (V, C)
    state = {"decoder.embed.embedding.weight": embedding, "output_proj.weight": embedding,
             "decoder.embed.positions.embedding.weight":
                 take("wpe.weight", config.max_positions, c),          # (P, C)
             "decoder.final_norm.weight": take("ln_f.weight", c),
             "decoder.final_norm.bias": take("ln_f.bias", c)}
    for i in range(config.num_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"h.{i}"
        for part in ("weight", "bias"):
            state[f"{ours}.norm1.{part}"] = take(f"{theirs}.ln_1.{part}", c)
            state[f"{ours}.norm3.{part}"] = take(f"{theirs}.ln_2.{part}", c)
        # Conv1D (C, 3C) -> three nn.Linear weights (C_out, C_in), split on the output.
        fused_weight = take(f"{theirs}.attn.c_attn.weight", c, 3 * c).t()   # (3C, C)
        fused_bias = take(f"{theirs}.attn.c_attn.bias", 3 * c)               # (3C,)
        for proj, weight, bias in zip(("q_proj", "k_proj", "v_proj"),
                                      fused_weight.chunk(3, dim=0), fused_bias.chunk(3)):
            state[f"{ours}.self_attn.{proj}.weight"] = weight.contiguous()  # (C, C)
            state[f"{ours}.self_attn.{proj}.bias"] = bias.contiguous()      # (C,)
        for theirs_name, ours_name, n_in, n_out in (("attn.c_proj", "self_attn.out_proj", c, c),
                                                    ("mlp.c_fc", "ffn.linear1", c, ff),
                                                    ("mlp.c_proj", "ffn.linear2", ff, c)):
            key = f"{theirs}.{theirs_name}"
            state[f"{ours}.{ours_name}.weight"] = \
                take(f"{key}.weight", n_in, n_out).t().contiguous()    # (in, out) -> (out, in)
            state[f"{ours}.{ours_name}.bias"] = take(f"{key}.bias", n_out)
    _check_lm_head(names, tensors, embedding, hf, source)
    refuse_unread(names, source, _IGNORED)
    return state


def _check_lm_head(names: dict[str, str], tensors: dict[str, Tensor], embedding: Tensor,
                   hf: dict[str, Any], source: Path) -> None:
    """Our output projection is the token embedding: a separate lm_head must equal it."""
    if "lm_head.weight" in names:
        check_tied_copy(tensors, names, source, "lm_head.weight", embedding, "wte.weight",
                        "only tied output embeddings can be imported")
    elif hf.get("tie_word_embeddings", True) is False:
        raise ForeignCheckpointError(f"{source}: missing weight 'lm_head.weight' "
                                     f"(tie_word_embeddings is false)")


def tokenizer_settings(hf_dir: Path, specials: dict[str, str | None],
                       options: tuple[str, ...] = ()) -> tuple[dict[str, str | None],
                                                              dict[str, Any]]:
    """The special tokens (role -> token; `specials` holds the defaults) and the
    `options` that the directory's tokenizer_config.json / special_tokens_map.json give
    (the latter winning): {role}_token entries, plain or {"content": ...}."""
    specials, found = dict(specials), {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (hf_dir / name).is_file():
            values = _read_json(hf_dir / name)
            for role in specials:
                token = values.get(f"{role}_token")
                token = token.get("content") if isinstance(token, dict) else token
                if isinstance(token, str):
                    specials[role] = token
            found.update({key: values[key] for key in options if key in values})
    return specials, found


def _read_json(file: Path) -> dict[str, Any]:
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ForeignCheckpointError(f"{file}: unreadable ({error})") from None
    if not isinstance(values, dict):
        raise ForeignCheckpointError(f"{file}: expected a JSON object")
    return values
