"""The encoder-decoder Transformer of "Attention Is All You Need".

Training runs the whole target at once (teacher forcing):

    logits = model(src, tgt_in)                    # src (B, S), tgt_in (B, T) -> (B, T, V)
    hidden = model(src, tgt_in, project=False)     # (B, T, C), for a loss that projects itself
    hidden = model(src, tgt_in, project=False, segments=(src_numbers, tgt_numbers))
                                                   # packed rows: several pairs per row

Decoding runs in two phases:

    state = model.prefill(src)                     # encode once; cross-attention K/V once
    logits = model.decode_step(tokens, state)      # tokens (B, T_new): appended to the caches

Token ids are right-padded with config.pad_id.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from transduce.attention import masks
from transduce.attention.disentangled import DisentangledPositions
from transduce.attention.kinds import self_attention_kind
from transduce.attention.kv_cache import AttentionCache, keep_rows, plan_rows
from transduce.config import ModelConfig
from transduce.model.decoder_step import DecoderStep
from transduce.model.counting import CountedParameters
from transduce.model.dropout import Dropout
from transduce.model.encoder_pass import EncoderPass
from transduce.model.layers import DecoderLayer, EncoderLayer, norm_module
from transduce.attention.position_bias import ALiBi, T5Bias
from transduce.model.positional import (FairseqPositionalEncoding, LearnedPositionalEmbedding,
                                        RotaryEmbedding, SinusoidalPositionalEncoding,
                                        TablePositions, rotary_frequencies)


def init_embeddings(embeddings: list[nn.Embedding], pad_id: int) -> None:
    """Embeddings N(0, d^-1/2), so that after the sqrt(d) scale they have unit size; the
    pad row is zero."""
    for embedding in embeddings:
        nn.init.normal_(embedding.weight, std=embedding.embedding_dim ** -0.5)
        with torch.no_grad():
            embedding.weight[pad_id].zero_()


class TokenEmbedding(nn.Module):
    """Token vectors multiplied by sqrt(d_model) (unless scale is False, as in GPT-2),
    plus additive positions (unless rotary), a norm where there is one (mBART's), then
    dropout: the input of each stack."""

    def __init__(self, embedding: nn.Embedding, positions: TablePositions | None,
                 dropout: float, *, scale: bool = True, norm: nn.Module | None = None):
        super().__init__()
        self.embedding = embedding
        self.positions = positions
        self.scale = math.sqrt(embedding.embedding_dim) if scale else 1.0
        self.norm = norm
        self.dropout = Dropout(dropout)

    def forward(self, ids: Tensor, start: int = 0, positions: Tensor | None = None) -> Tensor:
        """ids (B, T), first position `start`, or each token's own position (B, T)
        -> (B, T, C)."""
        x = self.embedding(ids)
        if self.scale != 1.0:
            x = x * self.scale
        if self.positions is not None:
            x = x + (self.positions(ids.shape[1], start) if positions is None
                     else self.positions.lookup(positions))
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def embedding_norm(config: ModelConfig) -> nn.Module | None:
    """The norm of a stack's input where config.embedding_norm asks for one."""
    return norm_module(config) if config.embedding_norm else None


def positional_encoding(config: ModelConfig, width: int | None = None
                        ) -> TablePositions | None:
    """The additive position table config.positional names, `width` wide (default
    d_model; None: rotary, which enters inside self-attention, and the score biases t5
    and alibi)."""
    width = config.d_model if width is None else width
    if config.positional == "sinusoidal":
        return SinusoidalPositionalEncoding(width, config.max_positions)
    if config.positional == "learned":
        return LearnedPositionalEmbedding(width, config.max_positions)
    if config.positional == "fairseq":
        return FairseqPositionalEncoding(width, config.max_positions)
    return None


def score_bias(config: ModelConfig, *, bidirectional: bool) -> ALiBi | T5Bias | None:
    """The relative-position score bias config.positional names, one per stack's
    self-attention (shared by its layers, as in T5); None for the other kinds."""
    if config.positional == "alibi":
        return ALiBi(config.num_heads)
    if config.positional == "t5":
        return T5Bias(config.num_heads, bidirectional=bidirectional)
    return None


def rotary_embedding(config: ModelConfig, *, local: bool = False) -> RotaryEmbedding | None:
    """The model's rotary positions (None: it has none); local: those of its sliding
    layers among full ones, at local_rope_base and unscaled."""
    c = config
    if c.positional != "rotary":
        return None
    if local:
        rates = rotary_frequencies(c.head_dim, c.local_rope_base, rotary_dims=c.rotary_dims)
    else:
        rates = rotary_frequencies(c.head_dim, c.rope_base, c.rope_scaling, c.rope_factor,
                                   c.rope_low_freq_factor, c.rope_high_freq_factor,
                                   c.rope_original_positions, c.rotary_dims)
    return RotaryEmbedding(c.head_dim, c.max_positions, inv_freq=rates)


def layer_rotaries(config: ModelConfig, rotary: RotaryEmbedding | None, layers: int
                   ) -> list[RotaryEmbedding | None]:
    """Each layer's rotary positions: the model's, but on sliding layers among full ones
    where they have their own (local_rope_base: Gemma 3's, ModernBERT's), one shared."""
    local = rotary if config.local_rope_base is None else \
        rotary_embedding(config, local=True)
    return [local if config.layer_attention_type(i) == "sliding" else rotary
            for i in range(layers)]


def init_linear_layers(modules: list[nn.Module]) -> None:
    """Xavier-uniform weights and zero biases for every Linear among the modules."""
    for module in modules:
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class Encoder(nn.Module):
    """The encoder stack: of the encoder-decoder, or of an encoder-only model (BERT)."""

    def __init__(self, config: ModelConfig, embed: nn.Module, rotary: RotaryEmbedding | None):
        super().__init__()
        self.embed = embed
        rotaries = layer_rotaries(config, rotary, config.num_encoder_layers)
        self.layers = nn.ModuleList(
            EncoderLayer(config, rotaries[i], attention_type=config.layer_attention_type(i),
                         attention_norm=i > 0 or config.first_attention_norm)
            for i in range(config.num_encoder_layers))
        self.score_bias = score_bias(config, bidirectional=True)
        self.relative_positions = DisentangledPositions(
            config.d_model, config.position_buckets, config.relative_reach,
            norm_module(config), config.dropout) if config.positional == "disentangled" \
            else None
        self.final_norm = norm_module(config) if config.norm_first else None
        # A decoding copy's written-out layers (model/encoder_pass.py), where they apply.
        self.fast_pass: EncoderPass | None = None

    def forward(self, src: Tensor, src_mask: Tensor | None, **embed_inputs: Tensor) -> Tensor:
        """src (B, S), src_mask (B, 1, 1, S) -> memory (B, S, C). embed_inputs go to the
        embedding with src (an encoder-only model's segment ids; each token's positions
        (B, S), which place rotary too)."""
        if self.fast_pass is not None and self.fast_pass.covers(src):
            return self.fast_pass(src, src_mask, **embed_inputs)
        x = self.embed(src, **embed_inputs)
        length = src.shape[1]
        positions = embed_inputs.get("positions")
        bias = None if self.score_bias is None else self.score_bias(length, length)
        relative = None if self.relative_positions is None else \
            self.relative_positions(length, positions)
        for layer in self.layers:
            x = layer(x, src_mask, position_bias=bias, positions=positions, relative=relative)
        return x if self.final_norm is None else self.final_norm(x)


class Decoder(nn.Module):
    """The decoder stack; without cross_attention, a decoder-only model's (GPT)."""

    def __init__(self, config: ModelConfig, embed: TokenEmbedding,
                 rotary: RotaryEmbedding | None, *, cross_attention: bool = True):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer_rotary, cross_attention=cross_attention,
                         attention_type=config.layer_attention_type(i))
            for i, layer_rotary in enumerate(
                layer_rotaries(config, rotary, config.num_decoder_layers)))
        self.score_bias = score_bias(config, bidirectional=False)
        self.final_norm = norm_module(config) if config.norm_first else None
        # A decoding copy's written-out step (model/decoder_step.py), where it applies.
        self.fast_step: DecoderStep | None = None

    def memory_kv(self, memory: Tensor, packed: bool = False
                  ) -> list[tuple[Tensor, Tensor]] | list[Tensor]:
        """Each layer's cross-attention keys and values, (B, Hkv, S, D): once per source.
        packed: a full pass's, which hands them straight to the layers (in training with
        impl "triton", each layer's stacked projection output: MultiHeadAttention.project_kv)."""
        return [layer.cross_attn.project_kv(memory, packed) for layer in self.layers]

    def forward(self, tgt: Tensor, memory_kv: list[tuple[Tensor, Tensor]] | list[Tensor] | None,
                memory_mask: Tensor | None, *, tgt_mask: Tensor | None = None,
                caches: list[AttentionCache] | None = None,
                positions: Tensor | None = None) -> Tensor:
        """tgt (B, T) -> hidden states (B, T, C). With caches, tgt holds only the new
        tokens, whose positions start after what the caches hold, unless positions
        (B, T) gives each token's own. memory_kv None: no cross-attention."""
        if self.fast_step is not None and self.fast_step.covers(tgt, caches):
            return self.fast_step(tgt, memory_kv, memory_mask, tgt_mask, caches, positions)
        start = 0 if caches is None else caches[0].length
        x = self.embed(tgt, start, positions)
        # Relative positions: the new queries against every key, cached ones included
        # (left padding shifts queries and keys alike, so the distances hold).
        bias = None if self.score_bias is None else \
            self.score_bias(tgt.shape[1], start + tgt.shape[1])
        for i, layer in enumerate(self.layers):
            x = layer(x, None if memory_kv is None else memory_kv[i], memory_mask,
                      tgt_mask=tgt_mask, cache=None if caches is None else caches[i],
                      positions=positions, position_bias=bias)
        return x if self.final_norm is None else self.final_norm(x)


