"""Parsing diatheke's plain output, alignment, and the fixed split."""

import functools
import json
import re
import shutil
import subprocess
import threading

import pytest

from transduce.data import bible

# Written after real diatheke output: a heading before each indented verse and repeated
# before later ones, a pilcrow, Strong's tags, OSIS markup glued onto a verse line, a
# verse over three lines, a book outside the canon, an empty verse, and the trailer.
SAMPLE_ENGLISH = """\
Psalms 2:12: Kiss the Son, lest he be angry.   

A Psalm of David, when he fled from Absalom his son.
   Psalms 3:1: LORD, how are they increased that trouble me! 

A Psalm of David, when he fled from Absalom his son.
   Psalms 3:2: Many there be which say of my soul,
“There is no help for him in God.”
Selah.

A Psalm of David, when he fled from Absalom his son.
   Psalms 3:3: ¶ But thou, O LORD, art a shield for me.
Malachi 4:6: And he shall turn the heart.
Tobit 1:1: The book of the words of Tobit.
<title canonical="true" type="psalm">A praise psalm by David.</title> <lg sID="g1"/>Matthew 1:1: The book of the generation of Jesus Christ.
Matthew 1:2: 
(engKJV2006eb)
"""

SAMPLE_SPANISH = """\
Psalms 2:12: Besad al Hijo, porque no se enoje <H599>, y perezcáis en el camino.
Psalms 3:1: ¡OH Jehová <H3068>, cuánto se han multiplicado mis enemigos!
Psalms 3:2: Muchos dicen de mi vida: No hay para él salud en Dios. (Selah.)
Psalms 3:3: Mas tú, Jehová, eres escudo alrededor de mí.
Malachi 4:6: El convertirá el corazón de los padres.
Matthew 1:1: Libro de la generación de Jesucristo.
Matthew 1:2: Abraham engendró á Isaac.
(spaRV1909eb)
"""


def test_parse_handles_headings_continuations_markup_and_trailer():
    parsed = bible.parse_plain(SAMPLE_ENGLISH)
    verses = parsed.verses
    assert verses[("Psalms", 2, 12)] == "Kiss the Son, lest he be angry."
    assert verses[("Psalms", 3, 1)] == "LORD, how are they increased that trouble me!"
    assert verses[("Psalms", 3, 2)] == \
        "Many there be which say of my soul, “There is no help for him in God.” Selah."
    assert verses[("Psalms", 3, 3)] == "But thou, O LORD, art a shield for me."
    assert verses[("Matthew", 1, 1)] == "The book of the generation of Jesus Christ."
    assert ("Tobit", 1, 1) not in verses and parsed.outside_canon == 1
    assert verses[("Matthew", 1, 2)] == "" and parsed.empty == [("Matthew", 1, 2)]
    assert parsed.headings == 4 and parsed.continuation_lines == 2  # 3 lines + 1 glued title
    assert not any("engKJV" in text or "Psalm of David" in text for text in verses.values())


def test_strongs_tags_go_with_their_space():
    verses = bible.parse_plain(SAMPLE_SPANISH).verses
    assert verses[("Psalms", 2, 12)] == "Besad al Hijo, porque no se enoje, y perezcáis en el camino."
    assert verses[("Psalms", 3, 1)] == "¡OH Jehová, cuánto se han multiplicado mis enemigos!"


# Written after `diatheke -o f -f plain` output of the WEB and the KJV: footnotes between
# words (where the module holds no space), after a comma, before a closing parenthesis,
# several at a verse's end, one with bracketed text inside, an empty one in a heading,
# and brackets of the text itself (the KJV's " [but").
SAMPLE_FOOTNOTES = """\
Genesis 1:1: In the beginning, God [1:1 The Hebrew word rendered “God” is “אֱלֹהִ֑ים” (Elohim).] created the heavens and the earth.
Genesis 1:20: And God said, Let the waters bring forth abundantly the moving creature that hath life, and fowl that may fly above the earth in the open firmament of heaven. [1.20 moving: or, creeping]  [1.20 life: Heb. soul]  
Genesis 1:29: God said, “Behold, [1:29 “Behold”, from “הִנֵּה”, means look at.]  I have given you every herb yielding seed.
Genesis 4:1: The man knew [4:1 or, lay with, or, had relations with] Eve his wife. She conceived, [4:1 “Cain” sounds like “gotten”.] and gave birth to Cain.
Exodus 30:13: half a shekel according to the shekel [30:13 A shekel is about 10 grams.]  of the sanctuary (the shekel is twenty gerahs [30:13 a gerah is about 0.5 grams] ); half a shekel.
Psalms 9:7: But Yahweh reigns forever. [9:7 The passage from verse [36] to verse [105], formerly missing.] 

This Psalm is a genuine one of David, though extra, []  composed when he fought.
  Psalms 9:8: He will judge the world [but see 9:8] in righteousness. [9:8 or, justice]
(engWEB2015eb)
"""


