"""Where commands write: checked before any work, and never over what the user has.
An export, average, conversion or import replaces a directory whole, so it refuses the
directory it reads, a file, and a directory with anything in it unless --force, and
--force only over a directory transduce wrote. Output files are refused where they
cannot be written (a directory, under a file) before the model is even loaded."""

import json
import subprocess
import sys

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import preset
from transduce.data.tokenizer import MODEL_NAME
from transduce.model import build_model
from tests.environment import subprocess_env


@pytest.fixture
def saved(tmp_path, tiny_corpus):
    torch.manual_seed(0)
    model = build_model(preset("tiny", src_vocab_size=300, tgt_vocab_size=300)).eval()
    return checkpoint.save(tmp_path / "ckpt", model, None, tiny_corpus / MODEL_NAME)


def commands(model, out):
    return {"export hf": ["export", "hf", str(model), str(out)],
            "export ct2": ["export", "ct2", str(model), str(out)],
            "export onnx": ["export", "onnx", str(model), str(out)],
            "average": ["average", str(model), "--out", str(out)],
            "convert-kv": ["convert-kv", str(model), "--kv-heads", "1", "--out", str(out)]}


@pytest.mark.parametrize("command", list(commands("m", "o")))
def test_writers_refuse_to_replace_what_the_user_has(command, saved, tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    cases = {theirs: "not empty; pass --force", a_file: "is not a directory",
             saved: "which this command reads", saved.parent: "which this command reads"}
    for out, message in cases.items():
        assert main(commands(saved, out)[command]) == 2
        assert message in capsys.readouterr().err
    # --force replaces only a directory transduce wrote
    assert main([*commands(saved, theirs)[command], "--force"]) == 2
    assert "holds neither our config.json nor an export's" in capsys.readouterr().err
    assert (theirs / "notes.txt").read_text() == "mine" and a_file.read_text() == "mine"
    assert (saved / checkpoint.CONFIG).is_file()
    # nor a directory whose config.json is another toolkit's (a downloaded model)
    (theirs / "config.json").write_text('{"model_type": "marian", "d_model": 512}')
    assert main([*commands(saved, theirs)[command], "--force"]) == 2
    assert "holds neither our config.json" in capsys.readouterr().err
    assert (theirs / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["hf", "ct2", "onnx"])
def test_force_replaces_an_earlier_export(saved, tmp_path, capsys, kind):
    if kind == "onnx":
        pytest.importorskip("onnxruntime")
    out = tmp_path / kind
    assert main(["export", kind, str(saved), str(out)]) == 0
    assert main(["export", kind, str(saved), str(out)]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err
    assert main(["export", kind, str(saved), str(out), "--force"]) == 0
    assert (out / "config.json").is_file()
    if kind != "onnx":       # its config.json is ours
        marker = json.loads((out / "transduce-export.json").read_text())
        assert marker["written_by"] == "transduce" and marker["trained_steps"] is None


@pytest.mark.parametrize("argv,message", [
    (["translate", "--model", "MISSING", "--input", "IN", "--output", "DIR"], "is a directory"),
    (["translate", "--model", "MISSING", "--input", "IN", "--output", "FILE/x"],
     "is a file, not a directory"),
    (["evaluate", "--model", "SAVED", "--data", "DATA", "--out", "DIR/x"], "x.hyp: is a directory"),
    (["embed", "--model", "MISSING", "--input", "IN", "--out", "DIR"], "is a directory"),
    (["attention", "hola", "--model", "MISSING", "--out", "FILE/x.png"],
     "is a file, not a directory"),
    (["train", "--data", "DATA", "--out", "FILE", "--preset", "tiny"], "is not a directory"),
])
def test_output_paths_are_checked_before_any_work(argv, message, tmp_path, tiny_corpus,
                                                  saved, capsys):
    """The model named does not exist: the output path is the first thing refused
    (evaluate reads its model's configuration first, then refuses before translating)."""
    (tmp_path / "DIR").mkdir()
    (tmp_path / "FILE").write_text("mine")
    (tmp_path / "IN").write_text("hola\n")
    places = {"DIR": tmp_path / "DIR", "FILE": tmp_path / "FILE", "IN": tmp_path / "IN",
              "MISSING": tmp_path / "missing", "DATA": tiny_corpus, "SAVED": saved}
    for name, place in places.items():
        argv = [a.replace(name, str(place)) if a.startswith(name) else a for a in argv]
    (tmp_path / "DIR" / "x.hyp").mkdir()       # evaluate's first output
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert message in error and "missing" not in error
    assert (tmp_path / "FILE").read_text() == "mine"


def test_an_output_file_from_standard_input_is_complete_or_untouched(saved, tmp_path):
    """Input that turns out bad halfway (invalid UTF-8 on line 3) leaves an existing
    --output file as it was, and no temporary beside it."""
    out = tmp_path / "out.txt"
    out.write_text("old\n")
    done = subprocess.run([sys.executable, "-m", "transduce", "translate", "--model",
                           str(saved), "--output", str(out), "--beam", "1"],
                          input=b"uno\ndos\n\xff\xfe\n", capture_output=True,
                          env=subprocess_env(), timeout=120)
    assert done.returncode != 0 and b"<stdin>:3" in done.stderr
    assert out.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == \
        sorted(["ckpt", "out.txt"])


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "M", "--prompt", "hi", "--seed", "-1"], "--seed: -1: must be"),
    (["vocab", "--data", "D", "--size", "100", "--seed", "4294967296"], "--seed: 4294967296"),
    (["serve", "--model", "M", "--port", "70000"], "--port: 70000: must be a TCP port"),
])
def test_seeds_and_ports_out_of_range_are_refused_as_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_config_file_table_of_the_wrong_type_is_named(tmp_path, tiny_corpus, capsys):
    config = tmp_path / "run.toml"
    config.write_text("train = 5\n")
    argv = ["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "run"),
            "--config", str(config)]
    assert main(argv) == 2
    assert "train = 5: must be a table of TrainConfig fields" in capsys.readouterr().err


def test_plot_names_a_log_line_that_is_not_a_record(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text('{"event": "start"}\n[1, 2]\n')
    assert main(["plot", str(run)]) == 1
    assert "log.jsonl:2: not a JSON record (an object), but list [1, 2]" in \
        capsys.readouterr().err


@pytest.mark.parametrize("lines,message", [
    ('{"event": "start"}\n', "no training steps logged yet"),
    ('{"event": "train", "step": 5, "lr": 0.001}\n', "a 'train' record without a number for loss"),
    ('{"event": "train", "step": 5, "loss": 2.5, "lr": 0.001}\n{"event": "dev", "step": "5"}\n',
     "a 'dev' record without a number for step, dev_loss")])
def test_plot_refuses_a_log_with_nothing_to_draw_writing_nothing(tmp_path, capsys, lines, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text(lines)
    assert main(["plot", str(run)]) == 1
    err = capsys.readouterr().err
    assert f"{run / 'log.jsonl'}: {message}" in err and len(err.splitlines()) == 1
    assert not (run / "curves.png").exists()
