"""The kernels a training step calls, read from the step (train/products.py): the
products' FLOPs against the model FLOPs formula of train/flops.py, counted independently,
and every recorded call made again on operands of the same layout."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from transduce.config import preset
from transduce.model import build_model
from transduce.train.flops import training_flops
from transduce.train.objective import SequenceObjective
from transduce.train.products import StepRecorder


def _step(config, batch_size: int, src_len: int, tgt_len: int) -> StepRecorder:
    """One forward and backward pass of the model and its fused loss on a batch without
    padding (the formula counts padded positions; the eager loss skips them)."""
    torch.manual_seed(0)
    model = build_model(config).train()
    language_model = config.arch == "decoder"
    objective = SequenceObjective(model, language_model, label_smoothing=0.1)
    vocab = config.tgt_vocab_size
    src = None if language_model else torch.randint(4, vocab, (batch_size, src_len))
    tgt_in, tgt_out = (torch.randint(4, vocab, (batch_size, tgt_len)) for _ in range(2))
    with StepRecorder() as recorder:
        objective(src, tgt_in, tgt_out).backward()
    return recorder


CONFIGS = {
    "encoder-decoder": preset("tiny", src_vocab_size=300, tgt_vocab_size=300),
    "encoder-decoder, GQA": preset("tiny", src_vocab_size=300, tgt_vocab_size=300,
                                   num_kv_heads=2, d_ff=96),
    "decoder-only, gated, GQA": preset("tiny", arch="decoder", src_vocab_size=300,
                                       tgt_vocab_size=300, num_kv_heads=1, gated_ffn=True,
                                       num_decoder_layers=3),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_steps_recorded_products_are_the_model_flops_of_the_formula(name):
    # The naive kernel forms attention as products too, so every FLOP the formula
    # counts is a recorded product (and nothing else is).
    config = CONFIGS[name].replace(attention_impl="naive")
    recorder = _step(config, batch_size=3, src_len=11, tgt_len=7)
    assert recorder.flops("product") == training_flops(config, 3, 11, 7)


@pytest.mark.parametrize("name", CONFIGS)
def test_with_an_attention_kernel_the_products_and_its_calls_make_the_formula(name):
    config = CONFIGS[name].replace(attention_impl="sdpa")
    recorder = _step(config, batch_size=2, src_len=9, tgt_len=5)
    assert recorder.flops("attention") > 0
    assert recorder.flops("product") + recorder.flops("attention") == \
        training_flops(config, 2, 9, 5)


def test_with_an_attention_kernel_its_calls_are_attention_and_the_rest_products():
    config = CONFIGS["encoder-decoder"].replace(attention_impl="sdpa")
    recorder = _step(config, batch_size=2, src_len=9, tgt_len=5)
    # forward and backward (3x), 2 FLOPs a multiply-add, 2 layers a side, QK^T and AV,
    # batch 2, 64 wide: encoder S x S, decoder T x T and T x S
    attention_flops = 3 * 2 * 2 * 2 * 2 * 64 * (9 * 9 + 5 * 5 + 5 * 9)
    assert recorder.flops("product") == training_flops(config, 2, 9, 5) - attention_flops
    assert recorder.flops("attention") == attention_flops
    attention = recorder.of_kind("attention")
    assert {call.op.split(".")[1].removesuffix("_backward") for call in attention} == \
        {next(iter(attention)).op.split(".")[1].removesuffix("_backward")}
    assert sum(attention.values()) == 2 * (2 + 2 * 2)     # forward and backward of each


def test_a_linear_layer_records_its_forward_and_both_gradients():
    layer = nn.Linear(8, 16)
    x = torch.randn(2, 3, 8, requires_grad=True)
    with StepRecorder() as recorder:
        layer(x).square().sum().backward()
    products = recorder.of_kind("product")
    assert sum(products.values()) == 3
    assert recorder.flops("product") == 3 * 2 * 6 * 8 * 16
    assert {call.op for call in products} == {"aten.addmm.default", "aten.mm.default"}


def test_a_replayed_call_has_the_layout_it_was_recorded_with():
    a, b = torch.randn(5, 3), torch.randn(7, 3)
    with StepRecorder() as recorder:
        torch.mm(a, b.t())
        torch.bmm(torch.randn(2, 4, 3), torch.randn(2, 3, 6))
        torch.cat([a, b])
    calls = {call.op: call for call in recorder.calls}
    mm = calls["aten.mm.default"]
    assert [(o.size, o.stride) for o in mm.args] == [((5, 3), (3, 1)), ((3, 7), (1, 3))]
    assert mm.flops == 2 * 5 * 3 * 7 and calls["aten.bmm.default"].flops == 2 * 2 * 4 * 3 * 6
    assert mm.replay()().shape == (5, 7)
    assert calls["aten.bmm.default"].replay()().shape == (2, 4, 6)
    assert calls["aten.cat.default"].replay()().shape == (12, 3)
    assert calls["aten.cat.default"].kind == "other" and mm.kind == "product"


def test_a_call_given_a_broadcast_operand_replays_with_it_broadcast():
    # Masks reach attention kernels expanded over heads (stride 0): the replay must
    # not fill them in place, which fails where elements share memory.
    scores, bias = torch.randn(2, 3, 4, 4), torch.randn(2, 1, 4, 4).expand(2, 3, 4, 4)
    with StepRecorder() as recorder:
        torch.add(scores, bias)
    (call,) = recorder.calls
    assert call.replay()().shape == (2, 3, 4, 4)
    fresh = call.args[1].fresh()
    assert fresh.stride() == (16, 0, 4, 1) and torch.equal(fresh[:, 0], fresh[:, 2])
    assert fresh.std() > 0.5


def test_recording_leaves_no_mode_behind():
    with StepRecorder():
        torch.ones(2) + 1
    assert _get_current_dispatch_mode() is None
