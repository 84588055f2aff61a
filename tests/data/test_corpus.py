"""Every bad-input case gives an error naming the file and line, and loses nothing."""

import pytest

from transduce.data.corpus import CorpusError, read_parallel, read_split, write_metadata


def write(path, data):
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def test_reads_pairs_and_drops_empty_lines_without_shifting(tmp_path):
    src = write(tmp_path / "a.es", "uno\n\ntres\ncuatro\r\n")
    tgt = write(tmp_path / "a.en", "one\ntwo\n  \nfour\n")
    corpus = read_parallel(src, tgt)
    assert corpus.source == ["uno", "cuatro"] and corpus.target == ["one", "four"]
    assert corpus.line_numbers == [1, 4] and corpus.dropped_empty == [2, 3]
    assert "dropped 2 with an empty side (lines 2, 3)" in corpus.summary()


def test_different_line_counts_name_both_counts_and_where_they_diverge(tmp_path):
    source = [f"sentence number {i} " + "x" * (i % 7 * 9) for i in range(40)]
    target = source[:17] + source[18:]   # line 18 lost on the target side
    src = write(tmp_path / "s.txt", "\n".join(source) + "\n")
    tgt = write(tmp_path / "t.txt", "\n".join(target) + "\n")
    with pytest.raises(CorpusError, match=r"s.txt has 40 lines but .*t.txt has 39.*near line 18"):
        read_parallel(src, tgt)


@pytest.mark.parametrize("data,message", [
    (b"good\n\xff\xfebad\n", r"bad.txt:2: invalid UTF-8 at byte 1"),
    (b"good\nba\x00d\n", r"bad.txt:2: NUL byte at column 3"),
    (b"", r"bad.txt: the file is empty"),
    (b"\n\n", r"bad.txt: the file is empty"),
])
def test_bad_bytes_name_file_and_line(tmp_path, data, message):
    bad = write(tmp_path / "bad.txt", data)
    good = write(tmp_path / "good.txt", "a\nb\n")
    with pytest.raises(CorpusError, match=message):
        read_parallel(bad, good)


def test_missing_file(tmp_path):
    with pytest.raises(CorpusError, match="nope.txt: no such file"):
        read_parallel(tmp_path / "nope.txt", tmp_path / "nope.txt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(CorpusError, match="folder: a directory, where a file was expected"):
        read_parallel(tmp_path / "folder", tmp_path / "folder")


def test_all_pairs_empty_is_an_error(tmp_path):
    src = write(tmp_path / "s", "a\n\n")
    tgt = write(tmp_path / "t", "\nb\n")
    with pytest.raises(CorpusError, match="no line pair has text on both sides"):
        read_parallel(src, tgt)


def test_split_directory_needs_metadata_naming_languages(tmp_path):
    write(tmp_path / "train.de", "Hallo\n")
    write(tmp_path / "train.en", "Hello\n")
    with pytest.raises(CorpusError, match=r"no corpus.json .*found train.de, train.en"):
        read_split(tmp_path, "train")
    write_metadata(tmp_path, "de", "en")
    corpus = read_split(tmp_path, "train")
    assert corpus.source == ["Hallo"] and corpus.target == ["Hello"]
    write(tmp_path / "corpus.json", "{not json")
    with pytest.raises(CorpusError, match="corpus.json: expected a JSON object"):
        read_split(tmp_path, "train")
