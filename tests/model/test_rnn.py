"""The RNN encoder-decoders: their equations against a step-by-step reference, cached
decoding, batching, reordering, and search through the shared code."""

import pytest
import torch

from transduce.config import ConfigError, preset
from transduce.decode.search import beam_search, greedy_search
from transduce.model import RNNEncoderDecoder, build_model
from tests.model.test_transformer import assert_reorder_follows_the_index, padded

# (arch, cell, config changes): both attentions, both cells, and Luong's three variants
# of seed 002 (general or dot scores, with and without input feeding).
ARCHS = [("rnn-bahdanau", "gru", {}), ("rnn-luong", "gru", {}), ("rnn-bahdanau", "lstm", {}),
         ("rnn-luong", "lstm", {}), ("rnn-luong", "gru", {"luong_score": "dot"}),
         ("rnn-luong", "gru", {"input_feeding": True}),
         ("rnn-luong", "lstm", {"luong_score": "dot", "input_feeding": True})]


def rnn(arch, cell="gru", **changes):
    config = preset("tiny", src_vocab_size=20, tgt_vocab_size=20, arch=arch, rnn_cell=cell,
                    **changes)
    return build_model(config).eval()


def reference_logits(model, src, tgt):
    """The module docstring's equations, one sentence and one step at a time, with the
    encoder run on the unpadded source."""
    rows = []
    for b in range(src.shape[0]):
        source = src[b][src[b] != 0][None]                                 # (1, S_b)
        memory, _ = model.encoder(model.src_embedding(source))             # (1, S_b, C)
        start = torch.tanh(model.bridge(memory.mean(dim=1)))[None].repeat(
            model.config.num_decoder_layers, 1, 1)
        hidden = (start, torch.zeros_like(start)) if model.config.rnn_cell == "lstm" else start
        logits, feed = [], torch.zeros(1, 1, memory.shape[2])
        for t in range(tgt.shape[1]):
            y = model.tgt_embedding(tgt[b, t])[None, None]                 # (1, 1, C)
            top = (hidden[0] if isinstance(hidden, tuple) else hidden)[-1]
            if model.additive:
                att = model.attention
                scores = att.score(torch.tanh(att.query_proj(top)[:, None] + att.key_proj(memory)))
                context = torch.softmax(scores.squeeze(-1), -1)[:, None] @ memory
                state, hidden = model.decoder(torch.cat([y, context], -1), hidden)
                features = torch.cat([state, context, y], -1)
            else:
                fed = torch.cat([y, feed], -1) if model.config.input_feeding else y
                state, hidden = model.decoder(fed, hidden)
                keys = memory if model.config.luong_score == "dot" else \
                    model.attention.key_proj(memory)
                context = torch.softmax(state @ keys.transpose(1, 2), -1) @ memory
                features = torch.cat([context, state], -1)
            feed = torch.tanh(model.readout(features))
            logits.append(model.output_proj(feed))
        rows.append(torch.cat(logits, dim=1))
    return torch.cat(rows)


@pytest.mark.parametrize("arch,cell,changes", ARCHS)
def test_forward_follows_the_equations_with_padding(arch, cell, changes):
    model = rnn(arch, cell, **changes)
    src, tgt = padded([7, 3, 5]), padded([4, 4, 4])
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt), reference_logits(model, src, tgt),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,cell,changes", ARCHS)
def test_step_by_step_decoding_equals_the_full_pass(arch, cell, changes):
    model = rnn(arch, cell, **changes)
    src, tgt = padded([7, 3, 5]), padded([6, 6, 6])
    with torch.no_grad():
        full = model(src, tgt)
        state = model.prefill(src, max_len=8)
        steps = [model.decode_step(tgt[:, :2], state)]
        steps += [model.decode_step(tgt[:, t:t + 1], state) for t in range(2, 6)]
        size = state.nbytes
        model.decode_step(tgt[:, :1], state)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert state.length == 7 and state.nbytes == size  # no cache grows with the output


@pytest.mark.parametrize("arch,cell,changes", ARCHS)
def test_reorder_follows_the_index(arch, cell, changes):
    assert_reorder_follows_the_index(rnn(arch, cell, **changes))


@pytest.mark.parametrize("arch,changes", [("rnn-bahdanau", {}), ("rnn-luong", {}),
                                          ("rnn-luong", {"input_feeding": True})])
def test_batched_search_equals_one_sentence_at_a_time(arch, changes):
    model = rnn(arch, **changes)
    src = padded([7, 2, 5, 4])
    batched = beam_search(model, src, bos_id=1, eos_id=2, beam=3, max_len=9)
    greedy = greedy_search(model, src, bos_id=1, eos_id=2, max_len=9)
    for b, length in enumerate([7, 2, 5, 4]):
        alone = beam_search(model, src[b:b + 1, :length], bos_id=1, eos_id=2, beam=3, max_len=9)
        assert alone[0][0].tokens == batched[b][0].tokens
        assert alone[0][0].score == pytest.approx(batched[b][0].score, abs=1e-5)
    beam_one = beam_search(model, src, bos_id=1, eos_id=2, beam=1, max_len=9)
    for b in range(4):
        tokens = greedy[b].tolist()
        tokens = tokens[:tokens.index(2)] if 2 in tokens else tokens
        assert beam_one[b][0].tokens == [t for t in tokens if t != 0]


def test_tying_and_sizes():
    model = rnn("rnn-luong")
    assert isinstance(model, RNNEncoderDecoder)
    assert model.output_proj.weight is model.src_embedding.weight is model.tgt_embedding.weight
    assert model.encoder.hidden_size == 32 and model.encoder.bidirectional
    untied = rnn("rnn-luong", tie_embeddings="none")
    assert untied.num_parameters() == model.num_parameters() + 2 * 20 * 64
    assert rnn("rnn-luong", luong_score="dot").num_parameters() == model.num_parameters() - 64 * 64
    fed = rnn("rnn-luong", input_feeding=True)   # the decoder's input grows by C per layer-0 gate
    gates = 3 * 64   # GRU
    assert fed.num_parameters() == model.num_parameters() + gates * 64


def test_rnn_configs_refuse_what_does_not_apply():
    with pytest.raises(ConfigError, match="attention_type"):
        preset("tiny", src_vocab_size=20, tgt_vocab_size=20, arch="rnn-luong",
               attention_type="linear")
    with pytest.raises(ConfigError, match="rnn_cell"):
        preset("tiny", src_vocab_size=20, tgt_vocab_size=20, arch="rnn-luong", rnn_cell="elman")
    with pytest.raises(ValueError, match="int8"):
        rnn("rnn-luong").prefill(padded([3]), 5, cache_dtype=torch.int8)
    with pytest.raises(ConfigError, match="input_feeding=True applies to arch='rnn-luong'"):
        preset("tiny", src_vocab_size=20, tgt_vocab_size=20, arch="rnn-bahdanau",
               input_feeding=True)
    with pytest.raises(ConfigError, match="luong_score"):
        preset("tiny", src_vocab_size=20, tgt_vocab_size=20, arch="rnn-luong", luong_score="concat")


@pytest.mark.parametrize("arch,cell,changes", ARCHS)
def test_unprojected_forward_is_what_the_output_projection_maps_to_logits(arch, cell, changes):
    model = rnn(arch, cell, **changes).eval()
    src, tgt = padded([7, 3]), padded([4, 4])
    with torch.no_grad():
        torch.testing.assert_close(model.output_proj(model(src, tgt, project=False)),
                                   model(src, tgt))
