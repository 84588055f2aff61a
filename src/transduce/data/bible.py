"""The built-in corpus: verse-aligned Spanish -> English Bible from Debian's SWORD modules.

`diatheke -f plain` prints one verse per "Book C:V: text" line, with traps this module
handles: section headings stand on lines of their own before an indented verse line (and
are repeated before later indented verses); a verse may run over several lines; pilcrows
(¶), Strong's tags (<H2416>) and OSIS markup (<title>...</title>) are mixed in; the last
line names the module. Footnotes are asked for (`-o f`, printed " [1:1 text] ") and then
dropped here, because without them diatheke drops a footnote that stands between two
words together with the space it replaced: the WEB's Genesis 1:1 read "Godcreated", and
203 of its verses were glued so. The result is one clean line per verse keyed by
(book, chapter, verse), the English book name as diatheke prints it.

The split is fixed, so that figures are comparable across runs and toolkits: sort the
aligned keys as Python tuples, shuffle with random.Random(1234), then 1000 test, 1000
dev, the rest train (the test split begins Ecclesiastes 6:8, II Kings 14:18, Daniel 2:18).

The text corpus of one module, for language models, keeps that split: its test and dev
verses are the translation corpus's, and its train verses every other verse with text,
so no verse a translation model is tested on is ever in a language model's training
text (and a language model trained here can be compared on the same held-out verses).
Each split is in canonical order (book, chapter, verse), so neighbouring lines are
consecutive verses wherever no held-out verse stands between them.

The genre corpus (sequence classification) is that text corpus with each verse labelled
by its section of the canon (GENRES, in canonical order): law (Genesis-Deuteronomy),
history (Joshua-Esther), wisdom (Job-Song of Solomon: wisdom and poetry), prophets
(Isaiah-Malachi, the major and minor prophets), gospels (Matthew-Acts: the four gospels
and Acts), letters (Romans-Revelation of John: the epistles and Revelation).

The paraphrase corpus (classification of pairs) puts two English translations side by
side in that split: each verse with text in both is one pair, the KJV's rendering and,
in half the pairs (drawn by a seeded generator), the WEB's rendering of the same verse
("same"), in the other half the WEB's of the next verse of the split ("different": the
same book and matter, mostly, so that shared words do not give it away).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from transduce import atomic
from transduce.errors import TransduceError

Key = tuple[str, int, int]

BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "I Samuel", "II Samuel", "I Kings", "II Kings", "I Chronicles", "II Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "I Corinthians",
    "II Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians",
    "I Thessalonians", "II Thessalonians", "I Timothy", "II Timothy", "Titus", "Philemon",
    "Hebrews", "James", "I Peter", "II Peter", "I John", "II John", "III John", "Jude",
    "Revelation of John",
)
# The 66 books of the Protestant canon; other books a module has (the WEB's
# deuterocanon) are not verses of this corpus.
_BOOK_ALTERNATIVES = "|".join(re.escape(b) for b in sorted(BOOKS, key=len, reverse=True))
_VERSE = re.compile(rf"^(?P<indent>\s*)(?P<book>{_BOOK_ALTERNATIVES}) (?P<chapter>\d+):(?P<verse>\d+):(?P<text>.*)$")
# A verse line of a book outside the 66: a capitalised name of words and parentheses.
_OTHER_VERSE = re.compile(r"^\s*[A-Z][A-Za-z ()]*? \d+:\d+: ")
_TITLE = re.compile(r"<title\b[^>]*>.*?</title>", re.DOTALL)
_STRONGS = re.compile(r"\s*<[HG]\d+>")  # follows its word: "vida <H2416>, toda"
_TAG = re.compile(r"<[^<>]*>")
_LEADING_MARKUP = re.compile(r"^(\s*)(?:<[^<>]*>\s*)+")  # before a glued verse key
_TRAILER = re.compile(r"^\((?P<module>[\w.-]+)\)$")
# A footnote as `diatheke -o f -f plain` prints it: " [" and "] " around its text, which
# starts with the verse it notes ("1:1", the KJV's "1.4"; one pair of brackets may stand
# inside), or " [] " for an empty one. The character after it decides the space it
# leaves (see drop_footnotes).
_FOOTNOTE = re.compile(r" \[(?:\d+[:.]\d+[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*)?\](?: |$)"
                       r"(?=(?P<next>.?))")
# Marks that close what stands before them: a footnote before one leaves no space.
_CLOSING = frozenset(".,;:?!)]”’")

SPLIT_SEED = 1234
TEST_SIZE = 1000
DEV_SIZE = 1000

DEFAULT_SRC_MODULE = "spaRV1909eb"
DEFAULT_TGT_MODULE = "engKJV2006eb"
DEFAULT_REF2_MODULE = "engWEB2015eb"
PACKAGES = {"spaRV1909eb": "sword-text-sparv", "engKJV2006eb": "sword-text-kjv",
            "engWEB2015eb": "sword-text-web"}
LANGUAGES = {"spaRV1909eb": "es", "engKJV2006eb": "en", "engWEB2015eb": "en"}
_BOOK_INDEX = {book: index for index, book in enumerate(BOOKS)}
GENRES = ("law", "history", "wisdom", "prophets", "gospels", "letters")
# The first book of each genre; a book belongs to the last genre starting at or before it.
_GENRE_STARTS = {"Genesis": "law", "Joshua": "history", "Job": "wisdom", "Isaiah": "prophets",
                 "Matthew": "gospels", "Romans": "letters"}


def book_genres() -> dict[str, str]:
    """{book: genre} for the 66 books, from the first book of each genre."""
    genres, current = {}, None
    for book in BOOKS:
        current = _GENRE_STARTS.get(book, current)
        genres[book] = current
    return genres


BOOK_GENRES = book_genres()
INSTALL_HINT = ("install them with: apt-get install diatheke sword-text-sparv sword-text-kjv "
                "sword-text-web")


class BibleError(TransduceError, RuntimeError):
    """The SWORD tools or modules are missing, or a module's text cannot be parsed."""


