"""The `transduce` command line. Each subcommand is a thin layer over the library."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
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
    from transduce.decode.translate import InputTooLong
    from transduce.export import ExportError
    from transduce.train.loop import TrainingError

    return (CorpusError, BibleError, TokenizerError, BatchingError, CheckpointError, TrainingError,
            InputTooLong, ExportError)


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
    """The preset named by --preset with the ModelConfig flags given applied."""
    overrides = flags_given(args, ModelConfig)
    if args.vocab_size is not None:
        overrides.setdefault("src_vocab_size", args.vocab_size)
        overrides.setdefault("tgt_vocab_size", args.vocab_size)
    return preset(args.preset, **overrides)


def cmd_model_info(args: argparse.Namespace) -> int:
    """Print a model's configuration and its parameter count, part by part."""
    import torch

    from transduce.model import build_model

    config = config_from_args(args)
    model = build_model(config)
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
    if config.arch == "transformer" and config.attention_type == "softmax":
        kv_bytes = sum(cache.nbytes for cache in model.new_caches(1, 1, torch.float32, "meta"))
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
    if args.init is not None:
        if args.resume:
            raise ConfigError("--init starts a new run from a checkpoint's weights; --resume "
                              "continues a run: choose one")
        if model_flags:
            raise ConfigError(f"--init keeps the checkpoint's model; it cannot change "
                              f"{', '.join(sorted(model_flags))}")
        # The original recipe (warmup, batch size, smoothing...), with a new budget.
        model_config, saved_train = checkpoint.read_configs(checkpoint.resolve(args.init))
        recipe = {**(saved_train.to_dict() if saved_train else {}), "max_steps": 0,
                  "max_minutes": 0.0, "schedule_offset": 0}
        train_config = TrainConfig(**{**recipe, **file_values.get("train", {}),
                                      **uptraining_defaults(args.init, train_flags,
                                                            args.uptrain_fraction),
                                      **train_flags})
        if checkpoint.list_checkpoints(args.out):
            raise ConfigError(f"{args.out} already holds checkpoints; choose another --out")
        train(args.data, args.out, model_config, train_config, init=args.init)
        return 0
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


def uptraining_defaults(init: Path, given: dict[str, Any], fraction: float) -> dict[str, Any]:
    """Uptraining a checkpoint (GQA's recipe): a fraction of its training steps, and the
    learning-rate schedule where that training left it, not a new warmup."""
    from transduce.train import checkpoint

    steps = checkpoint.trained_steps(init)
    defaults: dict[str, Any] = {}
    if steps is None:
        if not (given.get("max_steps") or given.get("max_minutes")):
            raise ConfigError(f"{init}: its training steps are not recorded; give --max-steps")
        return defaults
    defaults["schedule_offset"] = steps
    if not (given.get("max_steps") or given.get("max_minutes")):
        defaults["max_steps"] = max(1, math.ceil(fraction * steps))
    print(f"uptraining from {init}: trained {steps} steps; the schedule continues from there"
          + (f"; {defaults['max_steps']} steps ({fraction:.0%})" if "max_steps" in defaults else ""))
    return defaults


def cmd_convert_kv(args: argparse.Namespace) -> int:
    """Mean-pool a multi-head checkpoint's decoder key/value heads into G groups."""
    from transduce.model.convert import convert_kv_heads
    from transduce.train import checkpoint

    source = checkpoint.resolve(args.run)
    model = checkpoint.load_model_from(source)
    converted = convert_kv_heads(model, args.kv_heads)
    _, train_config = checkpoint.read_configs(source)
    origin = {"converted_from": str(source), "kv_heads": args.kv_heads,
              "steps": checkpoint.trained_steps(source)}
    checkpoint.save(args.out, converted, train_config, source / checkpoint.TOKENIZER, origin=origin)
    before, after = model.num_parameters(), converted.num_parameters()
    kind = "multi-query" if args.kv_heads == 1 else f"grouped-query ({args.kv_heads} groups)"
    print(f"{source}: {model.config.num_heads} heads -> {kind} decoder attention; "
          f"{before:,d} -> {after:,d} parameters; wrote {args.out}")
    print(f"uptrain it: transduce train --init {args.out} --data DIR --out RUN")
    return 0


