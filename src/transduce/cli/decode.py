"""`transduce translate | evaluate | attention`: using a trained model."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from transduce.cli.options import add_search_options, positive_int, search_batch_tokens
from transduce.cli.outputs import check_output_file
from transduce.cli.reporting import one_line_warnings
from transduce.config import ConfigError
from transduce.data.corpus import SPLITS

STDIN_BATCH_LINES = 64   # lines already waiting on standard input translated together


def register(commands) -> None:
    translate = commands.add_parser("translate", help="translate lines of text")
    translate.add_argument("--model", type=Path, required=True, help="checkpoint or run directory")
    add_search_options(translate)
    translate.add_argument("--nbest", type=positive_int, default=1,
                           help="n-best lists (at most --beam), Moses style: index ||| text ||| score")
    translate.add_argument("--input", type=Path, default=None, help="default: standard input")
    translate.add_argument("--output", type=Path, default=None, help="default: standard output")
    translate.add_argument("--strict", action="store_true",
                           help="refuse lines over the model's length limit instead of truncating")
    add_language_options(translate)
    translate.set_defaults(handler=translate_command)

    evaluate = commands.add_parser("evaluate", help="BLEU and chrF on a corpus split; "
                                                    "perplexity for a language model")
    evaluate.add_argument("--model", type=Path, required=True)
    evaluate.add_argument("--data", type=Path, required=True)
    evaluate.add_argument("--split", default="test", choices=SPLITS)
    evaluate.add_argument("--out", type=Path, default=None,
                          help="prefix for .hyp and .json (default MODEL/eval-SPLIT-beamN; "
                               "a language model's .json: MODEL/eval-SPLIT-lm)")
    add_search_options(evaluate, classifies=True)
    add_language_options(evaluate)
    evaluate.set_defaults(handler=evaluate_command)

    maps = commands.add_parser(
        "attention", help="draw the attention maps of a translation, of an encoder-only "
                          "model's pass over a text, or of a language model's continuation",
        description="Draw every layer's and head's attention maps as a PNG: of a "
                    "translation (an encoder-decoder), of one pass over the text (an "
                    "encoder-only model: self-attention; --pair for a pair of texts), or "
                    "of a prompt and its greedy continuation (a language model).")
    maps.add_argument("sentence", help="the source sentence (the text; the prompt)")
    maps.add_argument("--model", type=Path, required=True, help="checkpoint or run directory")
    maps.add_argument("--out", type=Path, required=True, help="PNG file to write")
    maps.add_argument("--layer", type=positive_int, default=None, help="only this layer (1-based)")
    maps.add_argument("--head", type=positive_int, default=None, help="only this head (1-based)")
    maps.add_argument("--beam", type=positive_int, default=4)
    maps.add_argument("--no-doubles", action="store_true",
                      help="a token never directly follows itself, as in translate")
    maps.add_argument("--pair", default=None, help="an encoder-only model: the second text "
                                                   "of a pair, [CLS] A [SEP] B [SEP]")
    maps.add_argument("--max-new-tokens", type=positive_int, default=32,
                      help="a language model: the continuation's tokens at most")
    maps.add_argument("--rollout", action="store_true",
                      help="each stack's self-attention rolled out through its layers "
                           "(Abnar & Zuidema 2020: heads averaged, the residual's identity "
                           "mixed in, multiplied up from the first layer), one map a layer")
    add_language_options(maps)
    maps.set_defaults(handler=attention_command)


def add_language_options(parser: argparse.ArgumentParser) -> None:
    """--source-lang and --target-lang: a multilingual model's pair (decode/languages.py)."""
    for side in ("source", "target"):
        parser.add_argument(f"--{side}-lang", default=None, metavar="CODE",
                            help=f"a multilingual model's {side} language, one of its codes "
                                 f"(NLLB's: eng_Latn, fra_Latn, ...); default: the pair it "
                                 f"records")


