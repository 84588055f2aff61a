"""Sharded training (--fsdp, torch.distributed.fsdp.fully_shard) in two gloo processes
on the CPU: the weights DDP trains, exact resume, checkpoints in the ordinary format,
and the refusals."""

import shutil

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError, TrainConfig, preset
from transduce.decode.translate import Translator
from transduce.model import load_model
from transduce.train.sharding import check_fsdp_config
from tests.train import test_encoder
from tests.train.test_loop import FAIL_AT_STEP_2, run_two_processes, weights

# Float32 (autocast would round differently on CPUs with and without bfloat16) and no
# biases: a key projection's bias has a gradient of exactly zero (softmax ignores a
# shift shared by every key), so Adam turns its rounding noise into updates of the
# learning rate's size, whatever the reduction order.
COMMON = ["--preset", "tiny", "--max-tokens", "200", "--max-steps", "6", "--warmup-steps",
          "5", "--threads", "1", "--dtype", "float32", "--no-bias", "--update-freq", "2",
          "--clip-norm", "0.5", "--save-every", "3", "--eval-every", "3",
          "--dev-bleu-sentences", "4"]


def assert_trained_alike(a: dict, b: dict) -> None:
    """Equal to float32 reduction-order tolerance: FSDP reduce-scatters the gradients
    (divided by the processes before they are summed) where DDP all-reduces them, so
    they differ in the last bits, and Adam's division by the root of the second moment
    magnifies that for the smallest gradients: after 6 steps at a learning rate of
    about 0.05 the weights differ by up to 1.6e-5 (measured), within atol 5e-5."""
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=5e-5)


def train_two(out, args, corpus, fsdp: bool):
    flag = ["--fsdp"] if fsdp else []
    result = run_two_processes(out.parent / f"{out.name}_worker.py",
                               ["train", "--data", str(corpus), "--out", str(out), *flag,
                                *args])
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """The same 6 steps in two processes with DDP and with FSDP, checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("fsdp")
    train_two(root / "ddp", COMMON, tiny_corpus, fsdp=False)
    train_two(root / "fsdp", COMMON, tiny_corpus, fsdp=True)
    return root


def test_fsdp_trains_the_weights_ddp_trains(runs):
    """Gradient accumulation (update_freq 2: no reduction before a step's last batch),
    clipping by the norm over every shard, dev evaluation (BLEU included) on gathered
    weights; the optimizer state is saved in the unsharded format, numbered alike."""
    for step in ("step-0000003", "step-0000006"):
        assert_trained_alike(weights(runs / "ddp" / step), weights(runs / "fsdp" / step))
    ddp, fsdp = (checkpoint.load_trainer_state(runs / name / "step-0000006")["optimizer"]
                 for name in ("ddp", "fsdp"))
    assert ddp["param_groups"] == fsdp["param_groups"]
    assert sorted(ddp["state"]) == sorted(fsdp["state"])
    for index, moments in ddp["state"].items():
        assert torch.equal(moments["step"], fsdp["state"][index]["step"])
        torch.testing.assert_close(moments["exp_avg"], fsdp["state"][index]["exp_avg"],
                                   rtol=1e-4, atol=1e-6)


def test_an_fsdp_run_resumes_exactly(runs, tiny_corpus):
    """Its step-3 checkpoint resumed under FSDP (the first process reads it and scatters
    the shards) ends bit for bit where the uninterrupted run did."""
    resumed = runs / "resumed"
    shutil.copytree(runs / "fsdp" / "step-0000003", resumed / "step-0000003")
    train_two(resumed, ["--resume", "--max-steps", "6"], tiny_corpus, fsdp=False)
    a, b = weights(runs / "fsdp"), weights(resumed)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_an_fsdp_checkpoint_is_an_ordinary_one(runs, tiny_corpus):
    """One process translates with it, and resumes it without FSDP (--no-fsdp, the
    update frequency of both processes) to the weights the sharded run reached."""
    model = load_model(runs / "fsdp")
    tokenizer = checkpoint.load_tokenizer(checkpoint.resolve(runs / "fsdp"))
    assert len(Translator(model, tokenizer).translate(["uno dos", "tres"], beam=2)) == 2
    single = runs / "single"
    shutil.copytree(runs / "fsdp" / "step-0000003", single / "step-0000003")
    assert main(["train", "--data", str(tiny_corpus), "--out", str(single), "--resume",
                 "--no-fsdp", "--update-freq", "4", "--max-steps", "6"]) == 0
    assert_trained_alike(weights(runs / "fsdp"), weights(single))


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """The encoder tests' text corpus of counting lines."""
    return test_encoder.counting.__wrapped__(tmp_path_factory)


def test_an_encoder_with_unused_heads_trains_alike(counting, tmp_path):
    """Masked-LM pre-training: the pooler and the next-sentence head get no gradient;
    their shards are left alone, as DDP leaves them out."""
    args = ["--arch", "encoder", "--preset", "bert-tiny", "--objective", "mlm",
            "--max-tokens", "128", "--max-steps", "4", "--warmup-steps", "5", "--threads",
            "1", "--dtype", "float32", "--no-bias"]
    train_two(tmp_path / "ddp", args, counting, fsdp=False)
    train_two(tmp_path / "fsdp", args, counting, fsdp=True)
    assert_trained_alike(weights(tmp_path / "ddp"), weights(tmp_path / "fsdp"))


def test_a_failing_fsdp_run_leaves_no_process_group_behind(tiny_corpus, tmp_path):
    """An error in the middle of a sharded run: each process names it and exits with the
    process group destroyed (DTensor's caches, which keep the device mesh and so the
    group, emptied first)."""
    result = run_two_processes(tmp_path / "worker.py",
                               ["train", "--data", str(tiny_corpus), "--out",
                                str(tmp_path / "run"), "--fsdp", "--preset", "tiny",
                                "--max-tokens", "200", "--max-steps", "6", "--threads", "1"],
                               prelude=FAIL_AT_STEP_2)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("transduce: error: deliberate failure at step 2") == 2, output


def test_one_process_is_refused(tiny_corpus, tmp_path, capsys):
    code = main(["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "run"),
                 "--preset", "tiny", "--max-steps", "1", "--fsdp"])
    assert code != 0
    assert "TrainConfig.fsdp" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("changes, arch, message", [
    ({"compile": True}, "transformer", "--no-compile"),
    ({"ema_decay": 0.9}, "transformer", "--ema-decay 0"),
    ({}, "rnn-luong", "arch 'rnn-luong'"),
])
def test_what_fsdp_cannot_do_is_refused_by_name(changes, arch, message):
    model_config = preset("tiny", arch=arch)
    with pytest.raises(ConfigError, match="TrainConfig.fsdp") as refused:
        check_fsdp_config(model_config, TrainConfig(fsdp=True, **changes), world=2)
    assert message in str(refused.value)
