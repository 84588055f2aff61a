"""How options enter from the command line: value types that check their range as they
are parsed (so a bad value stops before any model loads, naming the option), and one
flag per configuration field."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

from transduce.config import (SEED_LIMIT, ConfigError, ModelConfig, TrainConfig, choices,
                              field_types, preset)
from transduce.decode.options import DecodeDtype, Engine, KvDtype, is_sampling_seed


def positive_int(text: str) -> int:
    value = _parse(int, text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def integer_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers ("5,11"; "" for none): a tuple field's flag."""
    return tuple(_parse(int, part, "an integer") for part in text.split(",") if part.strip())


def workers_count(text: str) -> int | str:
    """--workers: "auto" or a positive integer."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'auto' or an integer >= 1") \
            from None


def non_negative_int(text: str) -> int:
    value = _parse(int, text, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be an integer >= 0")
    return value


def non_negative_float(text: str) -> float:
    value = _parse(float, text, "a number")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number >= 0")
    return value


def seed_value(text: str) -> int:
    """A training or vocabulary seed (numpy takes 32 bits)."""
    value = _parse(int, text, "an integer")
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{text}: must be an integer from 0 to {SEED_LIMIT - 1}")
    return value


def sampling_seed(text: str) -> int:
    """A sampler's seed: what GenerateOptions.seed and the server's seed take."""
    value = _parse(int, text, "an integer")
    if not is_sampling_seed(value):
        raise argparse.ArgumentTypeError(f"{text}: must be an integer from 0 to 2**63 - 1")
    return value


def port_number(text: str) -> int:
    value = _parse(int, text, "an integer")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: must be a TCP port from 1 to 65535")
    return value


def fraction(text: str) -> float:
    value = _parse(float, text, "a number")
    if not 0 < value <= 1:   # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text}: must be a number in (0, 1]")
    return value


def _parse(kind: type, text: str, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def add_dtype_option(command: argparse.ArgumentParser, note: str = "") -> None:
    """--dtype of the commands that decode (note: what else it means to this command)."""
    command.add_argument("--dtype", default="auto", choices=choices(DecodeDtype),
                         help="the type the model decodes in (int8: float32 with the widest "
                              "products in int8; auto: bfloat16 on a CPU with AMX (int8 for "
                              "a language model of 16.8M parameters or more), int8 on "
                              "another CPU with VNNI or with AVX2 (a language model "
                              f"there only where the int8 rows kernel builds), else float32{note})")


def add_kv_dtype_option(command: argparse.ArgumentParser) -> None:
    """--kv-dtype of the commands that decode."""
    command.add_argument("--kv-dtype", default=None, choices=choices(KvDtype),
                         help="KV-cache type (default: --dtype's); int8 quantizes it per "
                              "token and head, int4 per group of 32 values, two per byte")


SEARCH_BATCH_TOKENS = 4096        # a search's tokens per batch, unless told


def search_batch_tokens(args: argparse.Namespace) -> int:
    """--batch-tokens of evaluate (None: not given) for a search or a language model."""
    return args.batch_tokens or SEARCH_BATCH_TOKENS


def add_search_options(command: argparse.ArgumentParser, *, classifies: bool = False
                       ) -> None:
    """The options of translate and evaluate (classifies: evaluate's, whose
    --batch-tokens a classifier leaves to the library when not given)."""
    command.add_argument("--beam", type=positive_int, default=4, help="beam size (1: greedy)")
    command.add_argument("--alpha", type=non_negative_float, default=0.6,
                         help="GNMT length penalty exponent")
    classifier = "; a classifier's: the library's, 512 on a CPU" if classifies else ""
    command.add_argument("--batch-tokens", type=positive_int,
                         default=None if classifies else SEARCH_BATCH_TOKENS,
                         help=f"source tokens per batch, counting padding (default "
                              f"{SEARCH_BATCH_TOKENS}{classifier})")
    command.add_argument("--batch-sentences", type=non_negative_int, default=0,
                         help="at most this many lines per batch (0: no cap)")
    command.add_argument("--no-doubles", action="store_true",
                         help="a token never directly follows itself (what a briefly trained "
                              "model's 'God God God' needs; not for languages that double "
                              "characters)")
    scored = "; evaluate scores a language model in float32 unless a type is named"
    add_dtype_option(command, scored if classifies else "")
    add_kv_dtype_option(command)
    command.add_argument("--workers", type=workers_count, default="auto",
                         help="batches decoded side by side on the CPU, each on its share of "
                              "the threads (auto: 2 on a CPU with 2+ threads, 1.05-1.3x "
                              "faster for small models; else 1)")
    add_engine_option(command)


def add_engine_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--engine", default="auto", choices=choices(Engine),
                         help="what runs the model (default: ONNX Runtime for an ONNX export, "
                              "PyTorch for a checkpoint)")


def add_config_flags(parser: argparse.ArgumentParser, config_type: type) -> None:
    """One flag per dataclass field (d_model -> --d-model), defaulting to "not given"."""
    hints = field_types(config_type)
    group = parser.add_argument_group(f"{config_type.__name__} fields (override the preset)")
    for field in dataclasses.fields(config_type):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        options: dict[str, Any] = {"default": None, "dest": field.name}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
            if any("," in choice for choice in options["choices"]):   # "mlm,nsp"
                options["metavar"] = "{" + " | ".join(options["choices"]) + "}"
        elif typing.get_origin(kind) is tuple:
            options.update(type=integer_list, metavar="N,N,...")
        else:
            union = isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union
            options["type"] = [t for t in typing.get_args(kind) if t is not type(None)][0] \
                if union else kind
        group.add_argument(flag, **options)


def flags_given(args: argparse.Namespace, config_type: type) -> dict[str, Any]:
    """The dataclass fields set on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config_type)
            if getattr(args, f.name, None) is not None}


def read_config_file(path: Path | None) -> dict[str, Any]:
    """A TOML file: `preset = "small"`, a [model] table and a [train] table, whose keys
    are the ModelConfig and TrainConfig fields."""
    if path is None:
        return {}
    import tomllib

    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{path}: {error}") from None
    unknown = sorted(set(values) - {"preset", "model", "train"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; expected preset, "
                          f"[model] and [train]")
    for table, config_type in (("model", ModelConfig), ("train", TrainConfig)):
        if not isinstance(values.get(table, {}), dict):
            raise ConfigError(f"{path}: {table} = {values[table]!r}: must be a table of "
                              f"{config_type.__name__} fields, [{table}]")
        fields = {f.name for f in dataclasses.fields(config_type)}
        bad = sorted(set(values.get(table, {})) - fields)
        if bad:
            raise ConfigError(f"{path}: [{table}] has unknown field(s) {', '.join(bad)}")
    return values


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The preset named by --preset with the ModelConfig flags given applied."""
    overrides = flags_given(args, ModelConfig)
    if args.vocab_size is not None:
        overrides.setdefault("src_vocab_size", args.vocab_size)
        overrides.setdefault("tgt_vocab_size", args.vocab_size)
    return preset(args.preset, **overrides)
