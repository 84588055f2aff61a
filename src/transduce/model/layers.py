"""The Transformer's layers: position-wise feed-forward, encoder layer, decoder layer.

Post-norm (the paper): x = Norm(x + Dropout(Sublayer(x))).
Pre-norm (norm_first): x = x + Dropout(Sublayer(Norm(x))); the stack then needs a
final norm, which Encoder and Decoder add. Sandwich (sandwich_norm, Gemma's):
x = x + Dropout(PostNorm(Sublayer(Norm(x)))), or without the input's norm (input_norms
False, OLMo 2's) x = x + Dropout(PostNorm(Sublayer(x))). Parallel (parallel_residual,
GPT-NeoX's):
x = x + Dropout(Attn(Norm1(x))) + Dropout(FFN(Norm3(x))), or with one norm (shared_norm,
Phi's) x = x + Dropout(Attn(Norm1(x))) + Dropout(FFN(Norm1(x))). Norm is LayerNorm, or
RMSNorm (config.norm).
Shapes: hidden states (B, T, C); the source memory (B, S, C).
"""

from __future__ import annotations

from functools import partial

from torch import Tensor, nn

from transduce.attention.disentangled import RelativePositions
from transduce.attention.kinds import self_attention_kind
from transduce.attention.kv_cache import AttentionCache
from transduce.attention.multihead import MultiHeadAttention, Rotary
from transduce.config import AttentionType, ModelConfig
from transduce.model.add_norm import add_dropout_norm
from transduce.model.dropout import Dropout


def activation_module(name: str) -> nn.Module:
    """ModelConfig.activation as a module: ReLU, exact (erf) GELU, GELU's tanh
    approximation, or SiLU (swish)."""
    if name == "relu":
        return nn.ReLU()
    if name == "silu":
        return nn.SiLU()
    return nn.GELU(approximate="tanh" if name == "gelu-tanh" else "none")


def norm_module(config: ModelConfig, size: int | None = None) -> nn.Module:
    """ModelConfig.norm over `size` features (d_model by default): LayerNorm (the
    paper's; without a bias where norm_bias is False, ModernBERT's) or RMSNorm (Llama's)."""
    size = config.d_model if size is None else size
    if config.norm == "rms":
        return nn.RMSNorm(size, eps=config.layer_norm_eps)
    return nn.LayerNorm(size, eps=config.layer_norm_eps, bias=config.norm_bias)


def attention_module(config: ModelConfig, kv_heads: int, *, rotary: Rotary | None,
                     self_attention: bool, attention_type: AttentionType | None = None
                     ) -> MultiHeadAttention:
    """A layer's self- or cross-attention as the configuration sets it: kv_heads key/value
    heads, self-attention of attention_type (default config.attention_type;
    cross-attention is softmax), rotary positions where given, the model's norm on each
    head's queries and keys (qk_norm), its scores soft-capped (attention_softcap), its
    projections' biases where bias, attention_bias and qkv_bias give them."""
    c = config
    kind = self_attention_kind(attention_type or c.attention_type, c.attention_window,
                               c.global_tokens) if self_attention else "softmax"
    bias = c.bias and c.attention_bias
    return MultiHeadAttention(c.d_model, c.num_heads, kv_heads, bias=bias,
                              dropout=c.attention_dropout, impl=c.attention_impl,
                              rotary=rotary, kind=kind, scale_scores=c.attention_scale,
                              qkv_bias=bias or c.qkv_bias, head_dim=c.head_size,
                              qk_norm=partial(norm_module, c) if c.qk_norm else None,
                              qk_norm_across_heads=c.qk_norm_across_heads,
                              qk_norm_per_head=c.qk_norm_per_head,
                              softcap=c.attention_softcap)


def sandwich_norm(config: ModelConfig) -> nn.Module | None:
    """The norm on a sub-layer's output (sandwich_norm), or None for other layers."""
    return norm_module(config) if config.sandwich_norm else None


def post_norm(norm: nn.Module | None, h: Tensor) -> Tensor:
    """A sub-layer's output h (B, T, C) through its sandwich norm, if it has one."""
    return h if norm is None else norm(h)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (ReLU as in the paper; GELU, exact or its tanh
    approximation, and SiLU as options). gated: the gated linear unit form,
    (act(x W1) * x W3) W2 (Shazeer 2020; SwiGLU with SiLU), whose W3 is linear3 after
    Meta's Llama, w2(silu(w1(x)) * w3(x))."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", bias: bool = True,
                 gated: bool = False):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear3 = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.activation = activation_module(activation)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        hidden = self.activation(self.linear1(x))                      # (B, T, d_ff)
        if self.linear3 is not None:
            hidden = hidden * self.linear3(x)
        return self.linear2(hidden)