def test_footnotes_go_and_leave_the_space_between_the_words_they_stood_between():
    verses = bible.parse_plain(SAMPLE_FOOTNOTES).verses
    assert verses[("Genesis", 1, 1)] == "In the beginning, God created the heavens and the earth."
    assert verses[("Genesis", 1, 20)].endswith("the open firmament of heaven.")
    assert verses[("Genesis", 1, 29)] == "God said, “Behold, I have given you every herb yielding seed."
    assert verses[("Genesis", 4, 1)] == \
        "The man knew Eve his wife. She conceived, and gave birth to Cain."
    assert verses[("Exodus", 30, 13)] == "half a shekel according to the shekel of the sanctuary " \
        "(the shekel is twenty gerahs); half a shekel."
    assert verses[("Psalms", 9, 7)] == "But Yahweh reigns forever."
    assert verses[("Psalms", 9, 8)] == "He will judge the world [but see 9:8] in righteousness."


def test_a_repeated_verse_is_an_error():
    with pytest.raises(bible.BibleError, match="Genesis 1:1 appears twice"):
        bible.parse_plain("Genesis 1:1: a\nGenesis 1:1: b\n")


def test_align_keeps_pairs_with_text_on_both_sides_and_reports_the_rest():
    english = bible.parse_plain(SAMPLE_ENGLISH)
    spanish = bible.parse_plain(SAMPLE_SPANISH)
    keys, report = bible.align(spanish, english, "spa", "eng")
    assert sorted(keys) == sorted([("Psalms", 2, 12), ("Psalms", 3, 1), ("Psalms", 3, 2),
                                   ("Psalms", 3, 3), ("Malachi", 4, 6), ("Matthew", 1, 1)])
    assert any("empty in eng: Matthew 1:2" in line for line in report)
    assert report[-1] == "aligned pairs: 6"


def test_split_rule_on_synthetic_keys():
    keys = [(book, chapter, verse) for book in ("B", "A", "C") for chapter in (1, 2, 10)
            for verse in range(1, 401)]
    splits = bible.split_keys(list(reversed(keys)))
    expected = sorted(keys)
    import random
    random.Random(1234).shuffle(expected)
    assert splits["test"] == expected[:1000]
    assert splits["dev"] == expected[1000:2000]
    assert splits["train"] == expected[2000:]
    # integer order, not string order: chapter 2 sorts before chapter 10
    assert sorted(keys)[400] == ("A", 2, 1)


def test_the_modules_are_read_at_once_and_a_failure_among_them_is_the_error(monkeypatch):
    texts = {"src": SAMPLE_SPANISH, "tgt": SAMPLE_ENGLISH, "ref2": SAMPLE_ENGLISH}
    reading = []
    together = [threading.Barrier(3, timeout=10)]   # broken unless all three wait at once

    def dump(module):
        reading.append(module)
        if together:
            together[0].wait()
        if module not in texts:
            raise bible.BibleError(f"diatheke could not read module {module!r}")
        return texts[module]

    monkeypatch.setattr(bible, "dump_module", dump)
    corpus = bible.build_corpus("src", "tgt", "ref2")
    assert sorted(reading) == ["ref2", "src", "tgt"] and corpus.reference2 == corpus.target
    together.clear()
    for missing in ("src", "tgt", "ref2"):
        with pytest.raises(bible.BibleError, match=f"could not read module 'no {missing}'"):
            bible.build_corpus(*[f"no {m}" if m == missing else m for m in texts])


