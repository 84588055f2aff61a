"""The attention family: masks, kernels, scores, multi-head attention and its KV cache."""

from transduce.attention import masks
from transduce.attention.flash import flash_attention
from transduce.attention.kernels import IMPLS, attention, masked_softmax
from transduce.attention.kv_cache import KVCache
from transduce.attention.multihead import MultiHeadAttention
from transduce.attention.scores import AdditiveAttention, DotAttention, GeneralAttention

__all__ = ["masks", "attention", "flash_attention", "masked_softmax", "IMPLS", "KVCache",
           "MultiHeadAttention", "AdditiveAttention", "DotAttention", "GeneralAttention"]