def translate_command(args: argparse.Namespace) -> int:
    """Translate lines from a file or standard input; N lines in, N lines out, in order."""
    from transduce.decode.translate import Translator
    from transduce.runtime import keep_freed_memory

    keep_freed_memory()  # a process setting: the command line's to make, not the library's

    if args.nbest > args.beam:
        raise ConfigError(f"--nbest {args.nbest}: must be at most --beam ({args.beam})")
    if args.output is not None:
        check_output_file(args.output, "--output")
    translator = Translator.load(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype,
                                 engine=args.engine, workers=args.workers)
    translator.direction(args.source_lang, args.target_lang)   # refused before any input
    if args.input is not None:
        _translate_file(translator, args)
        return 0
    from transduce import atomic
    from transduce.decode.streaming import line_batches

    with contextlib.ExitStack() as stack:   # an --output file appears complete or not at all
        out = stack.enter_context(open(stack.enter_context(atomic.atomic_file(args.output)),
                                       "w", encoding="utf-8")) if args.output else sys.stdout
        done = 0
        for lines in line_batches(sys.stdin.fileno(), max_lines=STDIN_BATCH_LINES):
            out.write(_translated_text(translator, lines, args, done))
            out.flush()
            done += len(lines)
    return 0


def _translate_file(translator, args: argparse.Namespace) -> None:
    """The whole input file at once; an --output file appears complete or not at all."""
    from tqdm import tqdm

    from transduce import atomic
    from transduce.data.corpus import read_lines

    lines = read_lines(args.input, allow_empty=True)
    with tqdm(total=len(lines), unit="line", disable=args.output is None) as bar, \
            one_line_warnings(args.input):
        text = _translated_text(translator, lines, args, 0, progress=bar.update)
    if args.output is None:
        sys.stdout.write(text)
    else:
        atomic.write_text(args.output, text)


def _translated_text(translator, lines: list[str], args: argparse.Namespace, done: int,
                     progress=None) -> str:
    """The output for lines that follow `done` earlier lines of the input."""
    from transduce.decode.streaming import format_best, format_nbest

    options = dict(beam=args.beam, alpha=args.alpha, batch_tokens=args.batch_tokens,
                   batch_sentences=args.batch_sentences, strict=args.strict,
                   first_line_number=done + 1, progress=progress,
                   source_lang=args.source_lang, target_lang=args.target_lang,
                   no_doubles=args.no_doubles)
    if args.nbest == 1:
        return format_best(translator.translate(lines, **options))
    return format_nbest(translator.translate_nbest(lines, args.nbest, **options), done)


def evaluate_command(args: argparse.Namespace) -> int:
    """sacreBLEU and chrF of a model on a corpus split, with signatures; a language
    model's perplexity per piece and per word; a classifier's accuracy and macro-F1, a
    tagger's entity F1, a question answerer's exact match and F1."""
    from tqdm import tqdm

    arch = _arch(args.model)
    if arch == "decoder":
        return _evaluate_language_model(args)
    if arch == "encoder":
        return _evaluate_encoder(args)

    from transduce.decode.evaluate import evaluate_split
    from transduce.decode.translate import Translator
    from transduce.runtime import keep_freed_memory

    keep_freed_memory()  # a process setting: the command line's to make, not the library's
    suffix = f"-kv{args.kv_dtype}" if args.kv_dtype else ""
    out = args.out or (Path(args.model) / f"eval-{args.split}-beam{args.beam}{suffix}")
    files = _check_outputs(out, "translation")
    translator = Translator.load(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype,
                                 engine=args.engine, workers=args.workers)
    translator.direction(args.source_lang, args.target_lang)   # refused before translating
    with tqdm(unit="line", desc=f"translating {args.split}") as bar:
        result = evaluate_split(translator, args.data, args.split, out, beam=args.beam,
                                alpha=args.alpha, batch_tokens=search_batch_tokens(args),
                                batch_sentences=args.batch_sentences, progress=bar.update,
                                source_lang=args.source_lang, target_lang=args.target_lang,
                                no_doubles=args.no_doubles)
    print(f"{args.split}: BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  "
          f"({result['sentences']} sentences, beam {args.beam}, "
          f"{result['sentences_per_second']:.1f} sentences/s)")
    print(f"  {result['bleu_signature']}\n  {result['chrf_signature']}")
    if "bleu_ref2" in result:
        print(f"  second reference: BLEU {result['bleu_ref2']:.2f}; both references: "
              f"BLEU {result['bleu_two_references']:.2f}")
    print(f"wrote {' and '.join(map(str, files))}")
    return 0


