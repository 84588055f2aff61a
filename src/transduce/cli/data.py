"""`transduce data import | tokenize | bible | bible-text | bible-genre | bible-paraphrase |
stats` and
`transduce vocab`:
corpora (parallel, text for language models and masked LMs, labelled text for
classifiers) and their vocabulary."""

from __future__ import annotations

import argparse
from pathlib import Path

from transduce.cli.options import positive_int, seed_value
from transduce.cli.outputs import check_directory_path
from transduce.config import ConfigError
from transduce.data.bible import DEFAULT_REF2_MODULE, DEFAULT_SRC_MODULE, DEFAULT_TGT_MODULE, \
    LANGUAGES
from transduce.data.corpus import SPLITS


def register(commands) -> None:
    data = commands.add_parser("data", help="build or inspect a parallel corpus")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    add_import_parser(data_commands)
    add_tokenize_parser(data_commands)
    bible = data_commands.add_parser("bible", help="extract the Spanish-English Bible corpus")
    bible.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    bible.add_argument("--src-module", default=DEFAULT_SRC_MODULE)
    bible.add_argument("--tgt-module", default=DEFAULT_TGT_MODULE)
    bible.add_argument("--ref2-module", default=DEFAULT_REF2_MODULE,
                       help="second English reference for dev/test ('' for none)")
    bible.set_defaults(handler=data_bible)

    text = data_commands.add_parser(
        "bible-text", help="extract one Bible module as a text corpus for language models, "
                           "in the translation corpus's fixed split")
    text.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    text.add_argument("--module", default=DEFAULT_TGT_MODULE,
                      help=f"SWORD module ({', '.join(LANGUAGES)})")
    text.add_argument("--language", default=None,
                      help="language code for corpus.json (default: the module's, "
                           f"{', '.join(f'{m} {code}' for m, code in LANGUAGES.items())})")
    text.set_defaults(handler=data_bible_text)

    genre = data_commands.add_parser(
        "bible-genre", help="label each verse of one Bible module with its section of the "
                            "canon (law, history, wisdom, prophets, gospels, letters), in the "
                            "translation corpus's fixed split, for sequence classification")
    _module_options(genre, f"SWORD module ({', '.join(LANGUAGES)})")
    genre.set_defaults(handler=data_bible_genre)

    paraphrase = data_commands.add_parser(
        "bible-paraphrase", help="pairs of verses from two English Bibles, labelled same (one "
                                 "verse in both) or different (a verse and the next), in the "
                                 "translation corpus's fixed split, for classifying pairs")
    _module_options(paraphrase, "SWORD module of the first text of each pair")
    paraphrase.add_argument("--second", default=DEFAULT_REF2_MODULE,
                            help="SWORD module of the second text")
    paraphrase.set_defaults(handler=data_bible_paraphrase)

    stats = data_commands.add_parser("stats", help="lengths, filtering and batching of a split "
                                                   "(parallel or text corpus)")
    stats.add_argument("--data", type=Path, required=True)
    stats.add_argument("--split", default="train", choices=SPLITS)
    stats.add_argument("--max-len", type=positive_int, default=256,
                       help="pairs with more tokens on either side are filtered")
    stats.add_argument("--max-tokens", type=positive_int, default=4096,
                       help="batch budget per side")
    stats.set_defaults(handler=data_stats)

    vocab = commands.add_parser("vocab", help="train the shared BPE vocabulary (on both sides "
                                              "of a parallel corpus, or on a text corpus), "
                                              "or one per side (--separate)")
    vocab.add_argument("--data", type=Path, required=True, help="corpus directory")
    vocab.add_argument("--size", type=positive_int, default=8000,
                       help="pieces in the vocabulary (with --separate: the sources')")
    vocab.add_argument("--separate", action="store_true",
                       help="a parallel corpus: a vocabulary for each side, spm.model on the "
                            "sources and spm-target.model on the targets (for languages that "
                            "share few pieces); models trained on it tie only the target "
                            "embedding to the output (tie_embeddings 'decoder')")
    vocab.add_argument("--target-size", type=positive_int, default=None, metavar="N",
                       help="with --separate: pieces in the targets' vocabulary (default "
                            "--size)")
    vocab.add_argument("--sample", type=positive_int, default=None, metavar="N",
                       help="train on N training pairs (a text corpus: lines) drawn uniformly "
                            "at random in one streamed pass (seeded), not on the whole "
                            "split: memory holds N of them, whatever the corpus's size")
    vocab.add_argument("--seed", type=seed_value, default=1, help="the --sample draw's seed")
    vocab.set_defaults(handler=train_vocabulary)


def data_bible(args: argparse.Namespace) -> int:
    """Extract the verse-aligned Bible corpus and write the fixed split."""
    check_directory_path(args.out, "--out")   # before minutes of extracting
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


