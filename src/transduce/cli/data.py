"""`transduce data bible | bible-text | bible-genre | stats` and `transduce vocab`:
corpora (parallel, text for language models and masked LMs, labelled text for
classifiers) and their vocabulary."""

from __future__ import annotations

import argparse
from pathlib import Path

from transduce.cli.options import positive_int
from transduce.config import ConfigError
from transduce.data.bible import DEFAULT_REF2_MODULE, DEFAULT_SRC_MODULE, DEFAULT_TGT_MODULE, \
    LANGUAGES
from transduce.data.corpus import SPLITS


def register(commands) -> None:
    data = commands.add_parser("data", help="build or inspect a parallel corpus")
    data_commands = data.add_subparsers(dest="data_command", required=True)
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
    genre.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    genre.add_argument("--module", default=DEFAULT_TGT_MODULE,
                       help=f"SWORD module ({', '.join(LANGUAGES)})")
    genre.add_argument("--language", default=None,
                       help="language code for corpus.json (default: the module's)")
    genre.set_defaults(handler=data_bible_genre)

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
                                              "of a parallel corpus, or on a text corpus)")
    vocab.add_argument("--data", type=Path, required=True, help="corpus directory")
    vocab.add_argument("--size", type=positive_int, default=8000)
    vocab.set_defaults(handler=train_vocabulary)


def data_bible(args: argparse.Namespace) -> int:
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


def _verses(args: argparse.Namespace):
    """--module's verses in the fixed split, reported, and their language."""
    from transduce.data import bible

    language = args.language or LANGUAGES.get(args.module)
    if language is None:
        raise ConfigError(f"--module {args.module}: its language is not known; give --language")
    corpus = bible.build_text_corpus(args.module)
    for line in corpus.report:
        print(line)
    return corpus, language


def data_bible_text(args: argparse.Namespace) -> int:
    """Extract one module's verses as train.txt, dev.txt and test.txt in the fixed split."""
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


def data_stats(args: argparse.Namespace) -> int:
    """Tokenised lengths, the length filter and token-count batching of a split."""
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
    src_tokens = sum(len(x) + 1 for x in split.src_ids)
    tgt_tokens = sum(len(x) + 1 for x in split.tgt_ids)
    print(f"tokens: {src_tokens} source, {tgt_tokens} target; {len(batches)} batches of at most "
          f"{args.max_tokens} tokens a side; padding {100 * batcher.padding_fraction(0):.1f}%")
    return 0


def _text_stats(args: argparse.Namespace) -> int:
    """data stats of a text corpus: its lines batched as a language model's."""
    from transduce.data.batching import TokenBatcher
    from transduce.data.dataset import load_text_split
    from transduce.data.tokenizer import MODEL_NAME, Tokenizer

    split = load_text_split(args.data, args.split, Tokenizer(args.data / MODEL_NAME), args.max_len)
    for line in split.report:
        print(line)
    batcher = TokenBatcher(None, split.ids, args.max_tokens, line_numbers=split.line_numbers)
    tokens = sum(len(x) + 1 for x in split.ids)
    print(f"tokens: {tokens} (eos included); {len(batcher.epoch_batches(0))} batches of at most "
          f"{args.max_tokens} tokens; padding {100 * batcher.padding_fraction(0):.1f}%")
    return 0


def train_vocabulary(args: argparse.Namespace) -> int:
    """Train the BPE vocabulary on both sides of the training split of a parallel corpus,
    or on the training text of a text or classification corpus."""
    from transduce.data.corpus import corpus_kind, read_split, read_text_split
    from transduce.data.tokenizer import train_tokenizer

    kind = corpus_kind(args.data)
    if kind == "classification":
        from transduce.data.labelled import labelled_file, read_labelled
        labelled = read_labelled(labelled_file(args.data, "train"))
        print(labelled.summary())
        texts = labelled.texts
    elif kind == "text":
        text = read_text_split(args.data, "train")
        print(text.summary())
        texts = text.lines
    else:
        train = read_split(args.data, "train")
        print(train.summary())
        texts = train.source + train.target
    tokenizer = train_tokenizer(texts, args.data, args.size)
    lossless = sum(tokenizer.decode(ids) == text
                   for ids, text in zip(tokenizer.encode(texts), texts))
    print(f"wrote {tokenizer.path} ({tokenizer.vocab_size} pieces; pad 0, bos 1, eos 2, unk 3); "
          f"round trip exact for {lossless} of {len(texts)} training sentences")
    return 0
