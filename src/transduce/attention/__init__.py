"""The attention family: masks, kernels, scores, multi-head attention, its kinds and caches."""

from transduce.attention import masks
from transduce.attention.flash import flash_attention
from transduce.attention.kernels import IMPLS, attention, masked_softmax
from transduce.attention.kinds import (AttentionKind, LinearAttention, SlidingWindowAttention,
                                       SoftmaxAttention, self_attention_kind)
from transduce.attention.kv_cache import AttentionCache, KVCache, QuantizedKVCache
from transduce.attention.linear import LinearStateCache
from transduce.attention.local import SlidingKVCache
from transduce.attention.multihead import MultiHeadAttention
from transduce.attention.recorder import record_attention
from transduce.attention.scores import AdditiveAttention, DotAttention, GeneralAttention

__all__ = ["masks", "attention", "flash_attention", "masked_softmax", "IMPLS", "AttentionCache",
           "KVCache", "QuantizedKVCache", "SlidingKVCache", "LinearStateCache", "AttentionKind",
           "SoftmaxAttention", "LinearAttention", "SlidingWindowAttention", "self_attention_kind",
           "MultiHeadAttention", "record_attention", "AdditiveAttention", "DotAttention",
           "GeneralAttention"]
