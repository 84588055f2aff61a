"""`transduce data import`: inputs, every cleaning rule with its count, the hash split's
stability under reordering and appending, and errors that name file and line."""

import gzip
import json
import lzma
import random

import pytest

from transduce.cli import main
from transduce.data.corpus import CorpusError, read_split
from transduce.data.importer import CleaningRules, import_corpus, pair_hash, split_of


def pairs(n, seed=0):
    rng = random.Random(seed)
    words = ["casa", "perro", "gato", "rojo", "grande", "el", "come", "uno", "dos"]
    out = []
    for i in range(n):
        sentence = [rng.choice(words) for _ in range(rng.randint(2, 7))] + [str(i)]
        out.append((" ".join(sentence), " ".join(w.upper() for w in sentence)))
    return out


def write_pair_files(directory, rows, name="corpus", compress=None):
    opener = {None: open, "gz": gzip.open, "xz": lzma.open}[compress]
    suffix = f".{compress}" if compress else ""
    paths = directory / f"{name}.es{suffix}", directory / f"{name}.en{suffix}"
    for path, side in zip(paths, (0, 1)):
        with opener(path, "wb") as handle:
            handle.write(b"".join((row[side] if isinstance(row[side], bytes)
                                   else row[side].encode("utf-8")) + b"\n" for row in rows))
    return paths


def split_sets(directory):
    found = {}
    for split in ("train", "dev", "test"):
        if (directory / f"{split}.es").exists():
            corpus = read_split(directory, split)
            found[split] = set(zip(corpus.source, corpus.target))
        else:
            found[split] = set()
    return found


def test_every_cleaning_rule_is_counted_with_its_first_place(tmp_path):
    rows = pairs(40) + [
        ("", "empty source"),                           # 41 empty
        ("hola", "   "),                                # 42 empty (whitespace only)
        ("uno dos", "one two"),                         # 43
        ("uno dos", "one two"),                         # 44 duplicate of 43
        ("  uno dos ", "one two"),                      # 45 duplicate after stripping
        ("x " * 30, "y"),                               # 46 ratio 30 > 9 (and fewer than 50 words)
        ("w " * 60, "v " * 60),                         # 47 longer than 50 words
        (b"bad \xff byte", b"fine"),                    # 48 invalid UTF-8 on the source
        ("bell\x07 ring", "ring\x1b[0m bell"),          # 49 control characters: cleaned, kept
    ]
    src, tgt = write_pair_files(tmp_path, rows)
    result = import_corpus(tmp_path / "out", "es", "en", src=src, tgt=tgt,
                           rules=CleaningRules(max_words=50))
    summary = json.loads((tmp_path / "out" / "corpus.json").read_text())["import"]["cleaning"]
    assert summary == {"read": 49, "kept": 42, "utf8": 1, "control": 1, "empty": 2, "long": 1,
                       "ratio": 1, "duplicate": 2, "overlap": 0}
    text = "\n".join(result.report)
    assert "invalid UTF-8: 1 dropped" in text and f"{src}:48" in text
    assert f"an empty side: 2 dropped (4.08%) (first: {src}:41, {src}:42)" in text
    assert "exact duplicate of an earlier pair: 2 dropped" in text and f"{src}:44, {src}:45" in text
    assert "length ratio over 9: 1 dropped" in text and f"{src}:46" in text
    assert "more than 50 words on a side: 1 dropped" in text and f"{src}:47" in text
    assert "control characters removed: 1 cleaned" in text and f"{src}:49" in text
    train = read_split(tmp_path / "out", "train")
    assert len(train) == 42 and result.sizes == {"train": 42, "dev": 0, "test": 0}
    assert ("bell ring", "ring[0m bell") in set(zip(train.source, train.target))
    assert train.source.count("uno dos") == 1


def test_limits_can_be_turned_off(tmp_path):
    rows = pairs(5) + [("x " * 30, "y"), ("a", "b"), ("a", "b")]
    src, tgt = write_pair_files(tmp_path, rows)
    result = import_corpus(tmp_path / "out", "es", "en", src=src, tgt=tgt,
                           rules=CleaningRules(max_words=0, max_ratio=0, dedupe=False))
    assert result.sizes["train"] == 8


def test_strict_makes_invalid_utf8_an_error_naming_file_line_and_byte(tmp_path):
    src, tgt = write_pair_files(tmp_path, [("ok", "ok"), ("fine", b"caf\xc3 au lait")])
    with pytest.raises(CorpusError, match=rf"{tgt}:2: invalid UTF-8 at byte 4"):
        import_corpus(tmp_path / "out", "es", "en", src=src, tgt=tgt,
                      rules=CleaningRules(strict=True))
    assert not (tmp_path / "out").exists()