def _check_outputs(prefix: Path, kind: str) -> list[Path]:
    """Before the split is scored: every file an evaluation of `kind` writes can be
    written -> those files."""
    from transduce.decode.evaluate import written_files

    files = written_files(prefix, kind)
    for path in files:
        check_output_file(path, "--out")
    return files


def _arch(path: Path) -> str:
    """The architecture of --model's checkpoint, run or ONNX export."""
    from transduce import checkpoint
    from transduce.onnx_format import is_onnx_export

    if is_onnx_export(path):
        from transduce.decode.onnx_engine import exported_config

        return exported_config(Path(path)).arch
    return checkpoint.read_configs(checkpoint.resolve(Path(path)))[0].arch


def _evaluate_encoder(args: argparse.Namespace) -> int:
    """Accuracy and macro-F1 of an encoder-only classifier on a labelled split, word
    accuracy and entity F1 of a token classifier on a tagging split, or SQuAD's exact
    match and F1 of a question answerer on a question-answering split."""
    from transduce.decode.encode import SentenceEncoder
    from transduce.decode.evaluate import evaluate_answerer, evaluate_classifier, \
        evaluate_tagger

    if args.kv_dtype is not None:
        raise ConfigError("a classifier keeps no KV cache: --kv-dtype applies to models "
                          "that decode")
    if args.no_doubles:
        raise ConfigError("--no-doubles applies to translation: a classifier writes no text")
    encoder = SentenceEncoder.load(args.model, dtype=args.dtype, engine=args.engine)
    task, kind, evaluate = ("tag", "tagging", evaluate_tagger) if encoder.tags else \
        ("answer", "qa", evaluate_answerer) if encoder.answers else \
        ("classify", "classification", evaluate_classifier)
    out = args.out or (Path(args.model) / f"eval-{args.split}-{task}")
    files = _check_outputs(out, kind)
    result = evaluate(encoder, args.data, args.split, out, batch_tokens=args.batch_tokens)
    if encoder.answers:
        apart = "".join(f"; {name.replace('_', ' ')}: exact match "
                        f"{100 * result[name]['exact_match']:.2f}"
                        for name in ("has_answer", "no_answer") if name in result)
        print(f"{args.split}: exact match {100 * result['exact_match']:.2f}, F1 "
              f"{100 * result['f1']:.2f} ({result['questions']} questions, "
              f"{result['unanswerable']} without an answer{apart}; "
              f"{result['questions_per_second']:.1f} questions/s)")
    elif encoder.tags:
        print(f"{args.split}: entity F1 {100 * result['f1']:.2f} (precision "
              f"{100 * result['precision']:.2f}, recall {100 * result['recall']:.2f}, "
              f"{result['entities']} entities), word accuracy "
              f"{100 * result['accuracy']:.2f}% ({result['sentences']} sentences, "
              f"{result['words']} words; {result['words_per_second']:.0f} words/s)")
    else:
        print(f"{args.split}: accuracy {100 * result['accuracy']:.2f}%, macro-F1 "
              f"{100 * result['macro_f1']:.2f} ({result['lines']} lines, "
              f"{len(result['classes'])} classes; {result['lines_per_second']:.0f} lines/s)")
    print(f"wrote {' and '.join(map(str, files))}")
    return 0