def _module_options(command: argparse.ArgumentParser, module_help: str) -> None:
    """--out, --module and --language of a command that writes one module's corpus."""
    command.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    command.add_argument("--module", default=DEFAULT_TGT_MODULE, help=module_help)
    command.add_argument("--language", default=None,
                         help="language code for corpus.json (default: the module's)")


def _verses(args: argparse.Namespace):
    """--module's verses in the fixed split, reported, and their language."""
    from transduce.data import bible

    language = _language(args)
    corpus = bible.build_text_corpus(args.module)
    for line in corpus.report:
        print(line)
    return corpus, language


def _language(args: argparse.Namespace) -> str:
    """--language, else --module's known language."""
    language = args.language or LANGUAGES.get(args.module)
    if language is None:
        raise ConfigError(f"--module {args.module}: its language is not known; give --language")
    return language


def data_bible_text(args: argparse.Namespace) -> int:
    """Extract one module's verses as train.txt, dev.txt and test.txt in the fixed split."""
    check_directory_path(args.out, "--out")   # before minutes of extracting
    from transduce.data import bible
    from transduce.data.corpus import write_text_metadata

    corpus, language = _verses(args)
    written = bible.write_text_corpus(corpus, args.out)
    write_text_metadata(args.out, language, module=args.module,
                        split_from={"source_module": corpus.split_from[0],
                                    "target_module": corpus.split_from[1]})
    sizes = ", ".join(f"{split} {len(keys)}" for split, keys in corpus.splits.items())
    print(f"verses: {sizes}; wrote {len(written)} files to {args.out}")
    return 0


def data_bible_genre(args: argparse.Namespace) -> int:
    """One module's verses labelled by genre: train|dev|test.tsv, labels.txt, keys."""
    check_directory_path(args.out, "--out")   # before minutes of extracting
    from transduce.data import bible
    from transduce.data.corpus import write_text_metadata

    corpus, language = _verses(args)
    written = bible.write_genre_corpus(corpus, args.out)
    write_text_metadata(args.out, language, kind="classification", module=args.module,
                        labels=list(bible.GENRES),
                        split_from={"source_module": corpus.split_from[0],
                                    "target_module": corpus.split_from[1]})
    sizes = ", ".join(f"{split} {len(keys)}" for split, keys in corpus.splits.items())
    print(f"verses: {sizes}; classes {', '.join(bible.GENRES)}; wrote {len(written)} files "
          f"to {args.out}")
    return 0


def data_bible_paraphrase(args: argparse.Namespace) -> int:
    """Verse pairs of two modules labelled same or different: train|dev|test.tsv,
    labels.txt, keys."""
    check_directory_path(args.out, "--out")   # before minutes of extracting
    from transduce.data import bible
    from transduce.data.corpus import write_text_metadata

    language = _language(args)
    translation = bible.build_corpus(ref2_module=None)
    first, second = (bible.text_corpus(translation, module)
                     for module in (args.module, args.second))
    for line in first.report + second.report[1:]:
        print(line)
    pairs = bible.paraphrase_pairs(first, second)
    written = bible.write_paraphrase_corpus(first, second, pairs, args.out)
    write_text_metadata(args.out, language, kind="classification", module=args.module,
                        second_module=args.second, labels=list(bible.PARAPHRASE_LABELS),
                        split_from={"source_module": first.split_from[0],
                                    "target_module": first.split_from[1]})
    sizes = ", ".join(f"{split} {len(triples)}" for split, triples in pairs.items())
    print(f"pairs: {sizes}; classes {', '.join(bible.PARAPHRASE_LABELS)}; wrote "
          f"{len(written)} files to {args.out}")
    return 0


def data_stats(args: argparse.Namespace) -> int:
    """Tokenised lengths, the length filter and token-count batching of a split."""
    import numpy as np

    from transduce.data.batching import TokenBatcher
    from transduce.data.corpus import corpus_kind
    from transduce.data.dataset import load_split
    from transduce.data.tokenizer import MODEL_NAME, Tokenizer

    if corpus_kind(args.data) == "text":
        return _text_stats(args)
    split = load_split(args.data, args.split, Tokenizer(args.data / MODEL_NAME), args.max_len)
    for line in split.report:
        print(line)
    batcher = TokenBatcher(split.src_ids, split.tgt_ids, args.max_tokens,
                           line_numbers=split.line_numbers)
    batches = batcher.epoch_batches(0)
    src_tokens = int(batcher.src_lengths.sum(dtype=np.int64))     # eos included; a token
    tgt_tokens = int(batcher.tgt_lengths.sum(dtype=np.int64))     # store's ids are not read
    print(f"tokens: {src_tokens} source, {tgt_tokens} target; {len(batches)} batches of at most "
          f"{args.max_tokens} tokens a side; padding {100 * batcher.padding_fraction(0):.1f}%")
    return 0


