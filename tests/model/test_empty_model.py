"""empty_model: a model built without its random initialisation, for weights loaded next.
Once loaded it is the model build_model makes, for every shape and every position kind;
ties hold; fixed tables are computed as always; the process is left as it was."""

import pytest
import torch

import transduce.model

from transduce import checkpoint
from transduce.config import ConfigError, preset
from transduce.model import build_model, empty_model, load_model

V = 40
CONFIGS = {
    "transformer": preset("tiny", src_vocab_size=V, tgt_vocab_size=V),
    "fairseq-pre-norm": preset("tiny", src_vocab_size=V, tgt_vocab_size=V, norm_first=True,
                               positional="fairseq"),
    "learned-untied": preset("tiny", src_vocab_size=V, tgt_vocab_size=V, positional="learned",
                             tie_embeddings="none"),
    "alibi": preset("tiny", src_vocab_size=V, tgt_vocab_size=V, positional="alibi"),
    "t5": preset("tiny", src_vocab_size=V, tgt_vocab_size=V, positional="t5"),
    "rnn-lstm": preset("tiny", src_vocab_size=V, tgt_vocab_size=V, arch="rnn-luong",
                       rnn_cell="lstm"),
    "llama-rope-scaled": preset("llama-tiny", src_vocab_size=V, tgt_vocab_size=V,
                                num_kv_heads=2, rope_scaling="llama3"),
    "gpt": preset("gpt-tiny", src_vocab_size=V, tgt_vocab_size=V),
    "bert": preset("bert-tiny", src_vocab_size=V, tgt_vocab_size=V, num_labels=3),
}


def outputs(model, config):
    torch.manual_seed(1)
    ids = torch.randint(4, V, (2, 7))
    with torch.no_grad():
        if config.arch in ("decoder", "encoder"):
            result = model(ids)
            return result if isinstance(result, torch.Tensor) else result[0]
        return model(ids, ids[:, :5])


@pytest.mark.parametrize("name", CONFIGS)
def test_loaded_it_is_the_model_build_model_makes(name):
    config = CONFIGS[name]
    torch.manual_seed(0)
    built = build_model(config).eval()
    empty = empty_model(config)
    empty.load_state_dict(built.state_dict())
    empty.eval()
    assert empty.num_parameters() == built.num_parameters()
    assert len(list(empty.parameters())) == len(list(built.parameters()))   # ties kept
    ours, theirs = dict(empty.named_buffers()), dict(built.named_buffers())
    assert ours.keys() == theirs.keys()
    for key, buffer in theirs.items():                 # fixed tables computed as always
        assert torch.equal(ours[key], buffer), key
    assert torch.equal(outputs(empty, config), outputs(built, config))


def test_a_tied_matrix_stays_one_parameter():
    model = empty_model(CONFIGS["transformer"])
    shared = model.output_proj.weight
    assert model.encoder.embed.embedding.weight is shared
    assert model.decoder.embed.embedding.weight is shared


def test_it_draws_no_random_numbers_and_leaves_the_process_as_it_found_it():
    before = torch.get_rng_state()
    model = empty_model(CONFIGS["transformer"])
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch.empty(1).device.type == "cpu"
    weight = torch.nn.Linear(4, 4).weight         # initialisation works again afterwards
    assert weight.abs().sum() > 0 and model.output_proj.weight.device.type == "cpu"


def test_a_failed_build_leaves_the_process_as_it_found_it(monkeypatch):
    def failing(config):
        torch.nn.Linear(4, 4)
        raise ConfigError("no")

    monkeypatch.setattr(transduce.model, "build_model", failing)
    with pytest.raises(ConfigError):
        empty_model(CONFIGS["transformer"])
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch.empty(1).device.type == "cpu"


def test_on_the_meta_device_it_counts_without_allocating():
    config = preset("big", src_vocab_size=37000, tgt_vocab_size=37000)
    model = empty_model(config, "meta")
    assert all(parameter.is_meta for parameter in model.parameters())
    assert model.num_parameters() == build_model(config).num_parameters()


def test_load_model_gives_back_the_saved_weights_tied(tmp_path, tiny_corpus):
    torch.manual_seed(0)
    saved = build_model(CONFIGS["fairseq-pre-norm"]).eval()
    checkpoint.save(tmp_path / "ckpt", saved, None, tiny_corpus / "spm.model")
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.output_proj.weight is loaded.encoder.embed.embedding.weight
    for (name, ours), (_, theirs) in zip(loaded.state_dict().items(),
                                         saved.state_dict().items()):
        assert torch.equal(ours, theirs), name
    assert torch.equal(outputs(loaded, saved.config), outputs(saved, saved.config))


def test_an_untied_file_does_not_fill_a_tied_model(tmp_path, tiny_corpus):
    """Three matrices cannot fill one: the last would silently win."""
    untied = build_model(CONFIGS["learned-untied"])
    checkpoint.save(tmp_path / "ckpt", untied, None, tiny_corpus / "spm.model")
    tied = empty_model(CONFIGS["learned-untied"].replace(tie_embeddings="all"))
    with pytest.raises(checkpoint.CheckpointError,
                       match="decoder.embed.embedding.weight and encoder.embed.embedding.weight "
                             "differ, but .* ties them"):
        checkpoint.load_weights(tied, tmp_path / "ckpt")
    with torch.no_grad():                  # the same values under each name: one matrix
        untied.encoder.embed.embedding.weight.copy_(untied.output_proj.weight)
        untied.decoder.embed.embedding.weight.copy_(untied.output_proj.weight)
    checkpoint.save(tmp_path / "ckpt", untied, None, tiny_corpus / "spm.model")
    checkpoint.load_weights(tied, tmp_path / "ckpt")
    assert torch.equal(tied.output_proj.weight, untied.output_proj.weight)


def test_a_tied_name_the_file_lacks_is_missing(tmp_path, tiny_corpus):
    tied = build_model(CONFIGS["transformer"])
    checkpoint.save(tmp_path / "ckpt", tied, None, tiny_corpus / "spm.model")
    untied = empty_model(CONFIGS["transformer"].replace(tie_embeddings="none"))
    with pytest.raises(checkpoint.CheckpointError, match="missing .*embed.embedding.weight"):
        checkpoint.load_weights(untied, tmp_path / "ckpt")


def test_large_finite_weights_are_not_taken_for_infinite_ones(tmp_path, tiny_corpus):
    """The finiteness check sums each weight first; a sum that overflows is looked at
    element by element, so only a real infinity or NaN is refused."""
    model = build_model(CONFIGS["transformer"])
    with torch.no_grad():
        model.encoder.layers[0].ffn.linear1.weight.fill_(3e38)   # its sum is inf
    checkpoint.save(tmp_path / "ckpt", model, None, tiny_corpus / "spm.model")
    load_model(tmp_path / "ckpt")
    with torch.no_grad():
        model.decoder.layers[1].ffn.linear2.bias[3] = float("-inf")
    checkpoint.save(tmp_path / "ckpt", model, None, tiny_corpus / "spm.model")
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"not finite .* in decoder.layers.1.ffn.linear2.bias:"):
        load_model(tmp_path / "ckpt")
