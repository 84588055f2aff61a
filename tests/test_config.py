import dataclasses
import re

import pytest
import torch

from transduce.config import PRESETS, ConfigError, ModelConfig, TrainConfig, preset


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


def test_full_attention_layers_read_from_a_config_file_round_trip():
    """config.json and TOML give a list; the configuration holds a tuple, equal after a
    round trip, and names each layer's attention."""
    c = ModelConfig.from_dict({**_SLIDING_LM, "full_attention_layers": [1, 4]})
    assert c.full_attention_layers == (1, 4) and ModelConfig.from_dict(c.to_dict()) == c
    assert [c.layer_attention_type(i) for i in range(6)] == \
        ["sliding", "softmax", "sliding", "sliding", "softmax", "sliding"]


def test_rotary_needs_even_heads():
    with pytest.raises(ConfigError, match="even head size"):
        ModelConfig(d_model=24, num_heads=8, positional="rotary")


_SLIDING_LM = {"arch": "decoder", "attention_type": "sliding", "src_vocab_size": 10,
               "tgt_vocab_size": 10}


@pytest.mark.parametrize("config_type,changes,message", [
    (TrainConfig, {"max_minutes": float("nan")}, "max_minutes=nan: must be a finite number"),
    (TrainConfig, {"lr_scale": float("inf")}, "lr_scale=inf"),
    (TrainConfig, {"threads": -1}, "threads=-1: must be >= 0"),
    (TrainConfig, {"adam_beta2": 1.0}, "adam_beta2=1.0: must be in [0, 1)"),
    (TrainConfig, {"adam_eps": 0.0}, "adam_eps=0.0: must be positive"),
    (TrainConfig, {"dev_bleu_sentences": -2}, "dev_bleu_sentences=-2"),
    (ModelConfig, {"dropout": float("nan")}, "dropout=nan"),
    (ModelConfig, {"layer_norm_eps": -1e-5}, "layer_norm_eps=-1e-05: must be positive"),
    # a config file's strings and numbers are not switches
    (ModelConfig, {"bias": "false"}, "bias='false': must be true or false"),
    (TrainConfig, {"compile": 0}, "compile=0: must be true or false"),
    (TrainConfig, {"seed": -1}, "seed=-1: must be an integer from 0 to 4294967295"),
    (TrainConfig, {"seed": 2 ** 64}, "seed=18446744073709551616"),
    (ModelConfig, {"output_bias": True, "arch": "encoder"},
     "output_bias=True applies to arch='transformer' and 'decoder', not arch='encoder'"),
    (ModelConfig, {"head_size": 0}, "head_size=0: must be a positive integer"),
    # DistilBERT's: no segment types, a ReLU pooler; on an encoder only
    (ModelConfig, {"type_vocab_size": -1}, "type_vocab_size=-1: must be an integer >= 0"),
    (ModelConfig, {"num_labels": 1.5}, "num_labels=1.5: must be an integer >= 0"),
    (ModelConfig, {"pooler_activation": "sigmoid", "arch": "encoder"},
     "pooler_activation='sigmoid': choose one of tanh, relu, gelu"),
    (ModelConfig, {"pooler_activation": "relu"},
     "pooler_activation='relu' applies to arch='encoder', not arch='transformer'"),
    # ELECTRA-small's embeddings, narrower than the layers
    (ModelConfig, {"embedding_size": 32},
     "embedding_size=32 sets an encoder-only model's embeddings narrower or wider than "
     "d_model=512 (arch='transformer')"),
    (ModelConfig, {"embedding_size": 512, "arch": "encoder"}, "leave it unset"),
    (ModelConfig, {"embedding_size": 0, "arch": "encoder"},
     "embedding_size=0: must be a positive integer"),
    # ModernBERT's: heads through a prediction head, mean pooling, no first norm
    (ModelConfig, {"prediction_head": True},
     "prediction_head=True applies to arch='encoder', not arch='transformer'"),
    (ModelConfig, {"classifier_pooling": "max", "arch": "encoder"},
     "classifier_pooling='max': choose one of cls, mean"),
    (ModelConfig, {"classifier_pooling": "mean", "arch": "decoder", "src_vocab_size": 10,
                   "tgt_vocab_size": 10}, "classifier_pooling='mean' applies to arch='encoder'"),
    (ModelConfig, {"first_attention_norm": False, "arch": "encoder"},
     "first_attention_norm=False leaves out a pre-norm layer's norm; set norm_first=True"),
    (ModelConfig, {"first_attention_norm": False, "norm_first": True},
     "first_attention_norm=False applies to arch='encoder'"),
    (ModelConfig, {"norm_bias": False, "norm": "rms"},
     "norm_bias=False drops LayerNorm's bias; norm='rms' has none"),
    (ModelConfig, {"question_answering": True, "arch": "encoder", "num_labels": 3},
     "question_answering=True is a head of 2 outputs (start, end) over each token"),
    (ModelConfig, {"question_answering": True, "num_labels": 2},
     "question_answering=True applies to arch='encoder'"),
    (ModelConfig, {"token_classifier": True, "arch": "decoder", "src_vocab_size": 10,
                   "tgt_vocab_size": 10}, "token_classifier=True applies to arch='encoder'"),
    (ModelConfig, {"d_model": 100, "num_heads": 8},
     "d_model=100 is not divisible by num_heads=8; set head_size for heads of another size"),
    (ModelConfig, {"tie_embeddings": "embeddings", "arch": "decoder"},
     "tie_embeddings='embeddings' shares the source and target embeddings of an "
     "encoder-decoder; arch='decoder' has one embedding"),
    (ModelConfig, {"tie_embeddings": "embeddings", "tgt_vocab_size": 100},
     "tie_embeddings='embeddings' needs one shared vocabulary"),
    # local and full layers (Gemma's), sandwich norms
    (ModelConfig, {"full_attention_layers": (1,), "arch": "decoder", "src_vocab_size": 10,
                   "tgt_vocab_size": 10},
     "full_attention_layers=[1] mixes full layers into a sliding stack: it needs "
     "arch 'decoder' or 'encoder' and attention_type='sliding', not arch='decoder' and "
     "attention_type='softmax'"),
    (ModelConfig, {"full_attention_layers": (1,), "attention_type": "sliding"},
     "it needs arch 'decoder' or 'encoder'"),
    # an encoder's full layers are counted among its own (ModernBERT's)
    (ModelConfig, {"full_attention_layers": (0, 3), "attention_type": "sliding",
                   "arch": "encoder", "num_encoder_layers": 3},
     "must be increasing layer numbers from 0 to num_encoder_layers - 1 = 2"),
    (ModelConfig, {"full_attention_layers": (3, 1), **_SLIDING_LM},
     "full_attention_layers=[3, 1]: must be increasing layer numbers from 0 to "
     "num_decoder_layers - 1 = 5"),
    (ModelConfig, {"full_attention_layers": (6,), **_SLIDING_LM}, "from 0 to"),
    (ModelConfig, {"full_attention_layers": (1, 1), **_SLIDING_LM}, "increasing"),
    (ModelConfig, {"full_attention_layers": ("1",), **_SLIDING_LM},
     "full_attention_layers=['1']: must be a list of layer numbers"),
    (ModelConfig, {"local_rope_base": 100.0, **_SLIDING_LM, "positional": "rotary"},
     "local_rope_base=100.0 sets the rotary positions of sliding layers among full ones; "
     "it needs positional='rotary' and full_attention_layers"),
    (ModelConfig, {"local_rope_base": 100.0, "full_attention_layers": [2], **_SLIDING_LM},
     "it needs positional='rotary'"),
    (ModelConfig, {"local_rope_base": -1.0, "full_attention_layers": [2], **_SLIDING_LM,
                   "positional": "rotary"}, "local_rope_base=-1.0: must be positive"),
    (ModelConfig, {"sandwich_norm": True},
     "sandwich_norm=True adds norms to pre-norm layers; set norm_first=True"),
    # GPT-NeoX's partial rotary positions and parallel residuals
    (ModelConfig, {"rotary_dims": 16},
     "rotary_dims=16 rotates part of each head; positional='sinusoidal' has no rotary "
     "positions"),
    (ModelConfig, {"rotary_dims": 15, "positional": "rotary"},
     "rotary_dims=15: must be an even number of a head's features, from 2 to head_dim=64"),
    (ModelConfig, {"rotary_dims": 66, "positional": "rotary"}, "from 2 to head_dim=64"),
    (ModelConfig, {"rotary_dims": 0, "positional": "rotary"}, "from 2 to head_dim=64"),
    (ModelConfig, {"rotary_dims": True, "positional": "rotary"}, "from 2 to head_dim=64"),
    (ModelConfig, {"parallel_residual": True, "norm_first": True},
     "parallel_residual=True sums a decoder-only model's attention and feed-forward network "
     "over one input: it needs arch='decoder' and norm_first=True without sandwich_norm, "
     "not arch='transformer', norm_first=True, sandwich_norm=False"),
    (ModelConfig, {"parallel_residual": True, **_SLIDING_LM, "norm_first": False},
     "not arch='decoder', norm_first=False"),
    (ModelConfig, {"parallel_residual": True, **_SLIDING_LM, "norm_first": True,
                   "sandwich_norm": True}, "sandwich_norm=True"),
    (ModelConfig, {"shared_norm": True, **_SLIDING_LM, "norm_first": True},
     "shared_norm=True lets a parallel layer's feed-forward network read the attention's "
     "norm; set parallel_residual=True"),
    # OLMo 2's norms
    (ModelConfig, {"qk_norm_across_heads": True, "qk_norm": True},
     "qk_norm_across_heads=True normalizes a decoder-only model's queries and keys over all "
     "heads: it needs arch='decoder' and qk_norm=True, not arch='transformer', qk_norm=True"),
    (ModelConfig, {"qk_norm_across_heads": True, **_SLIDING_LM}, "qk_norm=False"),
    (ModelConfig, {"input_norms": False, **_SLIDING_LM, "norm_first": True},
     "input_norms=False leaves a decoder-only model's sub-layers only their output norms: "
     "it needs arch='decoder' and sandwich_norm=True, not arch='decoder', "
     "sandwich_norm=False"),
    # Gemma 2's soft caps
    (ModelConfig, {"attention_softcap": 0.0, **_SLIDING_LM},
     "attention_softcap=0.0: must be a positive number"),
    (ModelConfig, {"logit_softcap": True, **_SLIDING_LM},
     "logit_softcap=True: must be a positive number"),
    (ModelConfig, {"logit_softcap": float("inf"), **_SLIDING_LM}, "must be a finite number"),
    (ModelConfig, {"attention_softcap": 50.0},
     "attention_softcap=50.0 applies to arch='decoder', not arch='transformer'"),
    (ModelConfig, {"attention_softcap": 50.0, **_SLIDING_LM, "attention_type": "linear"},
     "attention_softcap caps softmax scores; attention_type='linear' has none to cap"),
    (ModelConfig, {"attention_softcap": 50.0, **_SLIDING_LM, "attention_impl": "flash"},
     "attention_softcap needs the scores written out: attention_impl 'sdpa' or 'naive', "
     "not 'flash'"),
    # DeBERTa's disentangled positions
    (ModelConfig, {"positional": "disentangled"},
     "positional='disentangled' (DeBERTa's) applies to arch='encoder' with "
     "attention_type='softmax', not arch='transformer' and attention_type='softmax'"),
    (ModelConfig, {"positional": "disentangled", "arch": "encoder", "attention_type": "sliding"},
     "not arch='encoder' and attention_type='sliding'"),
    (ModelConfig, {"positional": "disentangled", "arch": "encoder", "attention_impl": "flash"},
     "which only the written-out kernels take: attention_impl 'sdpa' or 'naive', not 'flash'"),
    (ModelConfig, {"positional": "disentangled", "arch": "encoder", "position_buckets": 7},
     "position_buckets=7: must be an even number of at least 4"),
    (ModelConfig, {"positional": "disentangled", "arch": "encoder", "position_buckets": True},
     "position_buckets=True: must be an even number"),
    (ModelConfig, {"positional": "disentangled", "arch": "encoder", "max_positions": 129},
     "max_positions=129: the distance where the logarithmic buckets of "
     "positional='disentangled' end must exceed position_buckets / 2 + 1 = 129"),
    (ModelConfig, {"positional": "disentangled", "arch": "encoder",
                   "max_relative_positions": 100},
     "max_relative_positions=100: the distance"),
])
def test_out_of_range_and_non_finite_values_are_refused(config_type, changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_type(**changes)


def test_heads_of_another_width_and_embeddings_shared_apart_from_the_output():
    """head_size: T5 v1.1 small's 6 heads of 64 in a model of 512; tie_embeddings
    "embeddings": one matrix for both sides' embeddings, the output its own."""
    from transduce.model import build_model

    c = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=64, num_heads=3, head_size=16,
                    d_ff=32, num_encoder_layers=1, num_decoder_layers=1,
                    tie_embeddings="embeddings")
    assert c.head_dim == 16 and c.shares_embeddings
    model = build_model(c)
    attention = model.decoder.layers[0].cross_attn
    assert (attention.q_proj.out_features, attention.out_proj.in_features) == (48, 48)
    assert model.encoder.embed.embedding is model.decoder.embed.embedding
    assert model.output_proj.weight is not model.decoder.embed.embedding.weight
    assert model(torch.randint(4, 40, (2, 5)), torch.randint(4, 40, (2, 3))).shape == (2, 3, 40)


def test_rope_scaling_needs_rotary_positions_and_ordered_llama3_factors():
    with pytest.raises(ConfigError, match="rope_scaling='linear' scales rotary positions; "
                                          "positional='learned'"):
        preset("gpt-tiny", rope_scaling="linear")
    with pytest.raises(ConfigError, match="rope_high_freq_factor=1.0 > rope_low_freq_factor"):
        preset("llama-tiny", rope_scaling="llama3", rope_high_freq_factor=1.0)
    assert preset("llama-tiny", rope_scaling="llama3").rope_factor == 8.0
