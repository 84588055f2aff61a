"""MHA -> GQA / MQA conversion by mean-pooling key/value heads, and uptraining."""

import json
from pathlib import Path

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError
from transduce.model import Transformer
from transduce.model.convert import convert_kv_heads, pool_heads
from transduce.train.schedule import budget_lr, noam_lr
from tests.model.test_transformer import padded, tiny


def test_pool_heads_averages_each_group_of_heads():
    heads, dim, width = 4, 3, 5
    weight = torch.randn(heads * dim, width)
    pooled = pool_heads(weight, heads, 2)
    per_head = weight.view(heads, dim, width)
    expected = torch.cat([(per_head[0] + per_head[1]) / 2, (per_head[2] + per_head[3]) / 2])
    torch.testing.assert_close(pooled, expected)
    torch.testing.assert_close(pool_heads(weight[:, 0], heads, 1), per_head[:, :, 0].mean(0))


def test_as_many_groups_as_heads_is_the_identity():
    model = Transformer(tiny()).eval()
    converted = convert_kv_heads(model, model.config.num_heads)
    src, tgt = padded([5, 3]), padded([4, 4])
    with torch.no_grad():
        torch.testing.assert_close(converted(src, tgt), model(src, tgt), rtol=0, atol=0)


@pytest.mark.parametrize("groups", [2, 1])
def test_converted_model_pools_heads_and_its_cache_shrinks(groups):
    model = Transformer(tiny()).eval()
    model.languages = ("es", "en")
    converted = convert_kv_heads(model, groups)
    assert converted.config.kv_heads == groups and converted.languages == ("es", "en")
    layer, original = converted.decoder.layers[0], model.decoder.layers[0]
    for name in ("k_proj", "v_proj"):
        for attention in ("self_attn", "cross_attn"):
            ours = getattr(getattr(layer, attention), name).weight
            theirs = getattr(getattr(original, attention), name).weight
            torch.testing.assert_close(ours, pool_heads(theirs, 4, groups))
    torch.testing.assert_close(converted.decoder.layers[1].ffn.linear1.weight,
                               model.decoder.layers[1].ffn.linear1.weight)
    src = padded([5, 3])
    mha_bytes = model.prefill(src, max_len=10).nbytes
    assert converted.prefill(src, max_len=10).nbytes * (4 // groups) == mha_bytes
    with torch.no_grad():  # the converted model is a different, but working, model
        assert torch.isfinite(converted(src, padded([3, 3]))).all()


def test_conversion_refuses_grouped_or_rnn_sources():
    with pytest.raises(ConfigError, match="already has num_kv_heads=2"):
        convert_kv_heads(Transformer(tiny(num_kv_heads=2)), 1)
    with pytest.raises(ConfigError, match="num_kv_heads=3"):
        convert_kv_heads(Transformer(tiny()), 3)


def test_convert_kv_then_uptrain_five_percent(tiny_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_corpus), "--out", str(run), "--preset", "tiny",
                 "--max-steps", "40", "--max-tokens", "256", "--save-every", "20",
                 "--warmup-steps", "10", "--eval-every", "1000"]) == 0
    assert main(["average", str(run), "--last", "2", "--out", str(run / "average")]) == 0
    assert checkpoint.trained_steps(run / "average") == 40
    gqa = tmp_path / "gqa"
    assert main(["convert-kv", str(run / "average"), "--kv-heads", "2", "--out", str(gqa)]) == 0
    assert checkpoint.read_configs(gqa)[0].kv_heads == 2
    assert checkpoint.trained_steps(gqa) == 40
    uptrained = tmp_path / "uptrained"
    capsys.readouterr()
    assert main(["train", "--data", str(tiny_corpus), "--out", str(uptrained), "--init", str(gqa),
                 "--max-tokens", "256", "--eval-every", "1000"]) == 0
    assert "trained 40 steps" in capsys.readouterr().out
    log = [json.loads(line) for line in (uptrained / "log.jsonl").read_text().splitlines()]
    start = log[0]
    assert start["train"]["max_steps"] == 2 and start["train"]["schedule_offset"] == 40
    assert start["model"]["num_kv_heads"] == 2
    assert checkpoint.list_checkpoints(uptrained)[-1].name == "step-0000002"
    # The original recipe (warmup 10) and its schedule, continued from step 40.
    assert start["train"]["warmup_steps"] == 10 and start["train"]["max_tokens"] == 256
    last_lr = [r["lr"] for r in log if r.get("event") == "train"][-1]
    assert last_lr == pytest.approx(noam_lr(42, 64, 10))
    assert main(["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "x"), "--init",
                 str(gqa), "--d-model", "32"]) == 2
    assert "cannot change --d-model" in capsys.readouterr().err


def test_uptraining_a_budget_run_warms_up_again_and_says_so(tiny_corpus, tmp_path, capsys):
    """A budget schedule ends at rate 0, so uptraining starts its own, over its own steps."""
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_corpus), "--out", str(run), "--preset", "tiny",
                 "--max-steps", "20", "--max-tokens", "256", "--schedule", "budget",
                 "--warmup-fraction", "0.5", "--warmup-steps", "10",
                 "--eval-every", "1000"]) == 0
    capsys.readouterr()
    uptrained = tmp_path / "uptrained"
    assert main(["train", "--data", str(tiny_corpus), "--out", str(uptrained), "--init",
                 str(run / "step-0000020"), "--max-tokens", "256", "--eval-every", "1000",
                 "--uptrain-fraction", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "trained 20 steps; 4 more (0.2 of them); the budget schedule starts again" in out
    assert "warmup over 0.5 of it" in out and "continues" not in out
    lines = (uptrained / "log.jsonl").read_text().split("\n")
    rates = [r["lr"] for r in map(json.loads, filter(None, lines)) if r.get("event") == "train"]
    peak = (64 * 10) ** -0.5
    assert rates[-1] == pytest.approx(budget_lr(3 / 4, peak, 0.5))



def test_the_uptraining_plan_names_the_checkpoints_steps_whatever_the_offset():
    from transduce.cli.train import uptraining_plan
    from transduce.config import TrainConfig

    plan = uptraining_plan(Path("run"), TrainConfig(schedule="noam", schedule_offset=0),
                           {"schedule_offset": 40}, 0.05)
    assert "trained 40 steps; the noam schedule continues from step 1" in plan
