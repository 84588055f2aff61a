"""The `transduce` command line. Each subcommand is a thin layer over the library."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Sequence

from transduce.config import ConfigError, ModelConfig, PRESETS, TrainConfig, preset


def _user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that describe bad input or a missing tool: printed, never a traceback."""
    from transduce.data.batching import BatchingError
    from transduce.data.bible import BibleError
    from transduce.data.corpus import CorpusError
    from transduce.data.tokenizer import TokenizerError
    from transduce.train.checkpoint import CheckpointError
    from transduce.train.loop import TrainingError

    return (CorpusError, BibleError, TokenizerError, BatchingError, CheckpointError, TrainingError)


USER_ERRORS = _user_errors()


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
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{path}: {error}") from None
    unknown = sorted(set(values) - {"preset", "model", "train"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; expected preset, "
                          f"[model] and [train]")
    for table, config_type in (("model", ModelConfig), ("train", TrainConfig)):
        fields = {f.name for f in dataclasses.fields(config_type)}
        bad = sorted(set(values.get(table, {})) - fields)
        if bad:
            raise ConfigError(f"{path}: [{table}] has unknown field(s) {', '.join(bad)}")
    return values


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


def cmd_data_bible(args: argparse.Namespace) -> int:
    """Extract the verse-aligned Bible corpus and write the fixed split."""
    from transduce.data import bible
    from transduce.data.corpus import write_metadata

    corpus = bible.build_corpus(args.src_module, args.tgt_module, args.ref2_module or None)
    for line in corpus.report:
        print(line)
    written = bible.write_corpus(corpus, args.out)
    write_metadata(args.out, "es", "en", source_module=args.src_module,
                   target_module=args.tgt_module, reference2_module=args.ref2_module or None)
    sizes = ", ".join(f"{split} {len(keys)}" for split, keys in corpus.splits.items())
    print(f"split: {sizes}; wrote {len(written)} files to {args.out}")
    return 0


def cmd_vocab(args: argparse.Namespace) -> int:
    """Train the shared BPE vocabulary on both sides of the training split."""
    from transduce.data.corpus import read_split
    from transduce.data.tokenizer import train_tokenizer

    train = read_split(args.data, "train")
    print(train.summary())
    tokenizer = train_tokenizer([*train.source, *train.target], args.data, args.size)
    lossless = sum(tokenizer.decode(ids) == text for ids, text in
                   zip(tokenizer.encode(train.source + train.target), train.source + train.target))
    print(f"wrote {tokenizer.path} ({tokenizer.vocab_size} pieces; pad 0, bos 1, eos 2, unk 3); "
          f"round trip exact for {lossless} of {2 * len(train)} training sentences")
    return 0


def cmd_data_stats(args: argparse.Namespace) -> int:
    """Tokenised lengths, the length filter and token-count batching of a split."""
    from transduce.data.batching import LengthFilter, TokenBatcher
    from transduce.data.corpus import read_split
    from transduce.data.tokenizer import MODEL_NAME, Tokenizer

    corpus = read_split(args.data, args.split)
    print(corpus.summary())
    tokenizer = Tokenizer(args.data / MODEL_NAME)
    cache = args.data / ".cache"
    src_ids = tokenizer.encode_cached(corpus.source, cache)
    tgt_ids = tokenizer.encode_cached(corpus.target, cache)
    kept = LengthFilter.apply(src_ids, tgt_ids, args.max_len)
    print(kept.report(src_ids, tgt_ids, corpus.line_numbers, args.max_len))
    src_ids = [src_ids[i] for i in kept.kept]
    tgt_ids = [tgt_ids[i] for i in kept.kept]
    lines = [corpus.line_numbers[i] for i in kept.kept]
    batcher = TokenBatcher(src_ids, tgt_ids, args.max_tokens, line_numbers=lines)
    batches = batcher.epoch_batches(0)
    src_tokens = sum(len(x) + 1 for x in src_ids)
    tgt_tokens = sum(len(x) + 1 for x in tgt_ids)
    print(f"tokens: {src_tokens} source, {tgt_tokens} target; {len(batches)} batches of at most "
          f"{args.max_tokens} tokens a side; padding {100 * batcher.padding_fraction(0):.1f}%")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train a model on a corpus directory with the paper's recipe."""
    from transduce.data.tokenizer import MODEL_NAME, Tokenizer
    from transduce.train import checkpoint
    from transduce.train.loop import train

    file_values = read_config_file(args.config)
    model_flags, train_flags = flags_given(args, ModelConfig), flags_given(args, TrainConfig)
    if args.resume:
        if model_flags:
            raise ConfigError(f"--resume continues the run's model; it cannot change "
                              f"{', '.join(sorted(model_flags))}")
        model_config, saved_train = checkpoint.read_configs(checkpoint.resolve(args.out))
        train_config = (saved_train or TrainConfig()).replace(**train_flags)
    else:
        vocab_size = Tokenizer(args.data / MODEL_NAME).vocab_size
        model_values = {"src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size,
                        **file_values.get("model", {}), **model_flags}
        model_config = preset(args.preset or file_values.get("preset", "small"), **model_values)
        train_config = TrainConfig(**{**file_values.get("train", {}), **train_flags})
        if checkpoint.list_checkpoints(args.out):
            raise ConfigError(f"{args.out} already holds checkpoints: pass --resume to continue "
                              f"that run, or choose another --out")
    train(args.data, args.out, model_config, train_config, resume=args.resume)
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    """Average the weights of a run's last N checkpoints (the paper: 5 for base)."""
    from transduce.train import checkpoint

    found = checkpoint.list_checkpoints(args.run)
    if not found:
        raise checkpoint.CheckpointError(f"{args.run}: no checkpoints to average")
    chosen = found[-args.last:]
    if len(chosen) < args.last:
        print(f"note: {args.run} has only {len(chosen)} checkpoints; averaging those")
    path = checkpoint.average(chosen, args.out)
    print(f"averaged {', '.join(p.name for p in chosen)} -> {path}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Loss and learning-rate curves of a run, from its log, as a PNG."""
    from transduce.viz import plot_training

    out = plot_training(args.run, args.out)
    print(f"wrote {out}")
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

    data = commands.add_parser("data", help="build or inspect a parallel corpus")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    bible_cmd = data_commands.add_parser("bible", help="extract the Spanish-English Bible corpus")
    bible_cmd.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    bible_cmd.add_argument("--src-module", default="spaRV1909eb")
    bible_cmd.add_argument("--tgt-module", default="engKJV2006eb")
    bible_cmd.add_argument("--ref2-module", default="engWEB2015eb",
                           help="second English reference for dev/test ('' for none)")
    bible_cmd.set_defaults(run=cmd_data_bible)
    stats = data_commands.add_parser("stats", help="lengths, filtering and batching of a split")
    stats.add_argument("--data", type=Path, required=True)
    stats.add_argument("--split", default="train", choices=["train", "dev", "test"])
    stats.add_argument("--max-len", type=int, default=256,
                       help="pairs with more tokens on either side are filtered")
    stats.add_argument("--max-tokens", type=int, default=4096, help="batch budget per side")
    stats.set_defaults(run=cmd_data_stats)

    vocab = commands.add_parser("vocab", help="train the shared BPE vocabulary")
    vocab.add_argument("--data", type=Path, required=True, help="corpus directory")
    vocab.add_argument("--size", type=int, default=8000)
    vocab.set_defaults(run=cmd_vocab)

    train = commands.add_parser("train", help="train a model with the paper's recipe")
    train.add_argument("--data", type=Path, required=True, help="corpus directory with spm.model")
    train.add_argument("--out", type=Path, required=True, help="run directory for checkpoints")
    train.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="model preset (default: the config file's, else small)")
    train.add_argument("--config", type=Path, default=None, help="TOML file: preset, [model], [train]")
    train.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
    add_config_flags(train, TrainConfig)
    add_config_flags(train, ModelConfig)
    train.set_defaults(run=cmd_train)

    average = commands.add_parser("average", help="average a run's last checkpoints")
    average.add_argument("run", type=Path)
    average.add_argument("--last", type=int, default=5)
    average.add_argument("--out", type=Path, required=True)
    average.set_defaults(run=cmd_average)

    plot = commands.add_parser("plot", help="plot a run's loss and learning-rate curves")
    plot.add_argument("run", type=Path)
    plot.add_argument("--out", type=Path, default=None, help="PNG path (default RUN/curves.png)")
    plot.set_defaults(run=cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"transduce: configuration error: {error}", file=sys.stderr)
        return 2
    except USER_ERRORS as error:
        print(f"transduce: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