def test_missing_diatheke_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(bible.BibleError, match="apt-get install diatheke"):
        bible.dump_module("engKJV2006eb")


HAVE_SWORD = shutil.which("diatheke") is not None and subprocess.run(
    ["diatheke", "-b", "spaRV1909eb", "-f", "plain", "-k", "Gen 1:1"],
    capture_output=True, text=True).stdout.startswith("Genesis 1:1")


@pytest.fixture(scope="module")
def modules_read_once():
    """diatheke takes about 6 s to print a whole module: this file's tests read each
    module once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bible, "dump_module", functools.cache(bible.dump_module))
        yield


@pytest.mark.skipif(not HAVE_SWORD, reason="diatheke and the SWORD modules are not installed "
                    "(apt-get install diatheke sword-text-sparv sword-text-kjv sword-text-web)")
def test_real_extraction_counts_and_split(modules_read_once, tmp_path):
    corpus = bible.build_corpus()
    sizes = {split: len(keys) for split, keys in corpus.splits.items()}
    assert sizes == {"test": 1000, "dev": 1000, "train": 29084}
    assert len(corpus.source) == len(corpus.target) == 31102
    assert sum(1 for text in corpus.source.values() if not text) == 18
    assert corpus.splits["test"][:3] == [("Ecclesiastes", 6, 8), ("II Kings", 14, 18),
                                         ("Daniel", 2, 18)]
    bible.write_corpus(corpus, tmp_path)
    test_keys = (tmp_path / "test.keys").read_text(encoding="utf-8").splitlines()
    assert test_keys[:3] == ["Ecclesiastes 6:8", "II Kings 14:18", "Daniel 2:18"]
    for split, size in sizes.items():
        for suffix in ("es", "en"):
            lines = (tmp_path / f"{split}.{suffix}").read_text(encoding="utf-8").splitlines()
            assert len(lines) == size and all(line.strip() == line and line for line in lines)
            assert not any("¶" in line or "<" in line for line in lines)
    assert len((tmp_path / "test.ref2").read_text(encoding="utf-8").splitlines()) == 1000
    # The WEB's footnotes stood between words; the KJV's only at the ends of verses.
    assert corpus.reference2[("Genesis", 1, 1)] == \
        "In the beginning, God created the heavens and the earth."
    assert corpus.reference2[("Genesis", 2, 4)].endswith(
        "in the day that Yahweh God made the earth and the heavens.")
    assert corpus.target[("Genesis", 1, 20)].endswith("in the open firmament of heaven.")
    for verses in (corpus.source, corpus.target, corpus.reference2):
        assert not any(re.search(r"\[\d+[:.]\d+", text) for text in verses.values())


def test_text_splits_keep_the_translation_split_in_canonical_order():
    keys = [(book, chapter, verse) for book in ("Genesis", "Exodus", "Revelation of John")
            for chapter in (1, 2, 10) for verse in range(1, 301)]
    verses = {key: f"text of {bible.format_key(key)}" for key in keys}
    verses[("Exodus", 2, 5)] = ""                      # empty in this module
    translation = bible.split_keys([k for k in keys if k != ("Exodus", 2, 5)])
    splits, report = bible.text_splits(verses, translation)
    assert set(splits["test"]) == set(translation["test"])
    assert set(splits["dev"]) == set(translation["dev"])
    assert set(splits["train"]) == set(keys) - set(translation["test"]) \
        - set(translation["dev"]) - {("Exodus", 2, 5)}
    for split_keys in splits.values():   # Bible order, not tuple order ("Exodus" < "Genesis")
        assert split_keys == sorted(split_keys, key=bible.canonical_order)
    assert splits["train"][0][0] == "Genesis" and splits["train"][-1][0] == "Revelation of John"
    assert report == ["train: skipped 1 empty verses"]
    del verses[translation["test"][0]]                 # a held-out verse this module lacks
    splits, report = bible.text_splits(verses, translation)
    assert len(splits["test"]) == 999 and translation["test"][0] not in splits["train"]
    assert report[0].startswith(f"test: 1 verses have no text in this module: "
                                f"{bible.format_key(translation['test'][0])}")


@pytest.fixture(scope="module")
def translation_corpus(modules_read_once):
    return bible.build_corpus(ref2_module=None)


@pytest.mark.skipif(not HAVE_SWORD, reason="diatheke and the SWORD modules are not installed "
                    "(apt-get install diatheke sword-text-sparv sword-text-kjv sword-text-web)")
@pytest.mark.parametrize("module,language,train_size", [
    ("engKJV2006eb", "en", 29102),    # the 18 verses empty in Spanish are English training text
    ("spaRV1909eb", "es", 29084),
])
def test_real_text_corpus_keeps_the_translation_split(translation_corpus, tmp_path, monkeypatch,
                                                      capsys, module, language, train_size):
    from transduce.cli import main

    # The command builds the translation corpus for its split: reuse the one built here.
    monkeypatch.setattr(bible, "build_corpus", lambda *args, **kwargs: translation_corpus)
    assert main(["data", "bible-text", "--out", str(tmp_path), "--module", module]) == 0
    assert f"verses: test 1000, dev 1000, train {train_size}" in capsys.readouterr().out
    metadata = json.loads((tmp_path / "corpus.json").read_text(encoding="utf-8"))
    assert metadata["kind"] == "text" and metadata["language"] == language
    assert metadata["module"] == module
    keys, lines = {}, {}
    for split in ("train", "dev", "test"):
        lines[split] = (tmp_path / f"{split}.txt").read_text(encoding="utf-8").splitlines()
        keys[split] = (tmp_path / f"{split}.keys").read_text(encoding="utf-8").splitlines()
        assert len(lines[split]) == len(keys[split])
        assert all(line.strip() == line and line for line in lines[split])
        assert not any("¶" in line or "<" in line for line in lines[split])
    for split in ("test", "dev"):   # the very verses the translation corpus holds out
        assert set(keys[split]) == {bible.format_key(k) for k in translation_corpus.splits[split]}
    assert not set(keys["train"]) & (set(keys["test"]) | set(keys["dev"]))
    assert keys["train"][:3] == ["Genesis 1:1", "Genesis 1:2", "Genesis 1:3"]
    assert keys["train"][-1] == "Revelation of John 22:21"
    texts = translation_corpus.target if language == "en" else translation_corpus.source
    by_name = {bible.format_key(key): text for key, text in texts.items()}
    for split in ("train", "dev", "test"):   # each line is its key's verse
        assert lines[split] == [by_name[name] for name in keys[split]]
    assert "Ecclesiastes 6:8" in keys["test"] and "Ecclesiastes 6:8" not in keys["train"]


def test_the_genre_mapping_covers_the_66_books_in_canonical_sections():
    genres = bible.BOOK_GENRES
    assert set(genres) == set(bible.BOOKS) and len(genres) == 66
    assert set(genres.values()) == set(bible.GENRES)
    sections = {genre: [book for book in bible.BOOKS if genres[book] == genre]
                for genre in bible.GENRES}
    assert [(books[0], books[-1]) for books in sections.values()] == [
        ("Genesis", "Deuteronomy"), ("Joshua", "Esther"), ("Job", "Song of Solomon"),
        ("Isaiah", "Malachi"), ("Matthew", "Acts"), ("Romans", "Revelation of John")]
    assert [len(books) for books in sections.values()] == [5, 12, 5, 17, 5, 22]


def test_genre_corpus_files_from_a_text_corpus(tmp_path):
    from transduce.data.labelled import class_names, read_labelled
    keys = [("Genesis", 1, 1), ("Psalms", 23, 1), ("Acts", 2, 1), ("Jude", 1, 3)]
    verses = {key: f"text of {bible.format_key(key)}" for key in keys}
    corpus = bible.BibleText("engKJV2006eb", {"train": keys[:2], "dev": keys[2:3],
                                              "test": keys[3:]}, verses, [], ("a", "b"))
    bible.write_genre_corpus(corpus, tmp_path)
    train = read_labelled(tmp_path / "train.tsv")
    assert train.labels == ["law", "wisdom"] and train.texts[1] == "text of Psalms 23:1"
    assert read_labelled(tmp_path / "test.tsv").labels == ["letters"]
    assert class_names(tmp_path) == list(bible.GENRES)
    assert (tmp_path / "dev.keys").read_text(encoding="utf-8") == "Acts 2:1\n"


def test_paraphrase_pairs_a_verse_with_itself_or_the_next_in_the_other_module(tmp_path):
    from transduce.data.labelled import class_names, read_labelled
    keys = [("Genesis", 1, v) for v in range(1, 41)] + [("Jude", 1, 3), ("Jude", 1, 4)]
    first = bible.BibleText("a", {"train": keys[:40], "dev": keys[40:], "test": []},
                            {key: f"first {bible.format_key(key)}" for key in keys}, [],
                            ("a", "b"))
    verses = {key: f"second {bible.format_key(key)}" for key in keys}
    verses[keys[5]] = ""                                  # no text in the second module
    second = bible.BibleText("b", first.splits, verses, [], ("a", "b"))
    pairs = bible.paraphrase_pairs(first, second)
    assert pairs == bible.paraphrase_pairs(first, second)          # seeded
    train = pairs["train"]
    assert [a for _, a, _ in train] == keys[:5] + keys[6:40]
    labels = [label for label, _, _ in train]
    assert 10 < labels.count("same") < 30
    both = keys[:5] + keys[6:40]
    for label, a, b in train:
        assert b == (a if label == "same" else both[(both.index(a) + 1) % len(both)])
    bible.write_paraphrase_corpus(first, second, pairs, tmp_path)
    written = read_labelled(tmp_path / "train.tsv")
    assert written.labels == labels and class_names(tmp_path) == ["different", "same"]
    assert written.texts[0] == "first Genesis 1:1"
    assert written.seconds[0] == f"second Genesis 1:{1 if labels[0] == 'same' else 2}"
    dev = (tmp_path / "dev.keys").read_text(encoding="utf-8").splitlines()
    assert dev[0].split("\t")[0] == "Jude 1:3" and len(dev) == 2


@pytest.mark.skipif(not HAVE_SWORD, reason="diatheke and the SWORD modules are not installed "
                    "(apt-get install diatheke sword-text-sparv sword-text-kjv sword-text-web)")
def test_real_genre_corpus_keeps_the_translation_split(translation_corpus, tmp_path,
                                                        monkeypatch, capsys):
    from collections import Counter

    from transduce.cli import main
    from transduce.data.corpus import corpus_kind
    from transduce.data.labelled import read_labelled

    monkeypatch.setattr(bible, "build_corpus", lambda *args, **kwargs: translation_corpus)
    assert main(["data", "bible-genre", "--out", str(tmp_path)]) == 0
    assert "verses: test 1000, dev 1000, train 29102" in capsys.readouterr().out
    metadata = json.loads((tmp_path / "corpus.json").read_text(encoding="utf-8"))
    assert metadata["kind"] == "classification" and corpus_kind(tmp_path) == "classification"
    for split in ("test", "dev"):
        keys = (tmp_path / f"{split}.keys").read_text(encoding="utf-8").splitlines()
        assert set(keys) == {bible.format_key(k) for k in translation_corpus.splits[split]}
    train = read_labelled(tmp_path / "train.tsv")
    keys = (tmp_path / "train.keys").read_text(encoding="utf-8").splitlines()
    assert len(keys) == len(train) == 29102
    books = {bible.format_key(k): k[0] for k in translation_corpus.target}
    assert train.labels == [bible.BOOK_GENRES[books[name]] for name in keys]
    assert set(Counter(train.labels)) == set(bible.GENRES)


@pytest.mark.parametrize("command", [["bible"], ["bible-text", "--module", "KJV"],
                                     ["bible-genre", "--module", "KJV"],
                                     ["bible-paraphrase"]])
def test_an_out_that_is_a_file_is_refused_before_extracting(command, tmp_path, monkeypatch,
                                                            capsys):
    from transduce.cli import main

    def never(*args):
        raise AssertionError("extracted before checking --out")
    monkeypatch.setattr(bible, "build_corpus", never)
    monkeypatch.setattr(bible, "build_text_corpus", never)
    (tmp_path / "file").write_text("kept\n")
    assert main(["data", *command, "--out", str(tmp_path / "file")]) == 2
    assert "--out " + str(tmp_path / "file") + ": exists and is not a directory" in \
        capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "kept\n"