def cmd_attention(args: argparse.Namespace) -> int:
    """Translate a sentence and draw its attention maps."""
    from transduce.attention_maps import attention_maps, plot_attention_maps
    from transduce.decode.translate import Translator

    translator = Translator.load(args.model)
    maps = attention_maps(translator, args.sentence, beam=args.beam)
    out = plot_attention_maps(maps, args.out, layer=args.layer, head=args.head)
    print(f"translation: {maps.translation}  (log-probability {maps.log_prob:.3f})")
    print(f"wrote {out}")
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    """Average the weights of a run's last N checkpoints (the paper: 5 for base)."""
    from transduce.train import checkpoint

    found = checkpoint.list_checkpoints(args.run_dir)
    if not found:
        raise checkpoint.CheckpointError(f"{args.run_dir}: no checkpoints to average")
    chosen = found[-args.last:]
    if len(chosen) < args.last:
        print(f"note: {args.run_dir} has only {len(chosen)} checkpoints; averaging those")
    path = checkpoint.average(chosen, args.out)
    print(f"averaged {', '.join(p.name for p in chosen)} -> {path}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Loss and learning-rate curves of a run, from its log, as a PNG."""
    from transduce.viz import plot_training

    out = plot_training(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    """Translate lines from a file or standard input; N lines in, N lines out, in order."""
    from tqdm import tqdm

    from transduce.data.corpus import read_lines
    from transduce.decode.translate import Translator

    translator = Translator.load(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype)
    options = dict(beam=args.beam, alpha=args.alpha, nbest=args.nbest,
                   batch_tokens=args.batch_tokens, batch_sentences=args.batch_sentences,
                   strict=args.strict)
    if args.input is not None:
        lines = read_lines(args.input, allow_empty=True)
        with tqdm(total=len(lines), unit="line", disable=args.output is None) as bar:
            results = translator.translate(lines, progress=bar.update, **options)
        text = "".join(format_translations(results, 0, args.nbest))
        if args.output is None:
            sys.stdout.write(text)
        else:
            temporary = args.output.with_name(args.output.name + ".tmp")
            temporary.write_text(text, encoding="utf-8")
            temporary.replace(args.output)
        return 0
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(args.output, "w", encoding="utf-8")) \
            if args.output else sys.stdout
        done = 0
        for lines in stdin_line_batches(sys.stdin.fileno(), max_lines=64):
            results = translator.translate(lines, first_line_number=done + 1, **options)
            out.write("".join(format_translations(results, done, args.nbest)))
            out.flush()
            done += len(lines)
    return 0


def format_translations(results, first_index: int, nbest: int):
    """One line per translation; with n-best, Moses style "index ||| text ||| score"."""
    for offset, result in enumerate(results):
        if nbest == 1:
            yield result + "\n"
        else:
            for hypothesis in result:
                yield f"{first_index + offset} ||| {hypothesis.text} ||| {hypothesis.score:.4f}\n"


def stdin_line_batches(fd: int, max_lines: int):
    """Lines from a file descriptor as soon as they arrive: what is already waiting (up
    to max_lines) is translated together, and a typed line is answered without waiting
    for more input. Invalid UTF-8 is an error naming the line."""
    import os
    import select

    from transduce.data.corpus import CorpusError

    buffer, number = b"", 1
    while True:
        chunk = os.read(fd, 1 << 16)
        buffer += chunk
        while chunk and buffer.count(b"\n") < max_lines and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1 << 16)  # more is waiting: take it without blocking
            buffer += chunk
        ended = not chunk
        *complete, buffer = buffer.split(b"\n")
        if ended and buffer:
            complete.append(buffer)  # a last line without a line end
        for first in range(0, len(complete), max_lines):
            decoded = []
            for raw in complete[first:first + max_lines]:
                try:
                    decoded.append(raw.rstrip(b"\r").decode("utf-8"))
                except UnicodeDecodeError as error:
                    raise CorpusError(f"<stdin>:{number}: invalid UTF-8 at byte "
                                      f"{error.start + 1}") from None
                number += 1
            yield decoded
        if ended:
            return