@dataclass
class ParsedModule:
    """One module's verses and what was removed on the way, for the report."""

    verses: dict[Key, str]
    headings: int = 0                 # heading lines dropped
    continuation_lines: int = 0       # lines joined onto the verse before them
    outside_canon: int = 0            # verse lines of books outside the 66
    empty: list[Key] = field(default_factory=list)


def drop_footnotes(text: str) -> str:
    """Footnotes removed, each leaving the space that separated the words it stood
    between: "God [1:1 ...] created" -> "God created", "gerahs [3:47 ...] );" ->
    "gerahs);". (The module's own text holds no space there: diatheke adds both.)"""
    def space(note: re.Match) -> str:
        following = note.group("next")
        return "" if not following or following.isspace() or following in _CLOSING else " "

    return _FOOTNOTE.sub(space, text)


def clean_text(text: str) -> str:
    """Footnotes, markup, Strong's tags and pilcrows removed; whitespace collapsed."""
    text = drop_footnotes(text)
    text = _TAG.sub(" ", _STRONGS.sub("", _TITLE.sub(" ", text))).replace("¶", " ")
    return " ".join(text.split())


def parse_plain(output: str) -> ParsedModule:
    """Parse `diatheke -f plain` output into {(book, chapter, verse): text}.

    Lines that are not verse lines belong to the verse above them (continuations),
    except the block since the last blank line before an indented verse line: that is
    the verse's section heading, dropped.
    """
    parsed = ParsedModule(verses={})
    lines = output.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if lines and _TRAILER.match(lines[-1].strip()):
        lines.pop()
    current: Key | None = None
    parts: list[str] = []
    pending: list[str] = []           # non-verse lines since the current verse line
    pending_after_blank: list[str] = []

    def finish() -> None:
        if current is not None:
            text = clean_text(" ".join(parts))
            parsed.verses[current] = text
            if not text:
                parsed.empty.append(current)

    for raw in lines:
        # A heading glued onto a verse line, in OSIS markup: drop it and the markup.
        line, glued_headings = _TITLE.subn("", raw)
        line = _LEADING_MARKUP.sub(r"\1", line)
        parsed.headings += glued_headings
        match = _VERSE.match(line)
        if match is None:
            if not line.strip():
                pending.extend(pending_after_blank)
                pending_after_blank = []
            elif _OTHER_VERSE.match(line):
                # A verse of a book outside the canon: it ends the current verse.
                finish()
                current, parts, pending, pending_after_blank = None, [], [], []
                parsed.outside_canon += 1
            else:
                pending_after_blank.append(line)
            continue
        if match.group("indent"):
            parsed.headings += len(pending_after_blank)
        else:
            pending.extend(pending_after_blank)
        if current is not None:
            parts.extend(pending)
            parsed.continuation_lines += len(pending)
        finish()
        key = (match.group("book"), int(match.group("chapter")), int(match.group("verse")))
        if key in parsed.verses:
            raise BibleError(f"verse {format_key(key)} appears twice in the module's output")
        current, parts = key, [match.group("text")]
        pending, pending_after_blank = [], []
    if current is not None:
        parts.extend(pending + pending_after_blank)
        parsed.continuation_lines += len(pending) + len(pending_after_blank)
    finish()
    return parsed