def _text_stats(args: argparse.Namespace) -> int:
    """data stats of a text corpus: its lines batched as a language model's."""
    import numpy as np

    from transduce.data.batching import TokenBatcher
    from transduce.data.dataset import load_text_split
    from transduce.data.tokenizer import MODEL_NAME, Tokenizer

    split = load_text_split(args.data, args.split, Tokenizer(args.data / MODEL_NAME), args.max_len)
    for line in split.report:
        print(line)
    batcher = TokenBatcher(None, split.ids, args.max_tokens, line_numbers=split.line_numbers)
    tokens = int(batcher.tgt_lengths.sum(dtype=np.int64))
    print(f"tokens: {tokens} (eos included); {len(batcher.epoch_batches(0))} batches of at most "
          f"{args.max_tokens} tokens; padding {100 * batcher.padding_fraction(0):.1f}%")
    return 0


def _sampled_texts(args: argparse.Namespace, kind: str) -> list[list[str]]:
    """--sample pairs (each side's texts) or lines of the training split, drawn in one
    streamed pass."""
    from transduce.data.corpus import split_files, text_file
    from transduce.data.store import sample_pairs

    files = (text_file(args.data, "train"),) if kind == "text" else \
        split_files(args.data, "train")
    sample = sample_pairs(files, args.sample, args.seed)
    unit = "lines with text" if kind == "text" else "pairs with text on both sides"
    print(f"{' / '.join(map(str, files))}: sampled {len(sample.pairs)} of {sample.seen} "
          f"{unit} (seed {args.seed})")
    return [[row[side] for row in sample.pairs] for side in range(len(files))]


def train_vocabulary(args: argparse.Namespace) -> int:
    """Train the BPE vocabulary on both sides of the training split of a parallel corpus
    (or one on each side), or on the training text of a text or classification corpus."""
    from transduce.data.corpus import corpus_kind
    from transduce.data.tokenizer import train_tokenizer

    kind = corpus_kind(args.data)
    if args.sample is not None and kind == "classification":
        raise ConfigError(f"--sample draws from a parallel or text corpus; {args.data} is a "
                          f"classification corpus")
    if args.separate and kind != "parallel":
        raise ConfigError(f"--separate trains a vocabulary for each side of a parallel "
                          f"corpus; {args.data} is a {kind} corpus")
    if args.target_size is not None and not args.separate:
        raise ConfigError("--target-size sizes a separate target vocabulary: give --separate")
    sides = _training_texts(args, kind)
    if args.separate:
        tokenizer = train_tokenizer(sides[0], args.data, args.size, sides[1], args.target_size)
        _report_vocabulary(tokenizer, sides[0])
        _report_vocabulary(tokenizer.target_tokenizer, sides[1])
    else:
        texts = [text for side in sides for text in side]
        _report_vocabulary(train_tokenizer(texts, args.data, args.size), texts)
    return 0


def _training_texts(args: argparse.Namespace, kind: str) -> list[list[str]]:
    """The training split's texts, per side (one side for a text or classification
    corpus), all of them or --sample's."""
    from transduce.data.corpus import read_split, read_text_split

    if kind == "classification":
        from transduce.data.labelled import labelled_file, read_labelled
        labelled = read_labelled(labelled_file(args.data, "train"))
        print(labelled.summary())
        return [labelled.texts + (labelled.seconds or [])]   # a pair's texts share one side
    if args.sample is not None:
        return _sampled_texts(args, kind)
    if kind == "text":
        text = read_text_split(args.data, "train")
        print(text.summary())
        return [text.lines]
    train = read_split(args.data, "train")
    print(train.summary())
    return [train.source, train.target]


def _report_vocabulary(tokenizer, texts: list[str]) -> None:
    lossless = sum(tokenizer.decode(ids) == text
                   for ids, text in zip(tokenizer.encode(texts), texts))
    print(f"wrote {tokenizer.path} ({tokenizer.vocab_size} pieces; pad 0, bos 1, eos 2, unk 3); "
          f"round trip exact for {lossless} of {len(texts)} training sentences")


