"""LoRA runs (train --init with --lora-rank, train/lora.py): only the adapters (and a
classifier's new head) train, every checkpoint is a plain merged model with its
adapters beside it, resuming is exact, and a base that moved or changed is refused."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError
from transduce.export import export_peft
from transduce.model import load_model
from transduce.train import lora, loop
from transduce.train.flops import training_flops
from transduce.train.log import LOG_NAME
from transduce.train.loop import train
from tests.train.test_encoder import bert_tiny, classes  # noqa: F401 - classes: a fixture
from tests.train.test_encoder import train_config as encoder_config
from tests.train.test_lm import counting, gpt_tiny, train_config  # noqa: F401 - a fixture
from tests.train.test_loop import (assert_two_processes_trained_alike,
                                   train_alone_at_double_update_freq, weights)
from tests.train.test_loop import tiny_config as translation_config
from tests.train.test_loop import train_config as translation_train_config

LORA = dict(lora_rank=4, lora_alpha=8.0, schedule="noam", warmup_steps=10, lr_scale=1.0)


@pytest.fixture(scope="module")
def base(counting, tmp_path_factory):
    """A language model trained a little on the counting lines: what the adapters adapt."""
    run = tmp_path_factory.mktemp("base") / "run"
    train(counting, run, gpt_tiny(dropout=0.1), train_config(max_steps=15))
    return checkpoint.resolve(run)


def tensors(path, name=checkpoint.WEIGHTS):
    return load_file(str(path / name))


def assert_merged_into(base, last):
    """The checkpoint `last` of a LoRA run from `base`: its frozen weights the base's bit
    for bit, each adapted one W + 2 B A (alpha 8 / rank 4). -> the adapted weights' names."""
    before, after = tensors(base), tensors(last)
    adapters = tensors(last, checkpoint.ADAPTERS)
    adapted = {f"{layer}.weight" for layer in checkpoint.read_lora_section(last)["layers"]}
    assert len(adapted) == 2 * 6 and adapted < after.keys() == before.keys()
    for name in before.keys() - adapted:
        assert torch.equal(before[name], after[name]), name
    for name in adapted:
        layer = name.removesuffix(".weight")
        delta = 2.0 * adapters[f"{layer}.lora_b"] @ adapters[f"{layer}.lora_a"]
        assert delta.abs().max() > 0
        torch.testing.assert_close(after[name], before[name] + delta)
    return adapted


