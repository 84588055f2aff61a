"""configs/paper-base.toml and configs/paper-big.toml: the paper's recipe, loadable as
`transduce train --config` loads them."""

from pathlib import Path

import pytest
import torch

from transduce.cli.options import read_config_file
from transduce.config import TrainConfig, preset, train_recipe
from transduce.model import build_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name, steps, d_model, dropout, keep, millions", [
    ("paper-base", 100_000, 512, 0.1, 5, (60, 66)),
    ("paper-big", 300_000, 1024, 0.3, 20, (205, 215)),
])
def test_the_paper_configs_hold_the_papers_recipe(name, steps, d_model, dropout, keep, millions):
    values = read_config_file(CONFIGS / f"{name}.toml")
    model = preset(values["preset"], src_vocab_size=37000, tgt_vocab_size=37000,
                   **values["model"])
    train = TrainConfig(**{**train_recipe(values["preset"]), **values["train"]})
    assert (model.d_model, model.dropout, model.num_encoder_layers, model.norm_first,
            model.tie_embeddings) == (d_model, dropout, 6, False, "all")
    assert train.max_steps == steps and train.warmup_steps == 4000 and train.schedule == "noam"
    assert (train.adam_beta1, train.adam_beta2, train.adam_eps) == (0.9, 0.98, 1e-9)
    assert train.label_smoothing == 0.1 and train.keep_last == keep
    assert train.max_tokens * 8 * train.update_freq == 25_000     # per step, over 8 processes
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(model).parameters())
    assert millions[0] * 1e6 < parameters < millions[1] * 1e6, parameters