def _evaluate_language_model(args: argparse.Namespace) -> int:
    """Perplexity per piece and per word of a decoder-only model on a text split."""
    import torch

    from transduce import checkpoint
    from transduce.decode.evaluate import evaluate_language_model
    from transduce.decode.onnx_engine import check_onnx_settings, runs_on_onnxruntime
    from transduce.decode.onnx_lm_engine import OnnxLanguageModel
    from transduce.decode.options import decoding_dtype
    from transduce.model import load_model
    from transduce.model.packed import decoding_copy

    if args.kv_dtype is not None:
        raise ConfigError("--kv-dtype: a language model is scored over whole lines at once, "
                          "with no KV cache; --dtype scores a decoding copy")
    if args.no_doubles:
        raise ConfigError("--no-doubles applies to translation: a language model is scored "
                          "on the split's own text")
    dtype = "float32" if args.dtype == "auto" else args.dtype   # the model's own perplexity
    out = args.out or (Path(args.model) / f"eval-{args.split}-lm")
    files = _check_outputs(out, "language model")
    if runs_on_onnxruntime(args.model, args.engine):
        check_onnx_settings(dtype, None, "cpu")
        device, directory = torch.device("cpu"), Path(args.model)
        model = OnnxLanguageModel(directory)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = decoding_dtype(dtype, device)            # int8 refused where it cannot run
        directory = checkpoint.resolve(Path(args.model))
        model = load_model(directory, device)
        if dtype != "float32":      # the copy generate decodes with; the float model freed
            model = decoding_copy(model, getattr(torch, dtype), device, in_place=True)
    result = evaluate_language_model(model, checkpoint.load_tokenizer(directory), args.data,
                                     args.split, out, batch_tokens=search_batch_tokens(args),
                                     device=device, dtype=dtype)
    print(f"{args.split} ({dtype}): perplexity {result['perplexity_per_piece']:.2f} per piece, "
          f"{result['perplexity_per_word']:.2f} per word ({result['lines']} lines, "
          f"{result['pieces']} pieces, {result['words']} words with one eos per line; "
          f"{result['pieces_per_second']:.0f} pieces/s)")
    if result["lines_too_long_skipped"]:
        print(f"  left out {result['lines_too_long_skipped']} lines longer than the model's "
              f"{result['max_positions']} positions (lines "
              f"{', '.join(map(str, result['too_long_line_numbers'][:5]))} ...)")
    print(f"wrote {' and '.join(map(str, files))}")
    return 0


def attention_command(args: argparse.Namespace) -> int:
    """Translate a sentence (encode a text, continue a prompt) and draw its attention
    maps."""
    from transduce import checkpoint
    from transduce.attention_maps import plot_attention_maps

    check_output_file(args.out, "--out")
    arch = checkpoint.read_configs(checkpoint.resolve(args.model))[0].arch
    if args.pair is not None and arch != "encoder":
        raise ConfigError(f"--pair is the second text of an encoder-only model's pair; "
                          f"this model is arch={arch!r}")
    if args.rollout and args.head is not None:
        raise ConfigError("--head with --rollout: a rollout averages every head of a layer")
    maps = _attention_maps(args, arch)
    if args.rollout:
        maps = maps.rollout()
        if not maps.encoder and not maps.decoder:
            raise ConfigError("--rollout: this model has no self-attention layers to roll "
                              "out through (an RNN's attention is cross-attention alone)")
    out = plot_attention_maps(maps, args.out, layer=args.layer, head=args.head,
                              rolled_out=args.rollout)
    if arch == "encoder":
        print(f"text: {maps.translation}")
    else:
        kind = "continued" if arch == "decoder" else "translation"
        print(f"{kind}: {maps.translation}  (log-probability {maps.log_prob:.3f})")
    print(f"wrote {out}")
    return 0


def _attention_maps(args: argparse.Namespace, arch: str):
    """The maps of the model's shape: an encoder-only model's pass, a language model's
    continuation, else a translation."""
    from transduce.attention_maps import attention_maps, encoder_attention_maps, \
        generation_attention_maps

    if arch == "encoder":
        from transduce.decode.encode import SentenceEncoder

        return encoder_attention_maps(SentenceEncoder.load(args.model, engine="torch"),
                                      args.sentence, args.pair)
    if arch == "decoder":
        from transduce.decode.generate import Generator

        return generation_attention_maps(Generator.load(args.model, engine="torch"),
                                         args.sentence, max_new_tokens=args.max_new_tokens)
    from transduce.decode.translate import Translator

    return attention_maps(Translator.load(args.model, engine="torch"), args.sentence,
                          beam=args.beam, source_lang=args.source_lang,
                          target_lang=args.target_lang, no_doubles=args.no_doubles)
