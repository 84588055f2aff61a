import json
import os
import stat

import pytest
import torch

from transduce import checkpoint
from transduce.config import TrainConfig, preset
from transduce.model import Transformer, build_model, load_model

@pytest.fixture
def tokenizer_file(tmp_path):
    path = tmp_path / "spm.model"
    path.write_bytes(b"stand-in tokenizer bytes")
    return path


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return Transformer(preset("tiny", src_vocab_size=40, tgt_vocab_size=40))


def test_save_and_load_round_trip_keeps_tied_weights(tmp_path, tokenizer_file):
    model = tiny_model()
    path = checkpoint.save(tmp_path / "run" / "step-0000001", model, TrainConfig(),
                           tokenizer_file, {"step": 1})
    assert sorted(p.name for p in path.iterdir()) == \
        ["config.json", "model.safetensors", "spm.model", "trainer_state.pt"]
    loaded = load_model(tmp_path / "run")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.output_proj.weight is loaded.encoder.embed.embedding.weight
    model_config, train_config = checkpoint.read_configs(path)
    assert model_config == model.config and train_config == TrainConfig()


def test_a_translation_models_language_pair_is_recorded_and_read_back(tmp_path, tokenizer_file):
    model = tiny_model()
    assert load_model(checkpoint.save(tmp_path / "plain", model, None, tokenizer_file)
                      ).languages is None                 # not known: not written
    model.languages = ("es", "en")
    path = checkpoint.save(tmp_path / "run", model, None, tokenizer_file)
    config = json.loads((path / "config.json").read_text())
    assert config["languages"] == {"source": "es", "target": "en"}
    assert load_model(path).languages == ("es", "en")
    config["languages"] = ["es", "en"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(checkpoint.CheckpointError, match='config.json: "languages" must be'):
        load_model(path)


def test_weights_that_are_views_of_one_buffer_are_saved_apart(tmp_path, tokenizer_file):
    """On a GPU, cuDNN packs an RNN's weights into one buffer (each parameter a view of
    it); the checkpoint must store them as separate tensors and load them back."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", arch="rnn-luong", src_vocab_size=40, tgt_vocab_size=40))
    rnn_weights = [p for n, p in model.named_parameters() if n.startswith("encoder.")]
    flat = torch.cat([p.detach().flatten() for p in rnn_weights])
    offset = 0
    for parameter in rnn_weights:   # as cuDNN's flatten_parameters leaves them
        parameter.data = flat[offset:offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()
    checkpoint.save(tmp_path / "run", model, None, tokenizer_file)
    loaded = load_model(tmp_path / "run")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_killed_save_leaves_no_checkpoint_and_is_cleaned_up(tmp_path, tokenizer_file):
    run = tmp_path / "run"
    checkpoint.save(checkpoint.step_dir(run, 5), tiny_model(), None, tokenizer_file)
    half = run / ".tmp-step-0000010-999"   # what a SIGKILL during save leaves
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"truncated")
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step-0000005"]
    assert checkpoint.resolve(run).name == "step-0000005"
    checkpoint.remove_stale_temporaries(run)
    assert not half.exists()


def test_keep_last_and_resolve(tmp_path, tokenizer_file):
    run = tmp_path / "run"
    for step in (10, 2, 30, 4):
        checkpoint.save(checkpoint.step_dir(run, step), tiny_model(), None, tokenizer_file)
    checkpoint.keep_last(run, 2)
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step-0000010", "step-0000030"]
    with pytest.raises(checkpoint.CheckpointError, match="empty: no such checkpoint or run dir"):
        checkpoint.resolve(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="empty: no checkpoint found"):
        checkpoint.resolve(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError,
                       match="weights.bin: a file, where a checkpoint or run directory was"):
        checkpoint.resolve(tmp_path / "weights.bin")


def test_average_is_the_elementwise_mean(tmp_path, tokenizer_file):
    run = tmp_path / "run"
    models = [tiny_model(seed) for seed in range(3)]
    for model in models:
        model.languages = ("es", "en")
    paths = [checkpoint.save(checkpoint.step_dir(run, i), m, None, tokenizer_file)
             for i, m in enumerate(models)]
    averaged = load_model(checkpoint.average(paths, tmp_path / "avg"))
    assert averaged.languages == ("es", "en")
    for name, tensor in averaged.state_dict().items():
        expected = sum(m.state_dict()[name] for m in models) / 3
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6)


def test_average_by_blocks_of_rows_gives_the_same_bits(tmp_path, tokenizer_file, monkeypatch):
    """A tensor over AVERAGE_BLOCK_BYTES (NLLB's embedding) is averaged a block of rows
    at a time: the same float64 sums, so the same bits as whole, and the float64 mean."""
    from safetensors.torch import load_file

    models = [tiny_model(seed) for seed in range(3)]
    paths = [checkpoint.save(checkpoint.step_dir(tmp_path / "run", i), m, None, tokenizer_file)
             for i, m in enumerate(models)]
    whole = load_file(str(checkpoint.average(paths, tmp_path / "whole") / checkpoint.WEIGHTS))
    monkeypatch.setattr(checkpoint, "AVERAGE_BLOCK_BYTES", 3 * 8 * 64 + 8)  # 3 rows of 64
    blocks = load_file(str(checkpoint.average(paths, tmp_path / "blocks") / checkpoint.WEIGHTS))
    assert whole.keys() == blocks.keys()
    assert all(torch.equal(whole[name], blocks[name]) for name in whole)
    name = "output_proj.weight"
    assert blocks[name].shape == (40, 64)           # 14 blocks, the last of one row
    expected = sum(m.state_dict()[name].double() for m in models) / 3
    assert torch.equal(blocks[name], expected.float())


def test_average_refuses_different_models(tmp_path, tokenizer_file):
    run = tmp_path / "run"
    a = checkpoint.save(checkpoint.step_dir(run, 1), tiny_model(), None, tokenizer_file)
    other = Transformer(preset("tiny", src_vocab_size=40, tgt_vocab_size=40, num_kv_heads=1))
    b = checkpoint.save(checkpoint.step_dir(run, 2), other, None, tokenizer_file)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.average([a, b], tmp_path / "avg")


@pytest.fixture()
def umask_027():
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def test_weights_get_the_mode_open_gives_not_safetensors_private_one(tmp_path, tokenizer_file,
                                                                      umask_027):
    """safetensors creates its file 0600: a model shared on a server was unreadable."""
    paths = [checkpoint.save(checkpoint.step_dir(tmp_path / "run", i), tiny_model(i), None,
                             tokenizer_file) for i in range(2)]
    averaged = checkpoint.average(paths, tmp_path / "avg")
    for weights in [*paths, averaged]:
        assert stat.S_IMODE((weights / checkpoint.WEIGHTS).stat().st_mode) == 0o640


def test_a_sentencepiece_model_is_saved_as_read_when_its_file_has_gone(tmp_path):
    """A resumed run may read its vocabulary from its own latest checkpoint, which
    keep_last removes when the run saves the next: the bytes read are written."""
    from transduce.data.tokenizer import Tokenizer, train_tokenizer

    words = "one two three four five six seven eight nine ten eleven twelve".split()
    lines = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 5
    trained = train_tokenizer(lines, tmp_path / "vocab", vocab_size=300)
    original = trained.path.read_bytes()
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "spm.model").write_bytes(original)
    tokenizer = Tokenizer(tmp_path / "gone" / "spm.model")
    (tmp_path / "gone" / "spm.model").unlink()
    path = checkpoint.save(tmp_path / "ckpt", tiny_model(), None, tokenizer)
    assert (path / "spm.model").read_bytes() == original
    assert checkpoint.load_tokenizer(path).encode(["one two"]) == trained.encode(["one two"])
