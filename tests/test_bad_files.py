"""Every unreadable or corrupt file is an error naming it, from the API and the command
line alike (exit status 1, one line, no traceback); nothing half-written is left."""

import pytest
import torch

from transduce import checkpoint, load
from transduce.cli import main
from transduce.config import TrainConfig, preset
from transduce.data.tokenizer import MODEL_NAME, Tokenizer, TokenizerError
from transduce.model import Transformer, load_model
from transduce.train.loop import train


@pytest.fixture
def run(tiny_corpus, tmp_path):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=300, tgt_vocab_size=300, max_positions=40))
    run = tmp_path / "run"
    checkpoint.save(checkpoint.step_dir(run, 1), model, None, tiny_corpus / MODEL_NAME)
    return run


def damage(path, how):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if how == "truncate" else b"\x00garbage" * 8)


def translate_fails_naming(run, tmp_path, capsys, name):
    source = tmp_path / "in.txt"
    source.write_text("el perro\n", encoding="utf-8")
    assert main(["translate", "--model", str(run), "--input", str(source)]) == 1
    err = capsys.readouterr().err
    assert name in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_corrupt_weights(run, tmp_path, capsys, how):
    damage(run / "step-0000001" / checkpoint.WEIGHTS, how)
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors: unreadable or corrupt"):
        load(run)
    translate_fails_naming(run, tmp_path, capsys, "model.safetensors")


def test_weights_that_are_not_finite_are_refused_by_name(run, tmp_path, capsys):
    """NaN weights would translate every line to nothing: refused at load."""
    model = load_model(run)
    with torch.no_grad():
        model.encoder.layers[0].ffn.linear1.weight[0, 0] = float("nan")
    checkpoint.save(run / "step-0000001", model, None, run / "step-0000001" / MODEL_NAME)
    with pytest.raises(checkpoint.CheckpointError, match="not finite .* in encoder.layers.0"):
        load(run)
    translate_fails_naming(run, tmp_path, capsys, "model.safetensors")


def test_weights_of_another_shape_are_named_in_a_few_lines(run, tmp_path, capsys):
    config = run / "step-0000001" / checkpoint.CONFIG
    config.write_text(config.read_text().replace('"d_ff": 128', '"d_ff": 96'))
    err = translate_fails_naming(run, tmp_path, capsys, "model.safetensors")
    assert "ffn.linear1.bias has shape (128,) in this file, but (96,) by the model" in err
    assert len(err) < 1000


@pytest.mark.parametrize("text,message", [
    ("{not json", "config.json: unreadable"),
    ('["a list"]', "config.json: expected a JSON object"),
    ('{"model": {"d_model": -4}}', "config.json: unreadable checkpoint configuration"),
    ('{"model": {"d_modle": 64}}', "unknown ModelConfig field"),
])
def test_corrupt_config(run, tmp_path, capsys, text, message):
    (run / "step-0000001" / checkpoint.CONFIG).write_text(text, encoding="utf-8")
    with pytest.raises(checkpoint.CheckpointError, match=message):
        load(run)
    translate_fails_naming(run, tmp_path, capsys, "config.json")


def test_corrupt_tokenizer(run, tmp_path, capsys):
    damage(run / "step-0000001" / checkpoint.TOKENIZER, "garbage")
    with pytest.raises(TokenizerError, match="spm.model: not a readable SentencePiece model"):
        load(run)
    translate_fails_naming(run, tmp_path, capsys, "spm.model")


def test_corrupt_trainer_state_on_resume(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "train"
    config = preset("tiny", src_vocab_size=300, tgt_vocab_size=300)
    train(tiny_corpus, out, config, TrainConfig(max_steps=2, max_tokens=200, warmup_steps=5))
    state = checkpoint.list_checkpoints(out)[-1] / checkpoint.TRAINER_STATE
    damage(state, "truncate")
    assert main(["train", "--data", str(tiny_corpus), "--out", str(out), "--resume",
                 "--max-steps", "4"]) == 1
    err = capsys.readouterr().err
    assert "trainer_state.pt: unreadable or corrupt trainer state" in err and "Traceback" not in err
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step-0000002"]


def test_a_damaged_tokenizer_cache_is_rebuilt(tiny_corpus, tmp_path):
    tokenizer = Tokenizer(tiny_corpus / MODEL_NAME)
    texts = ["el perro", "uno dos tres"]
    expected = [list(ids) for ids in tokenizer.encode_cached(texts, tmp_path)]
    (cached,) = tmp_path.glob("*.npz")
    damage(cached, "truncate")
    assert [list(ids) for ids in tokenizer.encode_cached(texts, tmp_path)] == expected
    assert [list(ids) for ids in tokenizer.encode_cached(texts, tmp_path)] == expected


def test_average_refuses_corrupt_weights(run, tmp_path, capsys):
    damage(run / "step-0000001" / checkpoint.WEIGHTS, "truncate")
    assert main(["average", str(run), "--out", str(tmp_path / "average")]) == 1
    assert "model.safetensors: unreadable or corrupt" in capsys.readouterr().err
    assert not (tmp_path / "average").exists()