class CachedLayers:
    """A decoding state's self-attention caches, one per decoder layer."""

    caches: list[AttentionCache]

    @property
    def length(self) -> int:
        """Tokens decoded (or cached) so far."""
        return self.caches[0].length

    @property
    def nbytes(self) -> int:
        """Bytes of the self-attention caches (the part that grows with the output)."""
        return sum(cache.nbytes for cache in self.caches)


@dataclass
class DecoderState(CachedLayers):
    """What the decode phase carries between steps: the source's cross-attention keys and
    values (fixed, one row per sentence) and one self-attention cache per decoder layer
    (one row per target row: per sentence, or per beam)."""

    memory_kv: list[tuple[Tensor, Tensor]]   # (B, Hkv, S, D) per layer
    memory_mask: Tensor                      # (B, 1, 1, S)
    caches: list[AttentionCache]             # (R, Hkv, T, D) per layer, R = B * n

    def reorder(self, rows: Tensor, sources: Tensor | None = None) -> None:
        """Keep target rows `rows` (R',) in that order, and source sentences `sources` (B',)
        when the set of sentences changes (None: the sources stay as they are).

        The source side is held once per sentence and the target rows are grouped by
        sentence, n = R / B rows each: row r reads source r // n. Beam search starts with
        rows = [0]*K + [1]*K + ... (K beams per sentence, sources unchanged), reorders the
        beams of each sentence among themselves, and drops finished sentences (sources).
        """
        plan = plan_rows(rows, self.caches[0].batch_size)      # the same for every cache
        for cache in self.caches:
            cache.reorder(plan)
        if sources is not None:
            source_plan = plan_rows(sources, self.memory_mask.shape[0])
            self.memory_kv = [(keep_rows(k, source_plan), keep_rows(v, source_plan))
                              for k, v in self.memory_kv]
            self.memory_mask = keep_rows(self.memory_mask, source_plan)