def format_key(key: Key) -> str:
    book, chapter, verse = key
    return f"{book} {chapter}:{verse}"


def canonical_order(key: Key) -> tuple[int, int, int]:
    """The sort key of a verse in the order of the Bible (Genesis 1:1 first)."""
    book, chapter, verse = key
    return _BOOK_INDEX[book], chapter, verse


def dump_module(module: str) -> str:
    """The whole module as diatheke prints it in plain format, footnotes included (so
    that clean_text knows where they stood: see the module's note)."""
    if shutil.which("diatheke") is None:
        raise BibleError(f"diatheke is not installed; {INSTALL_HINT}")
    result = subprocess.run(["diatheke", "-b", module, "-f", "plain", "-o", "f",
                             "-k", "Gen 1:1-Rev 22:21"],
                            capture_output=True, text=True, encoding="utf-8", errors="strict")
    if result.returncode != 0 or not _VERSE.match(result.stdout.split("\n", 1)[0]):
        package = PACKAGES.get(module, "the SWORD module package")
        raise BibleError(f"diatheke could not read module {module!r} (is {package} installed? "
                         f"{INSTALL_HINT}): {(result.stderr or result.stdout).strip()[:200]}")
    return result.stdout


def split_keys(keys: list[Key]) -> dict[str, list[Key]]:
    """The fixed split: sorted tuples, shuffled with Random(1234), test / dev / train."""
    ordered = sorted(keys)
    random.Random(SPLIT_SEED).shuffle(ordered)
    return {"test": ordered[:TEST_SIZE], "dev": ordered[TEST_SIZE:TEST_SIZE + DEV_SIZE],
            "train": ordered[TEST_SIZE + DEV_SIZE:]}


@dataclass
class BibleCorpus:
    splits: dict[str, list[Key]]
    source: dict[Key, str]
    target: dict[Key, str]
    reference2: dict[Key, str] | None
    report: list[str]
    source_module: str = DEFAULT_SRC_MODULE
    target_module: str = DEFAULT_TGT_MODULE


def align(source: ParsedModule, target: ParsedModule, source_name: str,
          target_name: str) -> tuple[list[Key], list[str]]:
    """Keys with non-empty text on both sides, and what was dropped and why."""
    report = []
    for name, parsed in ((source_name, source), (target_name, target)):
        report.append(f"{name}: {len(parsed.verses)} verses; dropped {parsed.headings} heading "
                      f"lines, joined {parsed.continuation_lines} continuation lines, skipped "
                      f"{parsed.outside_canon} verses outside the 66 books")
    only_source = source.verses.keys() - target.verses.keys()
    only_target = target.verses.keys() - source.verses.keys()
    for name, keys in ((source_name, only_source), (target_name, only_target)):
        if keys:
            report.append(f"dropped {len(keys)} verses only in {name}: "
                          f"{', '.join(format_key(k) for k in sorted(keys)[:5])}"
                          f"{' ...' if len(keys) > 5 else ''}")
    aligned = []
    for name, parsed in ((source_name, source), (target_name, target)):
        if parsed.empty:
            report.append(f"dropped {len(parsed.empty)} verses empty in {name}: "
                          f"{', '.join(format_key(k) for k in parsed.empty[:5])}"
                          f"{' ...' if len(parsed.empty) > 5 else ''}")
    for key in source.verses.keys() & target.verses.keys():
        if source.verses[key] and target.verses[key]:
            aligned.append(key)
    report.append(f"aligned pairs: {len(aligned)}")
    return aligned, report


