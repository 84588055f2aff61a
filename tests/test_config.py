import dataclasses

import pytest

from transduce.config import PRESETS, ConfigError, ModelConfig, preset


def test_defaults_are_the_papers_base_model():
    c = ModelConfig()
    assert (c.d_model, c.d_ff, c.num_heads, c.head_dim) == (512, 2048, 8, 64)
    assert (c.num_encoder_layers, c.num_decoder_layers, c.dropout) == (6, 6, 0.1)
    assert (c.norm_first, c.positional, c.activation, c.tie_embeddings) == \
        (False, "sinusoidal", "relu", "all")
    assert c.kv_heads == 8


def test_big_preset():
    c = PRESETS["big"]
    assert (c.d_model, c.d_ff, c.num_heads, c.dropout) == (1024, 4096, 16, 0.3)


def test_configs_are_frozen_and_round_trip():
    c = preset("small", src_vocab_size=8000, tgt_vocab_size=8000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 3
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_unknown_fields_and_presets_are_named():
    with pytest.raises(ConfigError, match="d_modle"):
        ModelConfig.from_dict({"d_modle": 3})
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


def test_rotary_needs_even_heads():
    with pytest.raises(ConfigError, match="even head size"):
        ModelConfig(d_model=24, num_heads=8, positional="rotary")
