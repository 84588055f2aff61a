"""The `transduce` command line. Each subcommand is a thin layer over the library."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any, Sequence

from transduce.config import ConfigError, ModelConfig, PRESETS, preset


def add_config_flags(parser: argparse.ArgumentParser, config_type: type) -> None:
    """One flag per dataclass field (d_model -> --d-model), defaulting to "not given"."""
    hints = typing.get_type_hints(config_type)
    group = parser.add_argument_group(f"{config_type.__name__} fields (override the preset)")
    for field in dataclasses.fields(config_type):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        options: dict[str, Any] = {"default": None, "dest": field.name}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        else:
            base = [t for t in typing.get_args(kind) if t is not type(None)] \
                if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union else [kind]
            options["type"] = base[0]
        group.add_argument(flag, **options)


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)
                 if getattr(args, f.name, None) is not None}
    if args.vocab_size is not None:
        overrides.setdefault("src_vocab_size", args.vocab_size)
        overrides.setdefault("tgt_vocab_size", args.vocab_size)
    return preset(args.preset, **overrides)


def cmd_model_info(args: argparse.Namespace) -> int:
    """Print a model's configuration and its parameter count, part by part."""
    from transduce.model import Transformer

    config = config_from_args(args)
    model = Transformer(config)
    embeddings = {id(p): p for m in (model.encoder.embed, model.decoder.embed, model.output_proj)
                  for p in m.parameters()}
    parts = {
        "embeddings (tied: " + config.tie_embeddings + ")": sum(p.numel() for p in embeddings.values()),
        "encoder layers": sum(p.numel() for p in model.encoder.parameters()
                              if id(p) not in embeddings),
        "decoder layers": sum(p.numel() for p in model.decoder.parameters()
                              if id(p) not in embeddings),
    }
    kv_bytes = 2 * config.num_decoder_layers * config.kv_heads * config.head_dim * 4
    print(f"preset: {args.preset}")
    for field in dataclasses.fields(config):
        print(f"  {field.name:20s} {getattr(config, field.name)}")
    for name, count in parts.items():
        print(f"{name:32s} {count:>13,d}")
    print(f"{'total parameters':32s} {model.num_parameters():>13,d}  "
          f"({model.num_parameters() / 1e6:.1f}M)")
    print(f"{'KV cache per target token':32s} {kv_bytes:>13,d} bytes (float32, per sentence)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="transduce", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("model-info", help="print a model's size and configuration")
    info.add_argument("--preset", default="base", choices=sorted(PRESETS))
    info.add_argument("--vocab-size", type=int, default=None,
                      help="shared vocabulary size (sets both src and tgt sizes)")
    add_config_flags(info, ModelConfig)
    info.set_defaults(run=cmd_model_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"transduce: configuration error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
