"""`transduce model-info | kv-size | convert-kv`: a model's size, its cache, its heads."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from transduce.cli.outputs import FORCE_HELP, check_output_directory
from transduce.cli.options import add_config_flags, config_from_args, flags_given, positive_int
from transduce.config import PRESETS, ConfigError, ModelConfig

CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")


def register(commands) -> None:
    info = commands.add_parser("model-info", help="print a model's size and configuration")
    info.add_argument("--preset", default="base", choices=sorted(PRESETS))
    info.add_argument("--vocab-size", type=positive_int, default=None,
                      help="shared vocabulary size (sets both src and tgt sizes)")
    add_config_flags(info, ModelConfig)
    info.set_defaults(handler=model_info)

    kv = commands.add_parser("kv-size", help="KV-cache bytes: formula and measured")
    source = kv.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, default=None)
    source.add_argument("--preset", choices=sorted(PRESETS), default=None)
    kv.add_argument("--vocab-size", type=positive_int, default=None)
    kv.add_argument("--tokens", type=positive_int, required=True)
    kv.add_argument("--batch", type=positive_int, default=1)
    kv.add_argument("--dtype", default="float32", choices=CACHE_DTYPES)
    add_config_flags(kv, ModelConfig)  # with --model: size it as if changed so
    kv.set_defaults(handler=kv_size)

    convert = commands.add_parser("convert-kv", help="MHA checkpoint -> GQA / MQA by "
                                                     "mean-pooling key/value heads")
    convert.add_argument("run", metavar="RUN", type=Path, help="checkpoint or run directory")
    convert.add_argument("--kv-heads", type=positive_int, required=True,
                         help="key/value heads G (1: multi-query); must divide num_heads")
    convert.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    convert.add_argument("--force", action="store_true", help=FORCE_HELP)
    convert.set_defaults(handler=convert_kv)


def model_info(args: argparse.Namespace) -> int:
    """Print a model's configuration and its parameter count, part by part."""
    import torch

    from transduce.model import empty_model
    from transduce.model.transformer import kv_cache_size

    config = config_from_args(args)
    model = empty_model(config, "meta")     # counted, not allocated: any size is described
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    embeddings.add(id(model.output_proj.weight))
    parts: dict[str, int] = {}
    for name, parameter in model.named_parameters():  # a tied matrix is listed once
        part = f"embeddings (tied: {config.tie_embeddings})" if id(parameter) in embeddings \
            else name.split(".")[0]
        parts[part] = parts.get(part, 0) + parameter.numel()
    print(f"preset: {args.preset}")
    for field in dataclasses.fields(config):
        print(f"  {field.name:20s} {getattr(config, field.name)}")
    for name, count in parts.items():
        print(f"{name:32s} {count:>13,d}")
    print(f"{'total parameters':32s} {model.num_parameters():>13,d}  "
          f"({model.num_parameters() / 1e6:.1f}M)")
    if config.arch in ("transformer", "decoder") and config.attention_type == "softmax":
        kv_bytes, _ = kv_cache_size(config, 1, 1, torch.float32)
        print(f"{'KV cache per token':32s} {kv_bytes:>13,d} bytes (float32, per sequence)")
    return 0


def kv_size(args: argparse.Namespace) -> int:
    """KV-cache size by the formula, and as measured on the decoder's real cache objects;
    exit status 1 if they differ."""
    import torch

    from transduce import checkpoint
    from transduce.model import build_model
    from transduce.model.transformer import kv_cache_size

    if args.model is not None:
        config, _ = checkpoint.read_configs(checkpoint.resolve(args.model))
        # A checkpoint's model, sized as if changed (converted to --num-kv-heads G, say).
        config = config.replace(**flags_given(args, ModelConfig))
    else:
        config = config_from_args(args)  # --num-kv-heads is one of its flags
    if config.arch not in ("transformer", "decoder"):
        raise ConfigError(f"arch={config.arch!r} keeps no KV cache: its decoding state is "
                          f"{config.num_decoder_layers} x d_model={config.d_model} values per "
                          f"hypothesis, whatever the length")
    dtype = getattr(torch, args.dtype)
    try:
        formula, how = kv_cache_size(config, args.batch, args.tokens, dtype)
        with torch.device("meta"):
            caches = build_model(config).new_caches(args.batch, args.tokens, dtype, "meta")
    except ValueError as error:
        raise ConfigError(f"--dtype {args.dtype}: {error}") from None
    measured = sum(cache.nbytes for cache in caches)
    print(how)
    print(f"formula:  {formula:,d} bytes ({formula / 2**20:.2f} MiB)")
    kinds = " and ".join(dict.fromkeys(type(cache).__name__ for cache in caches))
    print(f"measured: {measured:,d} bytes (the decoder's {kinds} buffers)")
    return 0 if formula == measured else 1


def convert_kv(args: argparse.Namespace) -> int:
    """Mean-pool a multi-head checkpoint's decoder key/value heads into G groups."""
    from transduce import checkpoint
    from transduce.model import load_model
    from transduce.model.convert import convert_kv_heads

    check_output_directory(args.out, "--out", force=args.force, reads=args.run)
    source = checkpoint.resolve(args.run)
    model = load_model(source)
    converted = convert_kv_heads(model, args.kv_heads)
    _, train_config = checkpoint.read_configs(source)
    origin = {"converted_from": str(source), "kv_heads": args.kv_heads,
              "steps": checkpoint.trained_steps(source)}
    checkpoint.save(args.out, converted, train_config, checkpoint.load_tokenizer(source),
                    origin=origin)
    before, after = model.num_parameters(), converted.num_parameters()
    kind = "multi-query" if args.kv_heads == 1 else f"grouped-query ({args.kv_heads} groups)"
    print(f"{source}: {model.config.num_heads} heads -> {kind} decoder attention; "
          f"{before:,d} -> {after:,d} parameters; wrote {args.out}")
    budget = "" if origin["steps"] else " --max-steps N"   # unknown steps give no default
    print(f"uptrain it: transduce train --init {args.out} --data DIR --out RUN{budget}")
    return 0