def cmd_evaluate(args: argparse.Namespace) -> int:
    """sacreBLEU and chrF of a model on a corpus split, with signatures."""
    from tqdm import tqdm

    from transduce.decode.translate import Translator
    from transduce.evaluate import evaluate_split

    translator = Translator.load(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype)
    suffix = f"-kv{args.kv_dtype}" if args.kv_dtype else ""
    out = args.out or (Path(args.model) / f"eval-{args.split}-beam{args.beam}{suffix}")
    with tqdm(unit="line", desc=f"translating {args.split}") as bar:
        result = evaluate_split(translator, args.data, args.split, out, beam=args.beam,
                                alpha=args.alpha, batch_tokens=args.batch_tokens,
                                batch_sentences=args.batch_sentences, progress=bar.update)
    print(f"{args.split}: BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  "
          f"({result['sentences']} sentences, beam {args.beam}, "
          f"{result['sentences_per_second']:.1f} sentences/s)")
    print(f"  {result['bleu_signature']}\n  {result['chrf_signature']}")
    if "bleu_ref2" in result:
        print(f"  second reference: BLEU {result['bleu_ref2']:.2f}; both references: "
              f"BLEU {result['bleu_two_references']:.2f}")
    print(f"wrote {out.with_suffix('.hyp')} and {out.with_suffix('.json')}")
    return 0


def cmd_kv_size(args: argparse.Namespace) -> int:
    """KV-cache size by the formula, and as measured on the decoder's real cache objects."""
    import torch

    from transduce.model import Transformer
    from transduce.train import checkpoint

    if args.model is not None:
        config, _ = checkpoint.read_configs(checkpoint.resolve(args.model))
        # A checkpoint's model, sized as if changed (converted to --num-kv-heads G, say).
        config = config.replace(**flags_given(args, ModelConfig))
    else:
        config = config_from_args(args)  # --num-kv-heads is one of its flags
    if config.arch != "transformer":
        raise ConfigError(f"arch={config.arch!r} keeps no KV cache: its decoding state is "
                          f"{config.num_decoder_layers} x d_model={config.d_model} values per "
                          f"hypothesis, whatever the length")
    dtype = getattr(torch, args.dtype)
    element = torch.empty((), dtype=dtype).element_size()
    layers, heads, dim = config.num_decoder_layers, config.kv_heads, config.head_dim
    if config.attention_type == "linear":
        formula = layers * heads * (dim * dim + dim) * 4 * args.batch
        how = (f"layers {layers} x kv_heads {heads} x (head_dim^2 + head_dim) = ({dim * dim} + "
               f"{dim}) running sums x 4 bytes (float32) x batch {args.batch}, whatever the length")
    else:
        kept = min(args.tokens, config.attention_window) \
            if config.attention_type == "sliding" else args.tokens
        scales = 4 if args.dtype == "int8" else 0  # one float32 scale per token and head
        formula = 2 * layers * heads * (dim * element + scales) * kept * args.batch
        how = (f"layers {layers} x kv_heads {heads} x 2 (K and V) x (head_dim {dim} x "
               f"{element} bytes ({args.dtype}){' + 4-byte scale' if scales else ''}) x "
               f"{kept} tokens{' (the window)' if kept != args.tokens else ''} x batch {args.batch}")
    with torch.device("meta"):
        model = Transformer(config)
    try:
        caches = model.new_caches(args.batch, args.tokens, dtype, "meta")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    measured = sum(c.nbytes for c in caches)
    print(how)
    print(f"formula:  {formula:,d} bytes ({formula / 2**20:.2f} MiB)")
    print(f"measured: {measured:,d} bytes (the decoder's {type(caches[0]).__name__} buffers)")
    return 0 if formula == measured else 1