class EncoderLayer(nn.Module):
    """Self-attention over the source, then the feed-forward network. Its self-attention
    is of attention_type (default config.attention_type); without attention_norm (a
    pre-norm stack's first layer, ModernBERT's) it reads x as it is."""

    def __init__(self, config: ModelConfig, rotary: Rotary | None = None, *,
                 attention_type: AttentionType | None = None, attention_norm: bool = True):
        super().__init__()
        c = config
        self.self_attn = attention_module(c, c.num_heads, rotary=rotary, self_attention=True,
                                          attention_type=attention_type)
        self.ffn = FeedForward(c.d_model, c.d_ff, c.activation, c.bias, c.gated_ffn)
        self.norm1 = norm_module(c) if attention_norm else nn.Identity()
        self.norm2 = norm_module(c)
        self.post_norm1, self.post_norm2 = sandwich_norm(c), sandwich_norm(c)
        self.dropout = Dropout(c.dropout)
        self.norm_first = c.norm_first
        # Post-norm sub-layers end in one Triton pass while training (model/add_norm.py).
        self.fused_add_norm = c.attention_impl == "triton"

    def forward(self, x: Tensor, src_mask: Tensor | None, *,
                position_bias: Tensor | None = None, positions: Tensor | None = None,
                relative: RelativePositions | None = None) -> Tensor:
        """x (B, S, C), src_mask (B, 1, 1, S) or a packed batch's Segments, position_bias
        (H, 2S - 1), positions (B, S) each token's rotary position, relative: the
        stack's disentangled positions (DeBERTa's) -> (B, S, C)."""
        def self_attention(h: Tensor) -> Tensor:
            return self.self_attn(h, src_mask, positions=positions, position_bias=position_bias,
                                  relative=relative)

        if self.norm_first:
            x = x + self.dropout(post_norm(self.post_norm1, self_attention(self.norm1(x))))
            return x + self.dropout(post_norm(self.post_norm2, self.ffn(self.norm2(x))))
        x = add_dropout_norm(x, self_attention(x), self.norm1, self.dropout, self.fused_add_norm)
        return add_dropout_norm(x, self.ffn(x), self.norm2, self.dropout, self.fused_add_norm)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the source, then the feed-forward network.
    Without cross_attention (a decoder-only model, GPT) the middle sub-layer is absent:
    norm1 guards self-attention and norm3 the feed-forward network in both layouts.

    The decoder's attention uses config.kv_heads key/value heads (MHA, GQA or MQA), its
    self-attention attention_type (default config.attention_type).
    """

    def __init__(self, config: ModelConfig, rotary: Rotary | None = None, *,
                 cross_attention: bool = True, attention_type: AttentionType | None = None):
        super().__init__()
        c = config
        self.self_attn = attention_module(c, c.kv_heads, rotary=rotary, self_attention=True,
                                          attention_type=attention_type)
        self.cross_attn = attention_module(c, c.kv_heads, rotary=None, self_attention=False) \
            if cross_attention else None
        self.ffn = FeedForward(c.d_model, c.d_ff, c.activation, c.bias, c.gated_ffn)
        # (input_norms False: the sub-layers read x as it is, OLMo 2's)
        self.norm1 = norm_module(c) if c.input_norms else nn.Identity()
        self.norm2 = norm_module(c) if cross_attention else None
        # (shared_norm: the FFN reads norm1's output, Phi's)
        self.norm3 = norm_module(c) if c.input_norms and not c.shared_norm else nn.Identity()
        self.post_norm1, self.post_norm3 = sandwich_norm(c), sandwich_norm(c)
        self.post_norm2 = sandwich_norm(c) if cross_attention else None
        self.dropout = Dropout(c.dropout)
        self.norm_first, self.parallel = c.norm_first, c.parallel_residual
        self.shared_norm = c.shared_norm
        self.fused_add_norm = c.attention_impl == "triton"      # (as EncoderLayer's)

    def forward(self, x: Tensor, memory_kv: tuple[Tensor, Tensor] | Tensor | None,
                memory_mask: Tensor | None, *, tgt_mask: Tensor | None = None,
                cache: AttentionCache | None = None, positions: Tensor | None = None,
                position_bias: Tensor | None = None) -> Tensor:
        """x (B, T, C); memory_kv: this layer's cross-attention keys and values
        (B, Hkv, S, D) or their packed projection (B, S, 2 Hkv D: Decoder.memory_kv), None
        without cross-attention; memory_mask (B, 1, 1, S); tgt_mask
        combined with the causal mask (with a cache: over every key it holds and the new
        ones); cache: this layer's self-attention cache when decoding step by step;
        positions (B, T): each token's position, for rows that start at different
        positions (left-padded prompts; default: consecutive from the cache's length);
        position_bias (H, T + S - 1): a relative-position score bias for self-attention
        -> (B, T, C)."""
        def self_attention(h: Tensor) -> Tensor:
            return self.self_attn(h, tgt_mask, causal=True, cache=cache, positions=positions,
                                  position_bias=position_bias)

        def cross_attention(h: Tensor) -> Tensor:
            return self.cross_attn(h, memory_mask, kv=memory_kv)

        if self.parallel:         # (no cross-attention, no sandwich norms: the config's)
            h = self.norm1(x)
            return x + self.dropout(self_attention(h)) + \
                self.dropout(self.ffn(h if self.shared_norm else self.norm3(x)))
        if self.norm_first:
            x = x + self.dropout(post_norm(self.post_norm1, self_attention(self.norm1(x))))
            if self.cross_attn is not None:
                x = x + self.dropout(post_norm(self.post_norm2, cross_attention(self.norm2(x))))
            return x + self.dropout(post_norm(self.post_norm3, self.ffn(self.norm3(x))))
        x = add_dropout_norm(x, self_attention(x), self.norm1, self.dropout, self.fused_add_norm)
        if self.cross_attn is not None:
            x = add_dropout_norm(x, cross_attention(x), self.norm2, self.dropout,
                                 self.fused_add_norm)
        return add_dropout_norm(x, self.ffn(x), self.norm3, self.dropout, self.fused_add_norm)
