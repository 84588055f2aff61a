"""Batches decoded on several worker threads: the same translations as one worker, in
order (scores to float32 rounding); PyTorch's thread count restored; bad settings
refused by name."""

import threading

import pytest
import torch

from transduce.cli import main
from transduce.config import ConfigError
from transduce.decode.parallel import auto_workers, intra_op_threads, map_batches
from transduce.decode.translate import Translator
from tests.decode.test_translate import run_dir  # noqa: F401  (the fixture)

LINES = ["uno dos tres casa", "el perro", "gato rojo grande come el perro", "casa", "",
         "tres tres dos uno el gato come", "perro grande", "el gato rojo", "dos", "uno"]


def test_batches_come_back_in_order_the_first_alone_and_the_threads_restored():
    threads_before = torch.get_num_threads()
    seen: list[tuple[int, str, int]] = []
    lock = threading.Lock()

    def run(batch):
        with lock:
            seen.append((batch, threading.current_thread().name, torch.get_num_threads()))
        return batch * 10

    assert list(map_batches(run, list(range(7)), workers=2)) == [(b, 10 * b) for b in range(7)]
    assert seen[0] == (0, threading.current_thread().name, threads_before)   # alone, first
    assert all(name.startswith("transduce-decode") for _, name, _ in seen[1:])
    assert all(threads == max(1, threads_before // 2) for _, _, threads in seen[1:])
    assert torch.get_num_threads() == threads_before


def test_without_a_first_batch_alone_every_batch_runs_on_the_workers():
    names = []
    list(map_batches(lambda b: names.append(threading.current_thread().name), [0, 1],
                     workers=2, first_alone=False))
    assert len(names) == 2 and all(name.startswith("transduce-decode") for name in names)


def test_an_error_on_a_worker_reaches_the_caller_and_the_threads_are_restored():
    threads_before = torch.get_num_threads()

    def run(batch):
        if batch == 3:
            raise ValueError("batch 3 failed")
        return batch

    with pytest.raises(ValueError, match="batch 3 failed"):
        list(map_batches(run, list(range(6)), workers=2))
    assert torch.get_num_threads() == threads_before
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads_before


@pytest.mark.parametrize("beam", [1, 3])
def test_two_workers_translate_as_one(run_dir, beam):  # noqa: F811
    one, two = (Translator.load(run_dir, workers=workers) for workers in (1, 2))
    options = dict(beam=beam, batch_sentences=2)   # five batches
    expected, found = (t.translate_nbest(LINES, beam, **options) for t in (one, two))
    assert [[t.text for t in n] for n in found] == [[t.text for t in n] for n in expected]
    # Scores to float32 rounding: a worker's sums are split over fewer threads.
    assert [t.score for n in found for t in n] == \
        pytest.approx([t.score for n in expected for t in n], rel=1e-6)


def test_bad_worker_counts_are_refused_by_name(run_dir, capsys):  # noqa: F811
    for workers in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="workers="):
            Translator.load(run_dir, workers=workers)
    loaded = Translator.load(run_dir)
    with pytest.raises(ConfigError, match="on the CPU"):   # refused before the GPU is touched
        Translator(loaded.model, loaded.tokenizer, device="cuda", workers=2)
    with pytest.raises(SystemExit) as stopped:
        main(["translate", "--model", str(run_dir), "--workers", "0"])
    assert stopped.value.code == 2 and "--workers" in capsys.readouterr().err


def test_auto_workers_are_two_on_a_cpu_with_two_threads_and_one_elsewhere(run_dir):  # noqa: F811
    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert Translator.load(run_dir, workers="auto").workers == 2
        loaded = Translator.load(run_dir)
        assert loaded.workers == 1                              # the library's default
        assert auto_workers(on_cpu=False) == 1                  # a GPU, ONNX Runtime
        torch.set_num_threads(1)
        assert Translator.load(run_dir, workers="auto").workers == 1
    finally:
        torch.set_num_threads(threads_before)
    with pytest.raises(ConfigError, match="workers='two'"):
        Translator.load(run_dir, workers="two")


def test_the_cli_decodes_with_auto_workers_by_default(run_dir, tmp_path, capsys,  # noqa: F811
                                                      monkeypatch):
    chosen = []
    original = Translator.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        chosen.append(self.workers)

    monkeypatch.setattr(Translator, "__init__", recording)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n")
    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["translate", "--model", str(run_dir), "--input", str(source)]) == 0
        assert main(["translate", "--model", str(run_dir), "--input", str(source),
                     "--workers", "1"]) == 0
    finally:
        torch.set_num_threads(threads_before)
    assert chosen == [2, 1]
    assert capsys.readouterr().out.count("\n") == 2 * len(LINES)