def cmd_export_hf(args: argparse.Namespace) -> int:
    """Write a checkpoint in the Hugging Face Marian format."""
    from transduce.export import export_hf

    out = export_hf(args.model, args.out)
    print(f"wrote {out} (load it with transformers.MarianMTModel.from_pretrained)")
    return 0


def cmd_export_ct2(args: argparse.Namespace) -> int:
    """Write a checkpoint as a CTranslate2 model."""
    from transduce.export import export_ctranslate2

    out = export_ctranslate2(args.model, args.out, args.quantization)
    print(f"wrote {out} (load it with ctranslate2.Translator; tokenizer: {out / 'spm.model'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="transduce", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("model-info", help="print a model's size and configuration")
    info.add_argument("--preset", default="base", choices=sorted(PRESETS))
    info.add_argument("--vocab-size", type=int, default=None,
                      help="shared vocabulary size (sets both src and tgt sizes)")
    add_config_flags(info, ModelConfig)
    info.set_defaults(handler=cmd_model_info)

    data = commands.add_parser("data", help="build or inspect a parallel corpus")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    bible_cmd = data_commands.add_parser("bible", help="extract the Spanish-English Bible corpus")
    bible_cmd.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    bible_cmd.add_argument("--src-module", default="spaRV1909eb")
    bible_cmd.add_argument("--tgt-module", default="engKJV2006eb")
    bible_cmd.add_argument("--ref2-module", default="engWEB2015eb",
                           help="second English reference for dev/test ('' for none)")
    bible_cmd.set_defaults(handler=cmd_data_bible)
    stats = data_commands.add_parser("stats", help="lengths, filtering and batching of a split")
    stats.add_argument("--data", type=Path, required=True)
    stats.add_argument("--split", default="train", choices=["train", "dev", "test"])
    stats.add_argument("--max-len", type=int, default=256,
                       help="pairs with more tokens on either side are filtered")
    stats.add_argument("--max-tokens", type=int, default=4096, help="batch budget per side")
    stats.set_defaults(handler=cmd_data_stats)

    vocab = commands.add_parser("vocab", help="train the shared BPE vocabulary")
    vocab.add_argument("--data", type=Path, required=True, help="corpus directory")
    vocab.add_argument("--size", type=int, default=8000)
    vocab.set_defaults(handler=cmd_vocab)

    train = commands.add_parser("train", help="train a model with the paper's recipe")
    train.add_argument("--data", type=Path, required=True, help="corpus directory with spm.model")
    train.add_argument("--out", type=Path, required=True, help="run directory for checkpoints")
    train.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="model preset (default: the config file's, else small)")
    train.add_argument("--config", type=Path, default=None, help="TOML file: preset, [model], [train]")
    train.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
    train.add_argument("--init", type=Path, default=None,
                       help="start from this checkpoint's weights (uptraining a converted model)")
    train.add_argument("--uptrain-fraction", type=float, default=0.05,
                       help="with --init and no budget: this fraction of its training steps")
    add_config_flags(train, TrainConfig)
    add_config_flags(train, ModelConfig)
    train.set_defaults(handler=cmd_train)

    average = commands.add_parser("average", help="average a run's last checkpoints")
    average.add_argument("run_dir", metavar="RUN", type=Path)
    average.add_argument("--last", type=int, default=5)
    average.add_argument("--out", type=Path, required=True)
    average.set_defaults(handler=cmd_average)

    plot = commands.add_parser("plot", help="plot a run's loss and learning-rate curves")
    plot.add_argument("run_dir", metavar="RUN", type=Path)
    plot.add_argument("--out", type=Path, default=None, help="PNG path (default RUN/curves.png)")
    plot.set_defaults(handler=cmd_plot)

    def search_flags(command: argparse.ArgumentParser) -> None:
        command.add_argument("--beam", type=int, default=4)
        command.add_argument("--alpha", type=float, default=0.6, help="GNMT length penalty")
        command.add_argument("--batch-tokens", type=int, default=4096)
        command.add_argument("--batch-sentences", type=int, default=0,
                             help="at most this many lines per batch (0: no cap)")
        command.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                             help="bfloat16: decode with a bfloat16 copy of the model "
                                  "(AMX / AVX512-BF16 on recent Xeons)")
        command.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "int8"],
                             help="KV-cache type (default: --dtype's); int8 quantizes it per "
                                  "token and head")

    translate = commands.add_parser("translate", help="translate lines of text")
    translate.add_argument("--model", type=Path, required=True, help="checkpoint or run directory")
    search_flags(translate)
    translate.add_argument("--nbest", type=int, default=1)
    translate.add_argument("--input", type=Path, default=None, help="default: standard input")
    translate.add_argument("--output", type=Path, default=None, help="default: standard output")
    translate.add_argument("--strict", action="store_true",
                           help="refuse lines over the model's length limit instead of truncating")
    translate.set_defaults(handler=cmd_translate)

    evaluate = commands.add_parser("evaluate", help="BLEU and chrF on a corpus split")
    evaluate.add_argument("--model", type=Path, required=True)
    evaluate.add_argument("--data", type=Path, required=True)
    evaluate.add_argument("--split", default="test", choices=["train", "dev", "test"])
    evaluate.add_argument("--out", type=Path, default=None,
                          help="prefix for .hyp and .json (default MODEL/eval-SPLIT-beamN)")
    search_flags(evaluate)
    evaluate.set_defaults(handler=cmd_evaluate)

    kv = commands.add_parser("kv-size", help="KV-cache bytes: formula and measured")
    source = kv.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, default=None)
    source.add_argument("--preset", choices=sorted(PRESETS), default=None)
    kv.add_argument("--vocab-size", type=int, default=None)
    kv.add_argument("--tokens", type=int, required=True)
    kv.add_argument("--batch", type=int, default=1)
    kv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "int8"])
    add_config_flags(kv, ModelConfig)  # with --model: size it as if changed so
    kv.set_defaults(handler=cmd_kv_size)

    convert = commands.add_parser("convert-kv", help="MHA checkpoint -> GQA / MQA by mean-pooling "
                                                     "key/value heads")
    convert.add_argument("run", metavar="RUN", type=Path, help="checkpoint or run directory")
    convert.add_argument("--kv-heads", type=int, required=True,
                         help="key/value heads G (1: multi-query); must divide num_heads")
    convert.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    convert.set_defaults(handler=cmd_convert_kv)

    maps = commands.add_parser("attention", help="draw a translation's attention maps")
    maps.add_argument("sentence", help="the source sentence")
    maps.add_argument("--model", type=Path, required=True, help="checkpoint or run directory")
    maps.add_argument("--out", type=Path, required=True, help="PNG file to write")
    maps.add_argument("--layer", type=int, default=None, help="only this layer (1-based)")
    maps.add_argument("--head", type=int, default=None, help="only this head (1-based)")
    maps.add_argument("--beam", type=int, default=4)
    maps.set_defaults(handler=cmd_attention)

    export = commands.add_parser("export", help="write a checkpoint in another toolkit's format")
    export_formats = export.add_subparsers(dest="format", required=True)
    hf = export_formats.add_parser("hf", help="Hugging Face Marian (MarianMTModel)")
    hf.add_argument("model", type=Path, help="checkpoint or run directory")
    hf.add_argument("out", type=Path, help="directory to write")
    hf.set_defaults(handler=cmd_export_hf)
    ct2 = export_formats.add_parser("ct2", help="CTranslate2")
    ct2.add_argument("model", type=Path, help="checkpoint or run directory")
    ct2.add_argument("out", type=Path, help="directory to write")
    ct2.add_argument("--quantization", default=None,
                     choices=["int8", "int8_float32", "int16", "float16", "bfloat16"],
                     help="weight type (default: float32)")
    ct2.set_defaults(handler=cmd_export_ct2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"transduce: configuration error: {error}", file=sys.stderr)
        return 2
    except USER_ERRORS as error:
        print(f"transduce: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