def assert_same_checkpoints(run, other, directories):
    """Each checkpoint directory's merged weights and adapters, bit for bit."""
    for directory in directories:
        for name in (checkpoint.WEIGHTS, checkpoint.ADAPTERS):
            a, b = tensors(run / directory, name), tensors(other / directory, name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def train_losses(run):
    records = [json.loads(line) for line in (run / LOG_NAME).read_text().splitlines()]
    return [r["loss"] for r in records if r["event"] == "train"]


def test_only_the_adapters_train_and_the_checkpoint_is_the_merged_model(counting, base,
                                                                         tmp_path):
    run = tmp_path / "lora"
    last = train(counting, run, gpt_tiny(dropout=0.1), train_config(max_steps=30, **LORA),
                 init=base)
    losses = train_losses(run)
    assert losses[-1] < 0.9 * losses[0], losses
    section = checkpoint.read_lora_section(last)
    assert section["base"] == str(base.resolve()) and section["rank"] == 4
    adapted = assert_merged_into(base, last)
    adapters = tensors(last, checkpoint.ADAPTERS)
    # Adam holds moments of the adapters alone.
    state = checkpoint.load_trainer_state(last)["optimizer"]
    assert len(state["state"]) == len(adapters) == 2 * len(adapted)
    # A plain checkpoint for everything that reads one.
    model = load_model(run)
    assert all(type(m).__name__ != "LoRALinear" for m in model.modules())


def test_resuming_is_exact(counting, base, tmp_path, monkeypatch):
    """With dropout on the adapters' input and a moving average: straight == split."""
    config = dict(LORA, lora_dropout=0.1, ema_decay=0.8)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(counting, straight, gpt_tiny(dropout=0.1), train_config(max_steps=12, **config),
          init=base)
    train(counting, split, gpt_tiny(dropout=0.1), train_config(max_steps=6, **config),
          init=base)
    with monkeypatch.context() as patched:     # the base's weights are read, none drawn
        patched.setattr(loop, "build_model", lambda *a: pytest.fail("a random model"))
        train(counting, split, gpt_tiny(dropout=0.1), train_config(max_steps=12, **config),
              resume=True)
    assert_same_checkpoints(straight, split, ("step-0000012", "ema"))


def test_resuming_refuses_a_base_that_moved_or_changed(counting, base, tmp_path):
    moved = tmp_path / "base"
    shutil.copytree(base, moved)
    run = tmp_path / "lora"
    train(counting, run, gpt_tiny(dropout=0.1), train_config(max_steps=4, **LORA), init=moved)
    other = tmp_path / "other"
    train(counting, other, gpt_tiny(dropout=0.1), train_config(max_steps=4, seed=7))
    shutil.rmtree(moved)
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint it started from, .*base, "
                                                         r"which is no longer there"):
        train(counting, run, gpt_tiny(dropout=0.1), train_config(max_steps=8, **LORA),
              resume=True)
    shutil.copytree(checkpoint.resolve(other), moved)
    with pytest.raises(checkpoint.CheckpointError, match="do not give its merged weights"):
        train(counting, run, gpt_tiny(dropout=0.1), train_config(max_steps=8, **LORA),
              resume=True)
    # Nor does a resumed run change what it trains.
    for changed, given in ((dict(lora_rank=8), "LoRA adapters of rank 8 on q,k,v,o,ffn"),
                           (dict(lora_targets="q,v"), "LoRA adapters of rank 4 on q,v"),
                           (dict(lora_rank=0), "every weight")):
        with pytest.raises(ConfigError, match=f"which trains LoRA adapters of rank 4 on "
                                              f"q,k,v,o,ffn; the configuration given trains "
                                              f"{given}"):
            train(counting, run, gpt_tiny(dropout=0.1),
                  train_config(max_steps=8, **{**LORA, **changed}), resume=True)
    with pytest.raises(ConfigError, match="which trains every weight; the configuration "
                                          "given trains LoRA adapters of rank 4"):
        train(counting, other, gpt_tiny(dropout=0.1), train_config(max_steps=8, **LORA),
              resume=True)


def test_a_classifier_trains_its_new_head_whole(classes, counting, tmp_path):  # noqa: F811
    """Fine-tuning an encoder with adapters: the classification head is new, so it trains
    whole beside them, as does the pooler (masked-LM pre-training leaves it as drawn),
    and both are restored with them."""
    pretrained = tmp_path / "pre"
    train(counting, pretrained, bert_tiny(), encoder_config(max_steps=10))
    config = dict(LORA, task="classify", ema_decay=0.5)
    straight, split = tmp_path / "straight", tmp_path / "split"
    model = bert_tiny(num_labels=3)
    train(classes, straight, model, encoder_config(max_steps=8, **config), init=pretrained)
    train(classes, split, model, encoder_config(max_steps=4, **config), init=pretrained)
    train(classes, split, model, encoder_config(max_steps=8, **config), resume=True)
    a, b = tensors(straight / "step-0000008"), tensors(split / "step-0000008")
    assert all(torch.equal(a[k], b[k]) for k in a)
    before = tensors(checkpoint.resolve(pretrained))
    assert "classifier.weight" not in before and a["classifier.weight"].shape == (3, 64)
    state = checkpoint.load_trainer_state(straight / "step-0000008")["optimizer"]
    assert len(state["state"]) == len(tensors(straight / "step-0000008",
                                              checkpoint.ADAPTERS)) + 4
    adapted = {f"{layer}.weight" for layer in
               checkpoint.read_lora_section(straight / "step-0000008")["layers"]}
    whole = {"pooler.weight", "pooler.bias"}
    assert adapted and all(torch.equal(a[name], before[name])
                           for name in before.keys() - adapted - whole)
    assert not torch.equal(a["pooler.weight"], before["pooler.weight"])