def build_corpus(src_module: str = DEFAULT_SRC_MODULE, tgt_module: str = DEFAULT_TGT_MODULE,
                 ref2_module: str | None = DEFAULT_REF2_MODULE) -> BibleCorpus:
    modules = [src_module, tgt_module, *([ref2_module] if ref2_module else [])]
    # diatheke reads each module on one core for seconds: the modules at once.
    with ThreadPoolExecutor(max_workers=len(modules)) as pool:
        dumps = list(pool.map(dump_module, modules))   # the first failure, in this order
    source, target = parse_plain(dumps[0]), parse_plain(dumps[1])
    keys, report = align(source, target, src_module, tgt_module)
    reference2 = parse_plain(dumps[2]).verses if ref2_module else None
    return BibleCorpus(split_keys(keys), source.verses, target.verses, reference2, report,
                       src_module, tgt_module)


def write_corpus(corpus: BibleCorpus, out: Path, src_lang: str = "es", tgt_lang: str = "en") -> list[Path]:
    """Write {split}.{src_lang}, {split}.{tgt_lang}, {split}.keys (and {split}.ref2 for dev
    and test when a second reference exists), each file written whole then renamed."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split, keys in corpus.splits.items():
        files = {f"{split}.{src_lang}": [corpus.source[k] for k in keys],
                 f"{split}.{tgt_lang}": [corpus.target[k] for k in keys],
                 f"{split}.keys": [format_key(k) for k in keys]}
        if corpus.reference2 is not None and split != "train":
            files[f"{split}.ref2"] = [corpus.reference2.get(k, "") for k in keys]
        for name, lines in files.items():
            written.append(atomic.write_text(out / name, "".join(line + "\n" for line in lines)))
    return written


@dataclass
class BibleText:
    """One module's verses as a text corpus, in the translation corpus's split."""

    module: str
    splits: dict[str, list[Key]]      # each in canonical order
    verses: dict[Key, str]
    report: list[str]
    split_from: tuple[str, str]       # the translation corpus's (source, target) modules


def text_splits(verses: dict[Key, str], translation_splits: dict[str, list[Key]]
                ) -> tuple[dict[str, list[Key]], list[str]]:
    """test and dev: the translation split's test and dev verses (those with text here);
    train: every other verse with text, the ones the translation corpus could not align
    included. Each in canonical order. -> (splits, report)."""
    report, splits = [], {}
    held_out = set(translation_splits["test"]) | set(translation_splits["dev"])
    for split in ("test", "dev"):
        keys = [key for key in translation_splits[split] if verses.get(key)]
        missing = [key for key in translation_splits[split] if not verses.get(key)]
        if missing:
            report.append(f"{split}: {len(missing)} verses have no text in this module: "
                          f"{', '.join(format_key(k) for k in missing[:5])}"
                          f"{' ...' if len(missing) > 5 else ''}")
        splits[split] = sorted(keys, key=canonical_order)
    splits["train"] = sorted((key for key, text in verses.items()
                              if text and key not in held_out), key=canonical_order)
    empty = sum(1 for key, text in verses.items() if not text and key not in held_out)
    if empty:
        report.append(f"train: skipped {empty} empty verses")
    return splits, report


def text_corpus(translation: BibleCorpus, module: str) -> BibleText:
    """The text corpus of `module` in the split of the translation corpus: its verses
    are taken from the translation corpus when it is one of its two modules, else read."""
    report = [f"split: the test and dev verses of the {translation.source_module} -> "
              f"{translation.target_module} corpus"]
    if module == translation.source_module:
        verses = translation.source
    elif module == translation.target_module:
        verses = translation.target
    else:
        parsed = parse_plain(dump_module(module))
        verses = parsed.verses
        report.append(f"{module}: {len(verses)} verses; dropped {parsed.headings} heading lines, "
                      f"joined {parsed.continuation_lines} continuation lines")
    splits, split_report = text_splits(verses, translation.splits)
    return BibleText(module, splits, verses, report + split_report,
                     (translation.source_module, translation.target_module))


def build_text_corpus(module: str = DEFAULT_TGT_MODULE, src_module: str = DEFAULT_SRC_MODULE,
                      tgt_module: str = DEFAULT_TGT_MODULE) -> BibleText:
    """One module's text in the fixed split, which the (src_module, tgt_module)
    translation corpus defines: both are read and aligned to find it."""
    return text_corpus(build_corpus(src_module, tgt_module, ref2_module=None), module)


def write_text_corpus(corpus: BibleText, out: Path) -> list[Path]:
    """Write {split}.txt (one verse a line) and {split}.keys, each written whole then
    renamed; the caller writes corpus.json."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split, keys in corpus.splits.items():
        for name, lines in ((f"{split}.txt", [corpus.verses[k] for k in keys]),
                            (f"{split}.keys", [format_key(k) for k in keys])):
            written.append(atomic.write_text(out / name, "".join(line + "\n" for line in lines)))
    return written


