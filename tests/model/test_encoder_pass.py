"""The written-out encoder layers (model/encoder_pass.py) against the modules: the same
memory to the bit, for every layout they cover; the others are left to the modules."""

import pytest
import torch

from transduce.config import preset
from transduce.model import Transformer, build_model
from transduce.model.encoder_pass import EncoderPass
from transduce.model.packed import decoding_copy, packing_available
from tests.model.test_decoder_step import copy_for_decoding
from tests.model.test_transformer import padded, tiny

VOCAB = 20


def _assert_written_out_pass_is_exact(encoder, run, scripted: bool) -> None:
    """run()'s outputs with the written-out pass (compiled or not) equal the modules'."""
    fast = encoder.fast_pass
    assert fast is not None
    encoder.fast_pass = EncoderPass.build(encoder, script=scripted)
    try:
        # Several passes of new shapes: TorchScript's executor re-optimizes after a few.
        written = run()
        assert encoder.fast_pass.is_scripted == scripted
        encoder.fast_pass = None
        plain = run()
    finally:
        encoder.fast_pass = fast
    assert all(torch.equal(a, b) for a, b in zip(written, plain, strict=True))


@pytest.mark.parametrize("changes", [
    {}, {"norm_first": False}, {"activation": "gelu", "bias": False},
    {"num_kv_heads": 1, "positional": "learned"}, {"scale_embeddings": False},
    {"gated_ffn": True, "activation": "silu", "norm": "rms"}, {"qk_norm": True},
    {"positional": "t5", "norm": "rms", "bias": False, "head_size": 8}, {"positional": "alibi"},
    {"embedding_norm": True, "norm_first": True, "positional": "learned"},
])
@pytest.mark.parametrize("packed,int8", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("scripted", [True, False])
def test_the_written_out_layers_give_the_modules_memory(changes, packed, int8, scripted,
                                                        monkeypatch):
    torch.manual_seed(0)
    model = copy_for_decoding(Transformer(tiny(**changes)).eval(), packed, int8, monkeypatch)
    sources = [padded(lengths, vocab=VOCAB) for lengths in
               ([5, 2, 7], [1], [3, 3], [9, 1, 4, 6], [2], [8, 8, 1])]

    def run():
        with torch.inference_mode():
            return [model.encode(src) for src in sources]

    _assert_written_out_pass_is_exact(model.encoder, run, scripted)


def test_an_encoder_only_model_with_segments_passes_alike(monkeypatch):
    torch.manual_seed(0)
    bert = build_model(preset("bert-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)).eval()
    model = copy_for_decoding(bert, packing_available(torch.float32), False, monkeypatch)
    ids = padded([6, 3, 5], vocab=VOCAB)
    segments = (torch.arange(6) >= 3).long().expand(3, -1)

    def run():
        with torch.inference_mode():
            return [model(ids, segments), model(ids[:1, :2])]

    _assert_written_out_pass_is_exact(model.encoder, run, scripted=True)


@pytest.mark.parametrize("changes", [{"positional": "rotary"}, {"attention_impl": "flash"},
                                     {"attention_scale": False}, {"attention_type": "linear"},
                                     {"sandwich_norm": True, "norm_first": True}])
def test_layouts_it_does_not_write_out_are_left_to_the_modules(changes):
    assert decoding_copy(Transformer(tiny(**changes)).eval()).encoder.fast_pass is None
    assert decoding_copy(Transformer(tiny())).encoder.fast_pass is not None
    assert Transformer(tiny()).encoder.fast_pass is None        # only decoding copies


def test_it_covers_inference_on_a_cpu_only():
    torch.manual_seed(0)
    model = decoding_copy(Transformer(tiny()).eval())
    fast, src = model.encoder.fast_pass, padded([4, 3], vocab=VOCAB)
    with torch.no_grad():
        assert fast.covers(src)
        model.train()
        assert not fast.covers(src)
    model.eval()
    assert not fast.covers(src)                  # autograd on: the modules'
    hook = model.encoder.layers[1].self_attn.register_forward_hook(lambda *_: None)
    with torch.no_grad():
        assert not fast.covers(src)              # a hook sees the modules' calls
        hook.remove()
        assert fast.covers(src)
    with torch.no_grad(), pytest.raises(ValueError, match="boolean mask"):
        fast(src, torch.ones(2, 1, 1, 4))
