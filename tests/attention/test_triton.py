"""impl="triton" against the float64 reference, forward and gradients.

Without a GPU the kernels run in Triton's interpreter, which executes the same kernel code
tile by tile on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 there, before anything
imports triton); with one, they run compiled on CUDA.
Shapes are small and tiles 16 wide so that every edge case crosses tile borders.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.attention.reference import reference_attention
from tests.attention.test_kernels import grads, make_mask
from transduce import checkpoint
from transduce.attention import MultiHeadAttention, attention
from transduce.attention.masks import Segments
from transduce.attention.triton_flash import (Tiles, TritonUnavailable, dropout_keep_mask,
                                              triton_attention, triton_packed_attention,
                                              unpack_heads)
from transduce.config import preset
from transduce.data.packing import sentence_numbers
from transduce.model import build_model, load_model

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRETED else ["cuda"]

# (B, H, Hkv, T, S, D): MHA, GQA, MQA, one query, lengths that do not divide the tile,
# a head size that is not a power of two, several key tiles wholly below the causal
# diagonal (the forward kernel skips the causal test there).
SHAPES = [
    (2, 2, 2, 19, 19, 16),
    (2, 4, 2, 17, 35, 16),
    (1, 3, 1, 5, 21, 8),
    (2, 2, 1, 1, 9, 16),
    (1, 2, 2, 23, 23, 24),
    (1, 2, 1, 50, 70, 16),
]
CASES = [(shape, kind, causal) for shape in SHAPES for kind in ["none", "padding", "holes"]
         for causal in [False, True]]
SMALL_TILES = Tiles(block_m=16, block_n=16, num_warps=2, num_stages=1)


def inputs(B, H, Hkv, T, S, D, device, dtype=torch.float32):
    make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(B, H, T, D), make(B, Hkv, S, D), make(B, Hkv, S, D)


def reference_and_grads(q, k, v, mask, causal, keep=None):
    """float64 reference output and gradients (on the CPU); keep applies dropout."""
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    mask = None if mask is None else mask.cpu()
    if keep is None:
        out, _ = reference_attention(q64, k64, v64, mask, causal)
    else:
        _, weights = reference_attention(q64, k64, v64, mask, causal)
        group = q.shape[1] // k.shape[1]
        out = (weights * keep.cpu() / (1 - 0.3)) @ v64.repeat_interleave(group, dim=1)
    return out, grads(out, (q64, k64, v64))


def assert_matches(out, got_grads, expected, expected_grads, atol):
    torch.testing.assert_close(out.detach().cpu().double(), expected, rtol=0, atol=atol)
    for name, got, want in zip("qkv", got_grads, expected_grads):
        torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=atol * 5,
                                   msg=lambda m: f"d{name}: {m}")  # noqa: B023


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,kind,causal", CASES)
def test_forward_and_gradients_match_float64_reference(device, shape, kind, causal):
    torch.manual_seed(0)
    B, H, Hkv, T, S, D = shape
    q, k, v = inputs(*shape, device)
    mask = make_mask(kind, B, H, T, S)
    mask = None if mask is None else mask.to(device)
    out = triton_attention(q, k, v, mask, causal=causal, scale=D ** -0.5, tiles=SMALL_TILES)
    expected, expected_grads = reference_and_grads(q, k, v, mask, causal)
    assert_matches(out, grads(out, (q, k, v)), expected, expected_grads, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_more_queries_than_keys_causal_gives_zero_rows_and_zero_gradients(device):
    q, k, v = inputs(1, 2, 1, 20, 6, 16, device)
    out = attention(q, k, v, causal=True, impl="triton")
    assert torch.equal(out[:, :, :14], torch.zeros_like(out[:, :, :14]))
    dq, dk, dv = grads(out, (q, k, v))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[:, :, :14], torch.zeros_like(dq[:, :, :14]))
    expected, expected_grads = reference_and_grads(q, k, v, None, True)
    assert_matches(out, (dq, dk, dv), expected, expected_grads, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_applies_the_drawn_keep_mask_in_forward_and_backward(device):
    torch.manual_seed(1)
    B, H, Hkv, T, S, D = 2, 4, 2, 18, 33, 16
    q, k, v = inputs(B, H, Hkv, T, S, D, device)
    mask = make_mask("padding", B, H, T, S).to(device)
    out = triton_attention(q, k, v, mask, causal=True, scale=0.25, dropout_p=0.3, seed=77,
                           tiles=SMALL_TILES)
    keep = dropout_keep_mask(B, H, T, S, 0.3, 77, q.device)
    assert 0.6 < keep.float().mean().item() < 0.8
    expected, expected_grads = reference_and_grads(q, k, v, mask, True, keep=keep)
    assert_matches(out * 1.0, grads(out, (q, k, v)), expected * 1.0, expected_grads, atol=2e-5)
    again = triton_attention(q, k, v, mask, causal=True, scale=0.25, dropout_p=0.3, seed=77,
                             tiles=SMALL_TILES)
    other = triton_attention(q, k, v, mask, causal=True, scale=0.25, dropout_p=0.3, seed=78,
                             tiles=SMALL_TILES)
    assert torch.equal(out, again) and not torch.equal(out, other)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close_to_reference(device, dtype):
    if dtype == torch.bfloat16 and INTERPRETED:
        pytest.skip("Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot); "
                    "bfloat16 is tested compiled, on CUDA")
    torch.manual_seed(2)
    q, k, v = inputs(1, 4, 2, 21, 40, 16, device, dtype=dtype)
    out = attention(q, k, v, causal=True, impl="triton")
    assert out.dtype == dtype
    expected, expected_grads = reference_and_grads(q, k, v, None, True)
    atol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    assert_matches(out, grads(out.float(), (q, k, v)), expected, expected_grads, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_equals_one_sequence_at_a_time(device):
    torch.manual_seed(3)
    q, k, v = inputs(3, 2, 1, 9, 17, 16, device)
    mask = make_mask("padding", 3, 2, 9, 17).to(device)
    batched = attention(q, k, v, mask, impl="triton")
    for b in range(3):
        alone = attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1], impl="triton")
        torch.testing.assert_close(batched[b:b + 1], alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_multihead_attention_with_triton_equals_sdpa(device):
    torch.manual_seed(4)
    layers = {impl: MultiHeadAttention(32, 4, num_kv_heads=2, impl=impl).to(device)
              for impl in ("sdpa", "triton")}
    layers["triton"].load_state_dict(layers["sdpa"].state_dict())
    x = torch.randn(2, 11, 32, device=device, requires_grad=True)
    lengths = torch.tensor([11, 6], device=device)
    key_mask = (torch.arange(11, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    outs = {impl: layer(x, key_mask, causal=True) for impl, layer in layers.items()}
    torch.testing.assert_close(outs["triton"], outs["sdpa"], rtol=0, atol=1e-5)
    # Through the stacked q, k, v projection and back (training's layout).
    got, want = (grads(outs[impl], (x, *layers[impl].parameters())) for impl in ("triton", "sdpa"))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_attention_over_packed_keys_and_values_equals_sdpa(device):
    """In training, impl "triton" takes cross-attention's stacked key and value projection
    whole (project_kv(packed=True)): the same output and gradients as SDPA on the
    separate keys and values; elsewhere (eval, other impls, soft-capped scores) project_kv
    gives them apart."""
    torch.manual_seed(14)
    layers = {impl: MultiHeadAttention(32, 4, num_kv_heads=2, impl=impl).to(device)
              for impl in ("sdpa", "triton")}
    layers["triton"].load_state_dict(layers["sdpa"].state_dict())
    x = torch.randn(2, 9, 32, device=device, requires_grad=True)
    source = torch.randn(2, 13, 32, device=device, requires_grad=True)
    key_mask = (torch.arange(13, device=device) < torch.tensor([[13], [8]], device=device))
    key_mask = key_mask[:, None, None, :]
    kv = {impl: layer.project_kv(source, packed=True) for impl, layer in layers.items()}
    assert isinstance(kv["triton"], torch.Tensor) and kv["triton"].shape == (2, 13, 32)
    assert isinstance(kv["sdpa"], tuple)
    outs = {impl: layer(x, key_mask, kv=kv[impl]) for impl, layer in layers.items()}
    torch.testing.assert_close(outs["triton"], outs["sdpa"], rtol=0, atol=1e-5)
    got, want = (grads(outs[impl], (x, source, *layers[impl].parameters()))
                 for impl in ("triton", "sdpa"))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert isinstance(layers["triton"].eval().project_kv(source, packed=True), tuple)
    capped = MultiHeadAttention(32, 4, impl="triton", softcap=30.0).to(device)
    assert isinstance(capped.project_kv(source, packed=True), tuple)  # the kernels cannot cap


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_and_gradients_are_stored_token_major(device):
    """(B, T, H, D) in memory, as the projections lay heads out: merging a result's
    heads, forward or back, is then a view and not a copy."""
    q, k, v = inputs(2, 4, 2, 7, 9, 16, device)
    out = triton_attention(q, k, v, scale=0.25, tiles=SMALL_TILES)
    for result in (out, *grads(out, (q, k, v))):
        merged = result.transpose(1, 2).flatten(2)                 # (B, T, H * D)
        assert merged._is_view() and merged.data_ptr() == result.data_ptr()


def test_cpu_tensors_without_the_interpreter_get_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 3, 16)
    with pytest.raises(TritonUnavailable, match="runs on CUDA tensors.*TRITON_INTERPRET=1"):
        attention(q, q, q, impl="triton")


def test_unsupported_dtypes_and_head_sizes_are_named():
    q = torch.randn(1, 2, 3, 16, dtype=torch.float64, device=DEVICES[0])
    with pytest.raises(ValueError, match="float16, bfloat16, float32; got torch.float64"):
        attention(q, q, q, impl="triton")
    q = torch.randn(1, 2, 3, 264, device=DEVICES[0])
    with pytest.raises(ValueError, match="head sizes up to 256"):
        attention(q, q, q, impl="triton")


def test_a_model_trained_with_the_triton_kernel_loads_with_sdpa_off_the_gpu(tiny_corpus, tmp_path):
    torch.manual_seed(5)
    device = DEVICES[0]   # where the kernel runs: the GPU, or the interpreter on the CPU
    model = build_model(preset("tiny", src_vocab_size=300, tgt_vocab_size=300,
                               attention_impl="triton")).eval().to(device)
    path = checkpoint.save(tmp_path / "model", model, None, tiny_corpus / "spm.model")
    loaded = load_model(path, "cpu")
    assert loaded.config.attention_impl == "sdpa"
    src, tgt = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[1, 8, 9]])
    with torch.no_grad():
        expected = model(src.to(device), tgt.to(device)).cpu()
        torch.testing.assert_close(loaded(src, tgt), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_position_bias_and_its_gradient_match_the_float64_reference(device, causal):
    from tests.attention.test_position_bias import reference_with_bias
    torch.manual_seed(6)
    B, H, Hkv, T, S, D = 2, 4, 2, 17, 35, 16
    q, k, v = inputs(B, H, Hkv, T, S, D, device)
    vector = torch.randn(H, T + S - 1, device=device, requires_grad=True)
    mask = make_mask("holes", B, H, T, S).to(device)
    out = triton_attention(q, k, v, mask, causal=causal, scale=D ** -0.5, tiles=SMALL_TILES,
                           position_bias=vector)
    leaves = [x.detach().cpu().double().requires_grad_() for x in (q, k, v, vector)]
    expected = reference_with_bias(*leaves[:3], mask.cpu(), causal, leaves[3])
    torch.testing.assert_close(out.detach().cpu().double(), expected, rtol=0, atol=2e-5)
    for got, want in zip(grads(out, (q, k, v, vector)), grads(expected, leaves)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=1e-4)


# Packed rows (Segments): (H, Hkv, T, S, each row's target sentence lengths, each row's
# source sentence lengths). Self-attention with padding at row ends, a row that is one
# sentence and a row of only padding; cross-attention (T != S, sentence i of the target
# row attends sentence i of the source row) with GQA; MQA with a sentence that starts
# inside a tile and spans several (the causal split past the first key tile).
SEGMENT_CASES = [
    (2, 2, 37, 37, [[5, 20, 7], [37], []], [[5, 20, 7], [37], []]),
    (4, 2, 19, 35, [[6, 9], [3, 1, 10]], [[15, 11], [7, 4, 20]]),
    (3, 1, 50, 50, [[18, 30, 2]], [[18, 30, 2]]),
]


def packed(target_lengths, source_lengths, T, S, device, dtype=torch.int32):
    segments = Segments.packed(sentence_numbers(target_lengths, T),
                               sentence_numbers(source_lengths, S))
    return Segments(segments.queries.to(device, dtype), segments.keys.to(device, dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", SEGMENT_CASES)
def test_segments_match_the_reference_with_their_dense_mask(device, case, causal):
    torch.manual_seed(7)
    H, Hkv, T, S, target_lengths, source_lengths = case
    B, D = len(target_lengths), 16
    q, k, v = inputs(B, H, Hkv, T, S, D, device)
    segments = packed(target_lengths, source_lengths, T, S, device, dtype=torch.int64)
    out = triton_attention(q, k, v, segments, causal=causal, scale=D ** -0.5, tiles=SMALL_TILES)
    expected, expected_grads = reference_and_grads(q, k, v, segments.dense(), causal)
    assert_matches(out, grads(out, (q, k, v)), expected, expected_grads, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_segments_with_dropout_apply_the_drawn_keep_mask(device):
    torch.manual_seed(8)
    H, Hkv, T, S, target_lengths, source_lengths = SEGMENT_CASES[1]
    B, D = len(target_lengths), 16
    q, k, v = inputs(B, H, Hkv, T, S, D, device)
    segments = packed(target_lengths, source_lengths, T, S, device)
    out = triton_attention(q, k, v, segments, causal=True, scale=D ** -0.5, dropout_p=0.3,
                           seed=5, tiles=SMALL_TILES)
    keep = dropout_keep_mask(B, H, T, S, 0.3, 5, q.device)
    expected, expected_grads = reference_and_grads(q, k, v, segments.dense(), True, keep=keep)
    assert_matches(out, grads(out, (q, k, v)), expected, expected_grads, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_segments_with_a_position_bias_match_the_float64_reference(device):
    from tests.attention.test_position_bias import reference_with_bias
    torch.manual_seed(9)
    H, Hkv, T, S, target_lengths, source_lengths = SEGMENT_CASES[0]
    B, D = len(target_lengths), 16
    q, k, v = inputs(B, H, Hkv, T, S, D, device)
    vector = torch.randn(H, T + S - 1, device=device, requires_grad=True)
    segments = packed(target_lengths, source_lengths, T, S, device)
    out = triton_attention(q, k, v, segments, causal=True, scale=D ** -0.5, tiles=SMALL_TILES,
                           position_bias=vector)
    leaves = [x.detach().cpu().double().requires_grad_() for x in (q, k, v, vector)]
    expected = reference_with_bias(*leaves[:3], segments.dense().cpu(), True, leaves[3])
    torch.testing.assert_close(out.detach().cpu().double(), expected, rtol=0, atol=2e-5)
    for got, want in zip(grads(out, (q, k, v, vector)), grads(expected, leaves)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=1e-4)


@pytest.mark.filterwarnings("ignore:All-NaN slice")   # the interpreter's row maxima
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_segments_skip_the_tiles_of_other_sentences(device, causal):
    # Sentence 1 fills key and query tiles 1 and 2 (16 wide) and has NaN in its queries,
    # keys and values, so in its outputs and upstream gradient too. A masked tile that is
    # read still multiplies its zero weights by NaN: sentences 0 and 2 come out finite only
    # if their kernels never read sentence 1's tiles. The dense mask, read tile by tile,
    # gets NaN there.
    torch.manual_seed(10)
    T, D = 64, 16
    segments = packed([[16, 32, 13]], [[16, 32, 13]], T, T, device)
    q, k, v = inputs(1, 2, 1, T, T, D, device)
    expected, expected_grads = reference_and_grads(q, k, v, segments.dense(), causal)
    poisoned = torch.zeros(T, dtype=torch.bool)
    poisoned[16:48] = True
    for mask, finite in ((segments, True), (segments.dense(), False)):
        leaves = [x.detach().masked_fill(poisoned[:, None].to(device), float("nan"))
                  .requires_grad_() for x in (q, k, v)]
        out = triton_attention(*leaves, mask, causal=causal, scale=D ** -0.5,
                               tiles=SMALL_TILES)
        for got, want in zip((out, *grads(out, leaves)), (expected, *expected_grads)):
            rest = got.detach().cpu().double()[:, :, ~poisoned]
            assert bool(torch.isfinite(rest).all()) == finite
            if finite:
                torch.testing.assert_close(rest, want[:, :, ~poisoned], rtol=0, atol=1e-4)


def test_segments_of_the_wrong_shape_or_dtype_are_named():
    q = torch.randn(2, 2, 5, 16, device=DEVICES[0])
    k = torch.randn(2, 1, 7, 16, device=DEVICES[0])
    numbers = torch.zeros(2, 7, dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match=r"Segments\.keys .*\(2, 7\)"):
        attention(q, k, k, Segments(numbers[:, :5], numbers[:, :5]), impl="triton")
    with pytest.raises(ValueError, match=r"Segments\.queries .*float32"):
        attention(q, k, k, Segments(numbers[:, :5].float(), numbers), impl="triton")


@pytest.mark.parametrize("float_type", ["fp32", "fp64"])
def test_the_kernels_compute_in_float32_whatever_type_their_float_arguments_arrive_in(
        float_type):
    """torch.compile launches the kernels (`transduce train --compile` with
    impl="triton") with their float arguments typed fp64, not fp32 as Triton's own
    launcher does; the kernels convert them once, so the scores stay float32 (before,
    the forward kernel did not compile and the backward kernels ran in float64). Checked
    in the kernels' IR for a Hopper GPU, which compiles on a machine without one."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_ir.py")
    result = subprocess.run([sys.executable, str(script), float_type], env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found == {name: [] for name in ("forward_kernel", "dkdv_kernel", "dq_kernel",
                                           "keep_mask_kernel", "add_norm_forward_kernel",
                                           "add_norm_backward_kernel",
                                           "add_norm_keep_mask_kernel")}


def test_the_compiled_training_step_launches_the_kernels_on_gradients_as_they_come():
    """torch.compile's graphs of a packed training step with impl "triton" (read without a
    GPU, bench/compiled_graph.py): each attention call and each post-norm sub-layer's end
    is its kernels and nothing more. No clone: before the launches were operators, the
    compiler copied every attention output's gradient into a contiguous (B, H, T, D)
    tensor first (it traced the backward before it knew the gradient's strides). No
    kernel left functional: each writes its own fresh buffers, not copies of them. With
    attention dropout, in one graph: the seed is drawn on the device (before, reading it
    on the host broke the graph at every attention call)."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "bench" / "compiled_graph.py"
    result = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--length", "32",
                             "--attention-dropout", "0.1"],
                            env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    graphs = json.loads(result.stdout)
    # tiny: 2 + 2 layers, 6 attention calls (3 kernels each), 10 post-norm sub-layers (2)
    launches = {"forward": 6 + 10, "backward": 6 * 2 + 10}
    for name, graph in graphs.items():
        assert graph["operators"]["triton_kernel_wrapper_mutation"] == launches[name]
        assert graph["functional_triton_kernels"] == 0
        assert [c for c in graph["copies"] if c["op"] == "aten.clone.default"] == []
    # Self-attention's q, k, v gradients are written into one tensor, cross-attention's k
    # and v gradients too (packed_self_attention, kv_packed_attention): each its stacked
    # product's output gradient, with nothing to concatenate.
    assert [c for c in graphs["backward"]["copies"] if c["op"] == "aten.cat.default"] == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["mask, dropout", "segments, bias"])
def test_the_operators_meet_pytorchs_operator_contract(device, case):
    """torch.library.opcheck on the forward and backward operators (triton_ops.py): their
    schemas, their autograd registration, and the shapes, strides and dtypes they report
    for fake tensors (what torch.compile plans with) equal those of a run. On CUDA also
    their traces (AOT dispatch); the interpreter runs kernels as Python, which a trace
    cannot hold."""
    from transduce.attention import triton_ops
    torch.manual_seed(11)
    B, H, Hkv, T, S, D = 2, 4, 2, 18, 18, 16
    q, k, v = inputs(B, H, Hkv, T, S, D, device)
    mask, numbers, bias, dropout_p = None, (None, None), None, 0.0
    if case == "mask, dropout":
        mask, dropout_p = make_mask("holes", B, H, T, S).to(device), 0.3
    else:
        segments = packed([[5, 13], [18]], [[5, 13], [18]], T, S, device)
        numbers = (segments.queries, segments.keys)
        bias = torch.randn(H, T + S - 1, device=device, requires_grad=True)
    seed = torch.tensor([5], device=device) if dropout_p else None
    settings = (seed, True, D ** -0.5, dropout_p, [16, 16, 2, 1])
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    if device == "cuda":
        tests += ("test_aot_dispatch_static",)   # D is a kernel constant: not symbolic
    forward = (q, k, v, mask, *numbers, bias, *settings)
    torch.library.opcheck(triton_ops.attention_forward, forward, test_utils=tests)
    out, lse2 = triton_ops.attention_forward(*forward)
    grad_out = torch.randn(B, T, H, D, device=device).transpose(1, 2)   # token-major, as it comes
    backward = (grad_out, q.detach(), k.detach(), v.detach(), out.detach(), lse2, mask,
                *numbers, None if bias is None else bias.detach(), *settings, bias is not None)
    torch.library.opcheck(triton_ops.attention_backward, backward, test_utils=tests)


PACKED_CASES = {"GQA, holes, causal, dropout": (4, 2, "holes", True, 0.3, False),
                "MHA, segments, bias": (2, 2, "segments", False, 0.0, True)}


def packed_arguments(case: str, device: str) -> tuple:
    """-> qkv (2, 21, (H + 2 Hkv) 16) leaf, heads, kv_heads, mask, keyword arguments."""
    heads, kv_heads, mask_kind, causal, dropout_p, with_bias = PACKED_CASES[case]
    B, T, D = 2, 21, 16
    qkv = torch.randn(B, T, (heads + 2 * kv_heads) * D, device=device, requires_grad=True)
    mask = packed([[5, 9, 7], [21]], [[5, 9, 7], [21]], T, T, device) \
        if mask_kind == "segments" else make_mask(mask_kind, B, heads, T, T).to(device)
    bias = torch.randn(heads, 2 * T - 1, device=device, requires_grad=True) if with_bias \
        else None
    return qkv, heads, kv_heads, mask, dict(causal=causal, dropout_p=dropout_p, seed=5,
                                            scale=D ** -0.5, tiles=SMALL_TILES,
                                            position_bias=bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", PACKED_CASES)
def test_packed_self_attention_equals_the_kernels_on_its_views(device, case):
    """A stacked projection's output taken whole: the same kernels on the same views, so
    the output and every gradient equal the unpacked call's bit for bit; the q, k, v
    gradients arrive as one tensor like qkv."""
    torch.manual_seed(12)
    qkv, heads, kv_heads, mask, settings = packed_arguments(case, device)
    leaves = [qkv] + ([settings["position_bias"]] if settings["position_bias"] is not None
                      else [])
    got = triton_packed_attention(qkv, heads, kv_heads, mask, **settings)
    want = triton_attention(*unpack_heads(qkv, heads, kv_heads, kv_heads), mask, **settings)
    assert torch.equal(got, want)
    grad_out = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, leaves, grad_out)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
    assert got_grads[0].shape == qkv.shape and got_grads[0].is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_packed_operators_meet_pytorchs_operator_contract(device):
    """opcheck, as test_the_operators_meet_pytorchs_operator_contract, on the packed pair."""
    from transduce.attention import triton_ops
    from transduce.attention.triton_flash import _launch_arguments
    torch.manual_seed(13)
    qkv, heads, kv_heads, mask, settings = packed_arguments("GQA, holes, causal, dropout",
                                                            device)
    arguments = _launch_arguments(qkv, mask, None, 5, True, 0.25, 0.3, SMALL_TILES)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    if device == "cuda":
        tests += ("test_aot_dispatch_static",)   # D is a kernel constant: not symbolic
    forward = (qkv, heads, kv_heads, *arguments)
    torch.library.opcheck(triton_ops.packed_forward, forward, test_utils=tests)
    out, lse2 = triton_ops.packed_forward(*forward)
    grad_out = torch.randn(2, 21, heads, 16, device=device).transpose(1, 2)
    backward = (grad_out, qkv.detach(), heads, kv_heads, out.detach(), lse2, *arguments, False)
    torch.library.opcheck(triton_ops.packed_backward, backward, test_utils=tests)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_packed_attention_equals_the_kernels_on_its_views(device):
    """Queries over a stacked key and value projection's output: bit for bit the unpacked
    call's output and gradients, kv's arriving as one tensor like kv; and opcheck."""
    from transduce.attention import triton_ops
    from transduce.attention.triton_flash import _launch_arguments, triton_kv_packed_attention
    torch.manual_seed(15)
    B, H, Hkv, T, S, D = 2, 4, 2, 11, 21, 16
    q = torch.randn(B, H, T, D, device=device, requires_grad=True)
    kv = torch.randn(B, S, 2 * Hkv * D, device=device, requires_grad=True)
    mask = make_mask("padding", B, H, T, S).to(device)
    settings = dict(dropout_p=0.3, seed=9, scale=D ** -0.5, tiles=SMALL_TILES)
    got = triton_kv_packed_attention(q, kv, Hkv, mask, **settings)
    want = triton_attention(q, *unpack_heads(kv, Hkv, Hkv), mask, **settings)
    assert torch.equal(got, want)
    grad_out = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, kv), grad_out)
    for a, b in zip(got_grads, torch.autograd.grad(want, (q, kv), grad_out)):
        assert torch.equal(a, b)
    assert got_grads[1].shape == kv.shape and got_grads[1].is_contiguous()
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    if device == "cuda":
        tests += ("test_aot_dispatch_static",)
    arguments = _launch_arguments(q, mask, None, 9, False, D ** -0.5, 0.3, SMALL_TILES)
    torch.library.opcheck(triton_ops.kv_packed_forward, (q, kv, Hkv, *arguments),
                          test_utils=tests)