PARAPHRASE_LABELS = ("different", "same")


def paraphrase_pairs(first: BibleText, second: BibleText, seed: int = 0
                     ) -> dict[str, list[tuple[str, Key, Key]]]:
    """Per split, one (label, key in `first`, key in `second`) for each verse with text
    in both, in canonical order: the same key ("same") or the next such verse of the
    split, the last wrapping to the first ("different"), chosen by random.Random(seed)
    over the split's verses."""
    pairs = {}
    for split, keys in first.splits.items():
        both = [key for key in keys if second.verses.get(key)]
        rng = random.Random(f"{seed}-{split}")
        pairs[split] = [("same", key, key) if rng.random() < 0.5 else
                        ("different", key, both[(index + 1) % len(both)])
                        for index, key in enumerate(both)]
    return pairs


def write_paraphrase_corpus(first: BibleText, second: BibleText,
                            pairs: dict[str, list[tuple[str, Key, Key]]], out: Path
                            ) -> list[Path]:
    """Write paraphrase_pairs' `pairs` as {split}.tsv (`label<TAB>first's verse<TAB>
    second's verse`), {split}.keys (`key<TAB>key`) and labels.txt (PARAPHRASE_LABELS),
    each written whole then renamed; the caller writes corpus.json."""
    from transduce.data.labelled import LABELS_FILE, write_labelled

    out.mkdir(parents=True, exist_ok=True)
    written = [atomic.write_text(out / LABELS_FILE,
                                 "".join(name + "\n" for name in PARAPHRASE_LABELS))]
    for split, triples in pairs.items():
        written.append(write_labelled(out / f"{split}.tsv", [label for label, _, _ in triples],
                                      [first.verses[a] for _, a, _ in triples],
                                      [second.verses[b] for _, _, b in triples]))
        written.append(atomic.write_text(out / f"{split}.keys", "".join(
            f"{format_key(a)}\t{format_key(b)}\n" for _, a, b in triples)))
    return written


def write_genre_corpus(corpus: BibleText, out: Path) -> list[Path]:
    """Write {split}.tsv (`genre<TAB>verse`, one verse a line in canonical order),
    {split}.keys and labels.txt (GENRES), each written whole then renamed; the caller
    writes corpus.json. The verses and split are the text corpus's (write_text_corpus)."""
    from transduce.data.labelled import LABELS_FILE, write_labelled

    out.mkdir(parents=True, exist_ok=True)
    written = [atomic.write_text(out / LABELS_FILE, "".join(g + "\n" for g in GENRES))]
    for split, keys in corpus.splits.items():
        written.append(write_labelled(out / f"{split}.tsv", [BOOK_GENRES[k[0]] for k in keys],
                                      [corpus.verses[k] for k in keys]))
        written.append(atomic.write_text(out / f"{split}.keys",
                                         "".join(format_key(k) + "\n" for k in keys)))
    return written
