"""Atomic writes: the destination is old-and-complete or new-and-complete, never half."""

import pytest

from transduce import atomic


def test_write_text_replaces_a_file(tmp_path):
    path = tmp_path / "sub" / "out.txt"
    atomic.write_text(path, "first\n")
    atomic.write_text(path, "second\n")
    assert path.read_text() == "second\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.txt"]


def test_a_failed_file_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic.atomic_file(path) as temporary:
        temporary.write_text("half")
        raise RuntimeError("killed midway")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_a_directory_is_replaced_whole(tmp_path):
    path = tmp_path / "model"
    for version in ("old", "new"):
        with atomic.atomic_directory(path) as temporary:
            (temporary / "a.txt").write_text(version)
            if version == "old":
                (temporary / "only-old.txt").write_text("x")
    assert sorted(p.name for p in path.iterdir()) == ["a.txt"]
    assert (path / "a.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_failed_directory_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic.atomic_directory(path) as temporary:
        (temporary / "a.txt").write_text("half")
        raise RuntimeError("killed midway")
    assert (path / "a.txt").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_exchange_fallback_still_replaces(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    path = tmp_path / "model"
    for version in ("old", "new"):
        with atomic.atomic_directory(path) as temporary:
            (temporary / "a.txt").write_text(version)
    assert (path / "a.txt").read_text() == "new" and len(list(tmp_path.iterdir())) == 1


def test_leftovers_of_killed_writers_are_removed(tmp_path):
    step, notes = atomic.temporary_path(tmp_path / "step-1"), atomic.temporary_path(tmp_path / "a")
    step.mkdir()
    notes.write_text("x")
    atomic.remove_temporaries(tmp_path, "step-")
    assert not step.exists() and notes.exists()


def test_a_file_is_never_written_over_a_directory_or_under_a_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("mine")
    for path in (tmp_path / "d", tmp_path / "f" / "x"):
        with pytest.raises(atomic.OutputPathError, match=str(path)):
            atomic.write_text(path, "text")
    assert (tmp_path / "f").read_text() == "mine" and not any((tmp_path / "d").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]


def test_a_directory_never_takes_the_place_of_a_file(tmp_path):
    """(The swap would move the file aside under a temporary name and fail to remove it.)"""
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(atomic.OutputPathError, match="not a directory"):
        with atomic.atomic_directory(path) as temporary:
            (temporary / "a.txt").write_text("new")
    assert path.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