def test_refusals(counting, base, tmp_path, capsys):
    out = str(tmp_path / "run")
    common = ["train", "--data", str(counting), "--out", out, "--lora-rank", "4",
              "--max-steps", "2", "--max-tokens", "256"]
    assert main(common + ["--arch", "decoder", "--preset", "gpt-tiny"]) == 2
    assert "--lora-rank adapts the weights of a trained model: give --init" in \
        capsys.readouterr().err
    assert main(common + ["--init", str(base), "--lora-targets", "q,w"]) == 2
    assert "lora_targets='q,w': a comma-separated list of distinct names among q, k, v, " \
        "o, ffn (w is not one)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="with --fsdp"):
        train(counting, tmp_path / "fsdp", gpt_tiny(), train_config(max_steps=2, fsdp=True,
                                                                    **LORA), init=base)
    plain = [part for part in common if part not in ("--lora-rank", "4")]
    assert main(plain + ["--init", str(base), "--lora-base-dtype", "nf4"]) == 2
    assert "TrainConfig.lora_base_dtype='nf4' keeps a LoRA run's frozen weights: give " \
        "lora_rank (--lora-rank)" in capsys.readouterr().err


def test_the_command_line_says_what_trains_and_counts_no_weight_gradients(counting, base,
                                                                         tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(counting), "--out", str(run), "--init", str(base),
                 "--lora-rank", "2", "--lora-targets", "q,v", "--max-steps", "2",
                 "--max-tokens", "256", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    # 2 layers x (q, v) x (A of 2 x 64 + B of 64 x 2) = 1,024.
    assert "LoRA: rank 2, alpha 16 on q,v: 1,024 parameters trained" in printed
    config = gpt_tiny()
    assert training_flops(config, 2, 0, 9, weight_gradients=False) == \
        pytest.approx(2 / 3 * training_flops(config, 2, 0, 9))


def test_adapters_train_at_ten_times_the_recipes_rate(counting, base, tmp_path):
    """Unless --lr-scale says otherwise, and not again on a LoRA run's own recipe."""
    def lr_scale(run, *flags):
        assert main(["train", "--data", str(counting), "--out", str(run), "--max-steps", "1",
                     "--max-tokens", "256", *flags]) == 0
        return checkpoint.read_configs(checkpoint.resolve(run))[1].lr_scale

    recipe = checkpoint.read_configs(base)[1].lr_scale
    lora = lr_scale(tmp_path / "lora", "--init", str(base), "--lora-rank", "2")
    assert lora == pytest.approx(10 * recipe)
    assert lr_scale(tmp_path / "chosen", "--init", str(base), "--lora-rank", "2",
                    "--lr-scale", "0.3") == 0.3
    assert lr_scale(tmp_path / "again", "--init", str(tmp_path / "lora")) == lora
    assert lr_scale(tmp_path / "whole", "--init", str(base)) == recipe


@pytest.mark.parametrize("kept", ["float32", "nf4"])
def test_two_processes_train_the_adapters_as_one(counting, tmp_path, kept):
    """DistributedDataParallel leaves the frozen weights alone and averages the adapters'
    gradients: two processes at update_freq 1 end where one does at update_freq 2, the
    frozen weights kept quantized too (each process quantizes its own alike)."""
    base = tmp_path / "base"      # without dropout, whose draws differ by process
    train(counting, base, gpt_tiny(), train_config(max_steps=3))
    common = ["--data", str(counting), "--init", str(base), "--lora-rank", "4",
              "--max-tokens", "64", "--pack-length", "16", "--max-steps", "4",
              "--schedule", "noam", "--warmup-steps", "5", "--threads", "1",
              "--dtype", "float32", "--lora-base-dtype", kept]
    train_alone_at_double_update_freq(tmp_path / "one", common)
    assert_two_processes_trained_alike(tmp_path / "one", tmp_path / "two", common)
    trained, before = weights(tmp_path / "one"), weights(base)
    assert any(not torch.equal(trained[name], before[name]) for name in before)


def test_a_translation_model_adapts_self_and_cross_attention(tiny_corpus, tmp_path):
    """The encoder-decoder: adapters on both stacks and on the cross-attention, dev BLEU
    decoded through the merged decoding copy as training goes; `export peft` writes them
    for the export's cross-attention too (tests/test_peft_translation.py: PEFT's model)."""
    base, run = tmp_path / "base", tmp_path / "lora"
    train(tiny_corpus, base, translation_config(), translation_train_config(max_steps=6))
    last = train(tiny_corpus, run, translation_config(),
                 translation_train_config(max_steps=6, eval_every=3, dev_bleu_sentences=5,
                                          **LORA), init=base)
    layers = checkpoint.read_lora_section(last)["layers"]
    assert any(".cross_attn.q_proj" in name for name in layers)
    assert any(name.startswith("encoder.") for name in layers)
    records = [json.loads(line) for line in (run / LOG_NAME).read_text().splitlines()]
    assert [r for r in records if r["event"] == "dev" and "dev_bleu_greedy" in r]
    export_peft(run, tmp_path / "adapter")
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["task_type"] == "SEQ_2_SEQ_LM"
    assert "model.decoder.layers.0.encoder_attn.q_proj" in settings["target_modules"]


def test_frozen_weights_kept_in_bfloat16_train_as_in_float32(counting, base, tmp_path):
    """--lora-base-dtype bfloat16 halves the frozen weights' memory; under bfloat16
    autocast every product reads them as it read the float32 ones, so the run's adapters
    are the same bit for bit, and its checkpoints merge into the base's float32 weights
    (the same files); resuming too."""
    config = dict(LORA, dtype="bfloat16", lora_dropout=0.1, ema_decay=0.8, save_every=3)
    wide, kept, split = tmp_path / "float32", tmp_path / "bfloat16", tmp_path / "split"
    train(counting, wide, gpt_tiny(dropout=0.1), train_config(max_steps=6, **config),
          init=base)
    kept_config = train_config(max_steps=6, lora_base_dtype="bfloat16", **config)
    train(counting, kept, gpt_tiny(dropout=0.1), kept_config, init=base)
    train(counting, split, gpt_tiny(dropout=0.1), kept_config.replace(max_steps=3), init=base)
    train(counting, split, gpt_tiny(dropout=0.1), kept_config, resume=True)
    for run in (kept, split):
        assert_same_checkpoints(wide, run, ("step-0000006", "ema"))
    model = loop.empty_model(gpt_tiny(dropout=0.1))
    checkpoint.load_weights(model, base)
    lora.adapt(model, kept_config, base)
    layer = model.decoder.layers[0].ffn.linear1
    assert layer.weight.dtype == torch.bfloat16 and layer.lora_a.dtype == torch.float32
    with pytest.raises(ConfigError, match="this run trains in float32 \\(--dtype float32\\): "
                                          "give --dtype bfloat16"):
        train(counting, tmp_path / "refused", gpt_tiny(),
              kept_config.replace(dtype="float32"), init=base)


@pytest.mark.parametrize("format", ["int8", "nf4", "nf4-dq"])
def test_frozen_weights_kept_quantized_train_resume_and_merge_into_the_base(counting, base,
                                                                           tmp_path, format):
    """--lora-base-dtype int8 | nf4 (QLoRA): any dtype trains it (float32 here), the
    adapters learn, every checkpoint merges them into the base's float32 weights (its
    other weights the base's bit for bit), the parameters are counted whole, and
    resuming is exact."""
    config = dict(LORA, dtype="float32", lora_dropout=0.1, ema_decay=0.8,
                  lora_base_dtype=format)
    straight, split = tmp_path / "straight", tmp_path / "split"
    last = train(counting, straight, gpt_tiny(dropout=0.1),
                 train_config(max_steps=30, **config), init=base)
    losses = train_losses(straight)
    assert losses[-1] < 0.9 * losses[0], losses
    assert_merged_into(base, last)
    adapters = tensors(last, checkpoint.ADAPTERS)
    start = json.loads((straight / LOG_NAME).read_text().splitlines()[0])
    assert start["parameters"] == load_model(base).num_parameters() + \
        sum(tensor.numel() for tensor in adapters.values())       # as a float base's run
    train(counting, split, gpt_tiny(dropout=0.1), train_config(max_steps=15, **config),
          init=base)
    train(counting, split, gpt_tiny(dropout=0.1), train_config(max_steps=30, **config),
          resume=True)
    assert_same_checkpoints(straight, split, ("step-0000030", "ema"))
