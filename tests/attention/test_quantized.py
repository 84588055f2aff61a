"""The decoding step over int8 / int4 caches that reads the integers directly: equal to
attending over the dequantized cache in float64, compiled and eager, with masks, GQA,
relative-position biases, one key and one row; and the fallback when compiling fails."""

import shutil
import warnings

import pytest
import torch

from tests.attention.test_kernels import make_mask
from tests.attention.test_position_bias import reference_with_bias
from transduce.attention import quantized
from transduce.attention.kv_cache import (Int4KVCache, KVCache, QuantizedKVCache,
                                          dequantize_int4, dequantize_int8, quantize_int4,
                                          quantize_int8)
from transduce.attention.quantized import quantized_decode_attention
from transduce.errors import TransduceWarning

# (B, H, Hkv, S, D): MHA, GQA, MQA, one key, one row, a head size of one int4 group.
SHAPES = [(3, 4, 4, 13, 64), (2, 8, 2, 21, 64), (2, 6, 1, 9, 32), (2, 4, 2, 1, 64),
          (1, 4, 1, 7, 64), (2, 4, 4, 5, 16)]


def quantized_inputs(kind, B, H, Hkv, S, D):
    """q (B, H, 1, D); stored keys/values with scales; the same dequantized in float64."""
    q = torch.randn(B, H, 1, D)
    k, v = torch.randn(B, Hkv, S, D) * 3, torch.randn(B, Hkv, S, D)
    if kind == "int8":
        (ks, kc), (vs, vc) = quantize_int8(k), quantize_int8(v)
        k_real, v_real = (dequantize_int8(x, c, torch.float64) for x, c in ((ks, kc), (vs, vc)))
    else:
        group = 32 if D % 32 == 0 else D
        (ks, kc), (vs, vc) = quantize_int4(k, group), quantize_int4(v, group)
        k_real, v_real = (dequantize_int4(x, c, torch.float64) for x, c in ((ks, kc), (vs, vc)))
    return q, (ks, kc, vs, vc), k_real, v_real


NO_COMPILER = pytest.mark.skipif(shutil.which("g++") is None,
                                 reason="torch.compile builds the kernel with g++ (not installed)")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=NO_COMPILER)],
                         ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask_kind,with_bias", [("none", False), ("padding", True),
                                                  ("holes", False), ("holes", True)])
def test_step_equals_attention_over_the_dequantized_cache(compiled, kind, shape, mask_kind,
                                                          with_bias):
    torch.manual_seed(SHAPES.index(shape))
    B, H, Hkv, S, D = shape
    q, stored, k_real, v_real = quantized_inputs(kind, *shape)
    mask = make_mask(mask_kind, B, H, 1, S)
    bias = torch.randn(H, S) if with_bias else None
    out = quantized_decode_attention(q, *stored, mask, position_bias=bias, compiled=compiled)
    zero_bias = torch.zeros(H, S, dtype=torch.float64)
    expected = reference_with_bias(q, k_real, v_real, mask, False,
                                   zero_bias if bias is None else bias)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_class", [QuantizedKVCache, Int4KVCache])
def test_cached_decoding_reads_the_integers_and_equals_dequantize_then_attend(cache_class):
    """Step by step through the cache (prefill dequantizes, steps do not), bfloat16
    queries included: the same as the float cache fed the round-tripped keys."""
    torch.manual_seed(3)
    B, H, Hkv, D, steps = 3, 8, 2, 64, 12
    q, k, v = torch.randn(B, H, steps, D), torch.randn(B, Hkv, steps, D), torch.randn(B, Hkv, steps, D)
    cache, exact = cache_class(B, Hkv, 16, D), KVCache(B, Hkv, 16, D)
    mask = torch.ones(B, 1, 1, steps, dtype=torch.bool)
    mask[1, ..., :3] = False                                   # left padding in row 1
    outs = [cache.attend(q[:, :, :4], k[:, :, :4], v[:, :, :4], mask[..., :4], causal=True,
                         impl="sdpa")]
    for t in range(4, steps):
        outs.append(cache.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                 mask[..., :t + 1], causal=True, impl="sdpa"))
    k_real = cache.dequantize(cache.k[:, :, :steps], cache.k_scale[:, :, :steps], torch.float32)
    v_real = cache.dequantize(cache.v[:, :, :steps], cache.v_scale[:, :, :steps], torch.float32)
    expected = exact.attend(q, k_real, v_real, mask, causal=True, impl="naive")
    torch.testing.assert_close(torch.cat(outs, dim=2), expected, rtol=1e-5, atol=1e-5)
    step = cache.attend(q[:, :, :1].bfloat16(), k[:, :, :1], v[:, :, :1],
                        torch.ones(B, 1, 1, steps + 1, dtype=torch.bool), causal=True,
                        impl="sdpa")
    assert step.dtype == torch.bfloat16 and step.shape == (B, H, 1, D)


def test_a_step_of_several_queries_is_refused():
    q, stored, _, _ = quantized_inputs("int8", 1, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="one query per row, got T=2"):
        quantized_decode_attention(torch.cat([q, q], dim=2), *stored)


def test_a_failed_compilation_warns_once_and_falls_back_to_eager(monkeypatch):
    def broken_compile(step, **kwargs):
        def fails(*args):
            raise RuntimeError("no C++ compiler found\nmore detail")
        return fails

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(quantized, "_steps", {})
    q, stored, k_real, v_real = quantized_inputs("int8", 2, 4, 4, 6, 16)
    eager = quantized_decode_attention(q, *stored, compiled=False)
    with pytest.warns(TransduceWarning, match="could not be compiled .*no C\\+\\+ compiler"):
        first = quantized_decode_attention(q, *stored)
    torch.testing.assert_close(first, eager, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # no second warning
        second = quantized_decode_attention(q, *stored)
    torch.testing.assert_close(second, eager, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="int8 decode kernel could not be compiled"):
        quantized_decode_attention(q, *stored, compiled=True)