def test_files_of_different_lengths_name_the_longer_file_and_the_line(tmp_path):
    src, _ = write_pair_files(tmp_path, pairs(5))
    _, tgt = write_pair_files(tmp_path, pairs(4), name="short")
    with pytest.raises(CorpusError, match=rf"{src}:5: {tgt} ends after line 4 but"):
        import_corpus(tmp_path / "out", "es", "en", src=src, tgt=tgt)
    with pytest.raises(CorpusError, match=rf"{src}:5: {tgt} ends after line 4 but"):
        import_corpus(tmp_path / "out", "es", "en", src=tgt, tgt=src)   # the longer as target


def test_a_tsv_line_without_two_columns_names_file_and_line(tmp_path):
    tsv = tmp_path / "c.tsv"
    tsv.write_text("a\tb\nc\td\te\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=rf"{tsv}:2: expected 2 tab-separated columns .* found 3"):
        import_corpus(tmp_path / "out", "es", "en", tsv=tsv)


@pytest.mark.parametrize("compress", [None, "gz", "xz", "zst"])
def test_compressed_inputs_and_tsv_give_the_same_corpus(tmp_path, compress):
    rows = pairs(120)
    if compress == "zst":
        import zstandard
        plain = write_pair_files(tmp_path, rows)
        src, tgt = (p.with_name(p.name + ".zst") for p in plain)
        for raw, packed in zip(plain, (src, tgt)):
            packed.write_bytes(zstandard.ZstdCompressor().compress(raw.read_bytes()))
    else:
        src, tgt = write_pair_files(tmp_path, rows, compress=compress)
    import_corpus(tmp_path / "files", "es", "en", src=src, tgt=tgt, dev=10, test=10)
    tsv = tmp_path / "c.tsv.gz"
    with gzip.open(tsv, "wt", encoding="utf-8") as handle:
        handle.writelines(f"{s}\t{t}\r\n" for s, t in rows)      # CRLF line ends too
    import_corpus(tmp_path / "tsv", "es", "en", tsv=tsv, dev=10, test=10)
    files, tabbed = split_sets(tmp_path / "files"), split_sets(tmp_path / "tsv")
    assert files == tabbed
    assert {k: len(v) for k, v in files.items()} == {"train": 100, "dev": 10, "test": 10}


def test_a_file_whose_suffix_lies_or_that_is_truncated_is_named(tmp_path):
    fake = tmp_path / "c.es.gz"
    fake.write_text("plain text\n")
    plain = tmp_path / "c.en"
    plain.write_text("plain text\n")
    with pytest.raises(CorpusError, match=rf"{fake}: not a gz file"):
        import_corpus(tmp_path / "out", "es", "en", src=fake, tgt=plain)
    src, tgt = write_pair_files(tmp_path, pairs(3000), compress="xz")
    src.write_bytes(src.read_bytes()[:len(src.read_bytes()) // 2])
    with pytest.raises(CorpusError, match=rf"{src}:\d+: cannot read past line \d+"):
        import_corpus(tmp_path / "out", "es", "en", src=src, tgt=tgt)


def test_the_split_is_stable_under_reordering_and_appending(tmp_path):
    rows = pairs(600, seed=1)
    src, tgt = write_pair_files(tmp_path, rows, name="first")
    out = tmp_path / "corpus"
    import_corpus(out, "es", "en", src=src, tgt=tgt, dev=30, test=20)
    first = split_sets(out)
    assert {k: len(v) for k, v in first.items()} == {"train": 550, "dev": 30, "test": 20}

    shuffled = rows[:]
    random.Random(5).shuffle(shuffled)
    src2, tgt2 = write_pair_files(tmp_path, shuffled, name="shuffled")
    import_corpus(tmp_path / "other", "es", "en", src=src2, tgt=tgt2, dev=30, test=20)
    assert split_sets(tmp_path / "other") == first

    grown = shuffled + pairs(900, seed=2)[600:]           # 300 new pairs, appended
    src3, tgt3 = write_pair_files(tmp_path, grown, name="grown")
    result = import_corpus(out, "es", "en", src=src3, tgt=tgt3, dev=30, test=20)
    assert any("no pair moves between splits" in line for line in result.report)
    second = split_sets(out)
    for split in first:
        assert first[split] <= second[split], f"a {split} pair moved to another split"
    assert sum(len(v) for v in second.values()) == 900
    assert len(second["dev"]) > 30 and len(second["test"]) > 20   # grown in proportion
    # and each pair sits where its hash says
    values = json.loads((out / "corpus.json").read_text())["import"]["split"]
    for split, members in second.items():
        for pair in members:
            assert split_of(pair_hash(*pair), values["dev_below"], values["test_below"]) == split


def test_given_dev_and_test_files_are_kept_whole_and_removed_from_training(tmp_path):
    rows = pairs(50)
    src, tgt = write_pair_files(tmp_path, rows)
    dev = write_pair_files(tmp_path, rows[:3] + [("x " * 40, "y")], name="dev")   # not filtered
    test = write_pair_files(tmp_path, rows[3:5], name="test")
    result = import_corpus(tmp_path / "out", "es", "en", src=src, tgt=tgt, dev_files=dev,
                           test_files=test)
    assert result.sizes == {"train": 45, "dev": 4, "test": 2}
    assert any("also a dev or test pair: 5 dropped" in line for line in result.report)


def test_an_unrelated_out_directory_is_refused_and_a_failed_import_leaves_out_as_it_was(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    src, tgt = write_pair_files(tmp_path, pairs(10))
    with pytest.raises(CorpusError, match="not a corpus made by `transduce data import`"):
        import_corpus(out, "es", "en", src=src, tgt=tgt)
    assert (out / "notes.txt").read_text() == "keep me"
    import_corpus(tmp_path / "good", "es", "en", src=src, tgt=tgt)
    before = sorted(p.name for p in (tmp_path / "good").iterdir())
    bad_src, bad_tgt = write_pair_files(tmp_path, [("a", "b"), ("c", b"\xff")], name="bad")
    with pytest.raises(CorpusError):
        import_corpus(tmp_path / "good", "es", "en", src=bad_src, tgt=bad_tgt,
                      rules=CleaningRules(strict=True))
    assert sorted(p.name for p in (tmp_path / "good").iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_the_command_line_prints_the_report_and_refuses_bad_combinations(tmp_path, capsys):
    src, tgt = write_pair_files(tmp_path, pairs(30) + [("", "x")])
    out = tmp_path / "out"
    assert main(["data", "import", "--src", str(src), "--tgt", str(tgt), "--source-language",
                 "es", "--target-language", "en", "--out", str(out), "--dev", "3",
                 "--test", "3"]) == 0
    printed = capsys.readouterr().out
    assert "read 31 pairs, kept 30" in printed and "an empty side: 1 dropped" in printed
    assert "split: train 24, dev 3, test 3" in printed
    assert main(["data", "import", "--src", str(src), "--tsv", str(src), "--source-language",
                 "es", "--target-language", "en", "--out", str(out)]) == 2
    assert main(["data", "import", "--src", str(src), "--tgt", str(tgt), "--source-language",
                 "es", "--target-language", "en", "--out", str(out), "--dev", "3",
                 "--dev-src", str(src), "--dev-tgt", str(tgt)]) == 2
    assert "either as --dev/--test N" in capsys.readouterr().err


def test_progress_bars_show_lines_per_second(tmp_path, capsys):
    src, tgt = write_pair_files(tmp_path, pairs(50))
    import_corpus(tmp_path / "out", "es", "en", src=src, tgt=tgt, progress=True)
    shown = capsys.readouterr().err
    assert "cleaning" in shown and "lines/s" in shown and "50" in shown


def test_reimporting_with_a_given_test_set_keeps_the_hash_held_dev(tmp_path):
    rows = pairs(300, seed=3)
    src, tgt = write_pair_files(tmp_path, rows)
    test = write_pair_files(tmp_path, pairs(20, seed=9), name="given-test")
    out = tmp_path / "out"
    import_corpus(out, "es", "en", src=src, tgt=tgt, dev=15, test_files=test)
    first = split_sets(out)
    grown, grown_tgt = write_pair_files(tmp_path, rows + pairs(400, seed=3)[300:], name="grown")
    result = import_corpus(out, "es", "en", src=grown, tgt=grown_tgt, dev=15, test_files=test)
    assert any("no pair moves" in line for line in result.report)
    second = split_sets(out)
    assert first["dev"] <= second["dev"] and first["train"] <= second["train"]
    assert second["test"] == first["test"]
    result = import_corpus(out, "es", "en", src=grown, tgt=grown_tgt, dev=15, test=5)
    assert any("drawn anew: the earlier import into" in line and "test from files" in line
               for line in result.report)