# The output bias of a token the model never outputs (ModelConfig.output_bias: pad and bos
# of an imported Marian model): a probability of 0, as -inf would give, but finite, as
# every weight of a checkpoint must be, and exact in float32 and bfloat16 alike, so that
# a bfloat16 copy for decoding holds it too (float32's lowest number rounds to -inf there).
NEVER_OUTPUT = -2.0 ** 100


class Transformer(CountedParameters, nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        # The (source, target) languages trained on (a checkpoint writes them in its
        # config.json; load_model reads them back; None when unknown).
        self.languages: tuple[str, str] | None = None
        # A multilingual model's language codes -> token ids (decode/languages.py).
        self.language_codes: dict[str, int] | None = None
        src_embedding = nn.Embedding(c.src_vocab_size, c.d_model, padding_idx=c.pad_id)
        tgt_embedding = src_embedding if c.shares_embeddings else \
            nn.Embedding(c.tgt_vocab_size, c.d_model, padding_idx=c.pad_id)
        self.output_proj = nn.Linear(c.d_model, c.tgt_vocab_size, bias=c.output_bias)
        if c.output_bias:     # fixed, never trained: transformers' Marian keeps its
            # final_logits_bias as a buffer, and NLLB has none (export/hf_nllb.py)
            self.output_proj.bias = nn.Parameter(torch.zeros(c.tgt_vocab_size),
                                                 requires_grad=False)
        init_embeddings([src_embedding, tgt_embedding], c.pad_id)
        if c.tie_embeddings in ("all", "decoder"):
            self.output_proj.weight = tgt_embedding.weight

        rotary = rotary_embedding(c)
        scale = c.scale_embeddings
        self.encoder = Encoder(c, TokenEmbedding(src_embedding, positional_encoding(c),
                                                 c.dropout, scale=scale,
                                                 norm=embedding_norm(c)), rotary)
        self.decoder = Decoder(c, TokenEmbedding(tgt_embedding, positional_encoding(c),
                                                 c.dropout, scale=scale,
                                                 norm=embedding_norm(c)), rotary)
        # Every projection but the output, which is tied or drawn like an embedding.
        init_linear_layers([*self.encoder.modules(), *self.decoder.modules()])
        if c.tie_embeddings in ("none", "embeddings"):
            nn.init.normal_(self.output_proj.weight, std=c.d_model ** -0.5)

    def source_mask(self, src: Tensor) -> Tensor:
        """src (B, S) -> (B, 1, 1, S): every non-pad source token may be attended."""
        return masks.padding_mask_from_ids(src, self.config.pad_id)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src (B, S) token ids -> memory (B, S, C). src_mask defaults to the pad mask."""
        return self.encoder(src, self.source_mask(src) if src_mask is None else src_mask)

    def decode(self, tgt: Tensor, memory: Tensor, memory_mask: Tensor | None,
               tgt_mask: Tensor | None = None, *, project: bool = True) -> Tensor:
        """The full causal pass: tgt (B, T), memory (B, S, C), memory_mask (B, 1, 1, S)
        -> logits (B, T, V), or the hidden states (B, T, C) before output_proj when not
        project. tgt_mask is combined with the causal mask."""
        hidden = self.decoder(tgt, self.decoder.memory_kv(memory, packed=True), memory_mask,
                              tgt_mask=tgt_mask)
        return self.output_proj(hidden) if project else hidden

    def forward(self, src: Tensor, tgt: Tensor, *, project: bool = True,
                segments: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """src (B, S), tgt (B, T) (the shifted-right target) -> logits (B, T, V); with
        project=False the hidden states (B, T, C) that output_proj would map to them, for
        a loss that does the projection itself (train/loss.py).

        segments: packed rows (data/packing.py), each holding several pairs: the sentence
        number of every source (B, S) and target (B, T) token, pair i of a row being
        source i and target i of that row (attention/masks.py: Segments)."""
        if segments is not None:
            return self._packed_forward(src, tgt, *segments, project=project)
        src_mask = self.source_mask(src)
        return self.decode(tgt, self.encode(src, src_mask), src_mask, project=project)

    def _packed_forward(self, src: Tensor, tgt: Tensor, src_numbers: Tensor,
                        tgt_numbers: Tensor, *, project: bool) -> Tensor:
        """forward() over packed rows: every attention stays inside its own pair, and
        positions (tables, rotary) count from each sentence's first token, so each pair
        computes what it would alone (the score biases see only distances inside a
        sentence, which packing does not change)."""
        if self.config.attention_type != "softmax":
            raise ValueError(f"packed rows need softmax attention, not attention_type="
                             f"{self.config.attention_type!r}")
        src_positions = masks.positions_in_segments(src_numbers)              # (B, S)
        tgt_positions = masks.positions_in_segments(tgt_numbers)              # (B, T)
        memory = self.encoder(src, masks.Segments.packed(src_numbers, src_numbers),
                              positions=src_positions)
        hidden = self.decoder(tgt, self.decoder.memory_kv(memory, packed=True),
                              masks.Segments.packed(tgt_numbers, src_numbers),
                              tgt_mask=masks.Segments.packed(tgt_numbers, tgt_numbers),
                              positions=tgt_positions)
        return self.output_proj(hidden) if project else hidden

    def prefill(self, src: Tensor, max_len: int, *, src_mask: Tensor | None = None,
                cache_dtype: torch.dtype | None = None) -> DecoderState:
        """The prefill phase: encode the source, compute every layer's cross-attention keys
        and values once, and allocate self-attention caches for max_len target tokens.
        cache_dtype torch.int8 stores the keys and values quantized (softmax attention)."""
        src_mask = self.source_mask(src) if src_mask is None else src_mask
        memory = self.encode(src, src_mask)
        caches = self.new_caches(src.shape[0], max_len, cache_dtype or memory.dtype, src.device)
        return DecoderState(self.decoder.memory_kv(memory), src_mask, caches)

    def new_caches(self, batch_size: int, max_len: int, dtype: torch.dtype,
                   device: torch.device | str) -> list[AttentionCache]:
        """One empty self-attention cache per decoder layer, of the kind its attention
        needs (device "meta" to size them without allocating)."""
        c = self.config
        return [layer.self_attn.kind.new_cache(batch_size, c.kv_heads, c.head_dim, max_len,
                                               dtype, device) for layer in self.decoder.layers]

    def attention_modules(self) -> dict[str, list[nn.Module]]:
        """The attention modules by role, one per layer (attention/recorder.py)."""
        return {"encoder": [layer.self_attn for layer in self.encoder.layers],
                "decoder": [layer.self_attn for layer in self.decoder.layers],
                "cross": [layer.cross_attn for layer in self.decoder.layers]}

    def decode_step(self, tokens: Tensor, state: DecoderState) -> Tensor:
        """The decode phase: tokens (B, T_new) follow the state.length tokens already
        cached -> logits (B, T_new, V). The caches grow by T_new in place."""
        hidden = self.decoder(tokens, state.memory_kv, state.memory_mask, caches=state.caches)
        return self.output_proj(hidden)


def kv_cache_size(config: ModelConfig, batch: int, tokens: int,
                  dtype: torch.dtype) -> tuple[int, str]:
    """Bytes of the decoder's self-attention caches after `tokens` tokens, by the
    formula of each attention kind (layers x its per-layer size), and the formula in
    words. The caches' measured nbytes equal it (tested)."""
    layers = Counter(config.layer_attention_type(i) for i in range(config.num_decoder_layers))
    total, formulas = 0, []       # by attention type: sliding layers among full ones
    for name, count in layers.items():
        kind = self_attention_kind(name, config.attention_window)
        size, words = kind.cache_bytes(batch, tokens, config.kv_heads, config.head_dim, dtype)
        total += count * size
        formulas.append(f"layers {count} x {words}")
    return total, " + ".join(formulas)