def add_import_parser(data_commands) -> None:
    imp = data_commands.add_parser(
        "import", help="make a corpus directory from raw parallel text (two aligned files or "
                       "a TSV; plain, .gz, .xz or .zst): cleaned with counts, split by hash")
    imp.add_argument("--src", type=Path, default=None, help="source side, one sentence a line")
    imp.add_argument("--tgt", type=Path, default=None, help="target side, line-aligned with --src")
    imp.add_argument("--tsv", type=Path, default=None,
                     help="instead of --src/--tgt: one file of source<TAB>target lines")
    imp.add_argument("--source-language", required=True, help="code naming the source files")
    imp.add_argument("--target-language", required=True, help="code naming the target files")
    imp.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    imp.add_argument("--dev", type=non_negative_int, default=0, metavar="N",
                     help="hold out N pairs, chosen by a hash of the pair, as dev")
    imp.add_argument("--test", type=non_negative_int, default=0, metavar="N",
                     help="hold out N further pairs, by hash, as test")
    for name in ("dev", "test"):
        imp.add_argument(f"--{name}-src", type=Path, default=None,
                         help=f"{name} set's source file (instead of --{name} N)")
        imp.add_argument(f"--{name}-tgt", type=Path, default=None,
                         help=f"{name} set's target file")
    imp.add_argument("--max-words", type=non_negative_int, default=250,
                     help="drop pairs with more words on a side (0: no limit)")
    imp.add_argument("--max-ratio", type=non_negative_float, default=9.0,
                     help="drop pairs whose longer side has more than this many times the "
                          "words of the shorter (0: no limit)")
    imp.add_argument("--keep-duplicates", action="store_true",
                     help="keep exact duplicate pairs (dropped and counted by default)")
    imp.add_argument("--strict", action="store_true",
                     help="invalid UTF-8 is an error naming file, line and byte (by default "
                          "the pair is dropped and counted)")
    imp.add_argument("--resplit", action="store_true",
                     help="re-importing into an earlier import's --out: draw the split anew "
                          "instead of keeping its thresholds")
    imp.set_defaults(handler=data_import)


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text}")
    return value


def _file_pair(args: argparse.Namespace, name: str) -> tuple[Path, Path] | None:
    src, tgt = getattr(args, f"{name}_src"), getattr(args, f"{name}_tgt")
    if (src is None) != (tgt is None):
        raise ConfigError(f"--{name}-src and --{name}-tgt go together")
    return None if src is None else (src, tgt)


def data_import(args: argparse.Namespace) -> int:
    """Clean raw parallel text, split it by hash, and write a corpus directory."""
    from transduce.data.importer import CleaningRules, import_corpus

    if args.tsv is not None and (args.src is not None or args.tgt is not None):
        raise ConfigError("give either --src and --tgt, or --tsv, not both")
    if args.tsv is None and (args.src is None or args.tgt is None):
        raise ConfigError("give --src and --tgt (two line-aligned files), or --tsv")
    dev_files, test_files = _file_pair(args, "dev"), _file_pair(args, "test")
    if dev_files is not None and args.dev or test_files is not None and args.test:
        raise ConfigError("give dev and test either as --dev/--test N (held out by hash) or "
                          "as files, not both")
    rules = CleaningRules(max_words=args.max_words, max_ratio=args.max_ratio,
                          strict=args.strict, dedupe=not args.keep_duplicates)
    result = import_corpus(args.out, args.source_language, args.target_language,
                           src=args.src, tgt=args.tgt, tsv=args.tsv, dev=args.dev,
                           test=args.test, dev_files=dev_files, test_files=test_files,
                           rules=rules, resplit=args.resplit)
    for line in result.report:
        print(line)
    print(f"wrote {args.out}; next: `transduce vocab --data {args.out}`")
    return 0


def add_tokenize_parser(data_commands) -> None:
    tokenize = data_commands.add_parser(
        "tokenize", help="tokenise the training split once into an on-disk token store "
                         "(DIR/tokens/train), for corpora larger than memory; training then "
                         "reads it instead of the text")
    tokenize.add_argument("--data", type=Path, required=True,
                          help="corpus directory with spm.model")
    tokenize.add_argument("--workers", type=non_negative_int, default=0,
                          help="encoding processes (0: one per CPU, at most 8; 1: in this "
                               "process)")
    tokenize.set_defaults(handler=data_tokenize)


def data_tokenize(args: argparse.Namespace) -> int:
    """Stream the training split through the vocabulary into its token store."""
    from transduce.data.store import build_store
    from transduce.data.tokenizer import MODEL_NAME, Tokenizer

    tokenizer = Tokenizer(args.data / MODEL_NAME)
    target = tokenizer.target_tokenizer       # the targets' own, where they have one
    result = build_store(args.data, "train", tokenizer.path,
                         max(tokenizer.vocab_size, target.vocab_size), tokenizer.fingerprint,
                         target_model=None if target is tokenizer else target.path,
                         workers=args.workers)
    if len(result.tokens) == 2:
        unit, ids = "pairs", f"{result.tokens[0]} source and {result.tokens[1]} target ids"
    else:
        unit, ids = "lines", f"{result.tokens[0]} ids"
    skipped = f"; left out {result.skipped_empty} with an empty side" \
        if result.skipped_empty else ""
    print(f"wrote {result.path}: {result.pairs} {unit}, {ids} as {result.dtype}{skipped}")
    return 0
