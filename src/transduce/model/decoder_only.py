"""The decoder-only Transformer (GPT): the decoder's layers without cross-attention,
predicting each token from the ones before it.

Training and scoring run the whole sequence at once:

    logits = model(tokens)                          # (B, T) right-padded -> (B, T, V)
    hidden = model(tokens, project=False)           # (B, T, C), for a loss that projects

Generation runs in the two phases of incremental decoding, as translation does:

    state = model.prefill(prompt, max_new)          # the prompt but its last token, cached
    logits = model.decode_step(prompt[:, -1:], state)   # then one token per step

Prompts of different lengths are batched left-padded: src_mask (B, 1, 1, P) marks each
row's real tokens, every row's positions count from its first real token, and the
padding stays masked in every later step, so a row generates what it would alone.
The searches of decode/search.py start from the last prompt token as a translation
starts from bos.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from transduce.attention.kv_cache import AttentionCache, plan_rows
from transduce.config import ModelConfig
from transduce.model.counting import CountedParameters
from transduce.model.transformer import (CachedLayers, Decoder, TokenEmbedding,
                                         embedding_norm, init_embeddings, init_linear_layers,
                                         positional_encoding, rotary_embedding)


@dataclass
class LMState(CachedLayers):
    """What generation carries between steps: one self-attention cache per layer, and
    per row which cache positions hold real tokens and how far its positions are shifted
    by left padding."""

    caches: list[AttentionCache]     # (R, Hkv, P + max_new, D) per layer
    key_mask: Tensor                 # (R, P + max_new): True where a real token is (or will be)
    offsets: Tensor                  # (R,) pad tokens before the row's first real one

    @property
    def padded(self) -> bool:
        return bool(self.offsets.any())

    def reorder(self, rows: Tensor, sources: Tensor | None = None) -> None:
        """Keep rows `rows` (R',) in that order (beams, running prompts). There is no
        source side: `sources` is accepted for the searches' sake and not needed."""
        plan = plan_rows(rows, self.caches[0].batch_size)      # the same for every cache
        for cache in self.caches:
            cache.reorder(plan)
        self.key_mask, self.offsets = self.key_mask[rows], self.offsets[rows]

    def allow_rewind(self, tokens: int) -> None:
        """Keep what forgetting the latest `tokens` tokens needs (a speculative search's
        drafts): a ValueError for caches that cannot."""
        for cache in self.caches:
            cache.allow_rewind(tokens)

    def rewind(self, length: int) -> None:
        """Forget the tokens after the first `length` cached (a rejected draft); the
        key mask already counts every later position as real."""
        for cache in self.caches:
            cache.rewind(length)


def left_padded_tokens(prompt: Tensor, src_mask: Tensor | None) -> Tensor:
    """Which of a left-padded prompt's tokens are real: prompt (B, P), src_mask
    (B, 1, 1, P) or None (no padding) -> (B, P) bool; a clear error for anything else."""
    if prompt.shape[1] < 1:
        raise ValueError("a prompt needs at least one token")
    real = torch.ones_like(prompt, dtype=torch.bool) if src_mask is None \
        else src_mask.reshape(prompt.shape)
    if not bool(real[:, -1].all()) or bool((real[:, :-1] & ~real[:, 1:]).any()):
        raise ValueError("prompts must be left-padded: each row's real tokens last")
    return real


class DecoderOnly(CountedParameters, nn.Module):
    """GPT-style language model on the encoder-decoder's Decoder and DecoderLayer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        embedding = nn.Embedding(c.tgt_vocab_size, c.d_model)
        init_embeddings([embedding], c.pad_id)
        # (output_bias: a trained bias per token, Phi's lm_head)
        self.output_proj = nn.Linear(c.d_model, c.tgt_vocab_size, bias=c.output_bias)
        if c.output_bias:
            nn.init.zeros_(self.output_proj.bias)
        if c.tie_embeddings != "none":
            self.output_proj.weight = embedding.weight
        embed = TokenEmbedding(embedding, positional_encoding(c), c.dropout,
                               scale=c.scale_embeddings, norm=embedding_norm(c))
        self.decoder = Decoder(c, embed, rotary_embedding(c), cross_attention=False)
        init_linear_layers(list(self.decoder.modules()))
        if c.tie_embeddings == "none":
            nn.init.normal_(self.output_proj.weight, std=c.d_model ** -0.5)

    def forward(self, tokens: Tensor, *, key_mask: Tensor | None = None,
                project: bool = True) -> Tensor:
        """The full causal pass: tokens (B, T) -> logits (B, T, V), or the hidden states
        (B, T, C) when not project. key_mask (B, T), True for real tokens, is needed only
        for left padding (right padding never reaches an earlier token)."""
        positions = mask = None
        if key_mask is not None:
            positions = (key_mask.long().cumsum(dim=1) - 1).clamp(min=0)     # (B, T)
            mask = key_mask[:, None, None, :]                               # (B, 1, 1, T)
        hidden = self.decoder(tokens, None, None, tgt_mask=mask, positions=positions)
        return self.logits(hidden) if project else hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """Hidden states (..., C) -> logits (..., V): output_proj's, soft-capped where
        the model caps them (logit_softcap: cap * tanh(l / cap), Gemma 2's). Every
        caller that projects hidden states itself goes through here."""
        logits = self.output_proj(hidden)
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prefill(self, prompt: Tensor, max_len: int, *, src_mask: Tensor | None = None,
                cache_dtype: torch.dtype | None = None) -> LMState:
        """Allocate caches for the prompt and max_len new tokens and run every prompt
        token but the last through them in one pass (the searches feed the last one as
        their first step). prompt (B, P) left-padded; src_mask (B, 1, 1, P) True for
        real tokens (None: no padding). cache_dtype torch.int8 quantizes the caches."""
        batch, length = prompt.shape
        real = left_padded_tokens(prompt, src_mask)
        dtype = cache_dtype or self.decoder.embed.embedding.weight.dtype
        caches = self.new_caches(batch, length + max_len, dtype, prompt.device)
        key_mask = torch.ones(batch, length + max_len, dtype=torch.bool, device=prompt.device)
        key_mask[:, :length] = real
        state = LMState(caches, key_mask, (~real).sum(dim=1))
        if length > 1:
            self._run(prompt[:, :-1], state)
        return state

    def decode_step(self, tokens: Tensor, state: LMState) -> Tensor:
        """tokens (B, T_new) follow the state.length tokens cached -> logits
        (B, T_new, V); the caches grow by T_new in place."""
        return self.logits(self._run(tokens, state))

    def _run(self, tokens: Tensor, state: LMState) -> Tensor:
        """tokens (B, T) through the caches -> hidden states (B, T, C)."""
        positions = mask = None
        if state.padded:
            start, steps = state.length, tokens.shape[1]
            index = torch.arange(start, start + steps, device=tokens.device)
            positions = (index[None, :] - state.offsets[:, None]).clamp(min=0)   # (B, T)
            mask = state.key_mask[:, None, None, :start + steps]            # (B, 1, 1, S)
        return self.decoder(tokens, None, None, tgt_mask=mask, caches=state.caches,
                            positions=positions)

    def new_caches(self, batch_size: int, max_len: int, dtype: torch.dtype,
                   device: torch.device | str) -> list[AttentionCache]:
        """One empty self-attention cache per layer, of the kind its attention needs
        (device "meta" to size them without allocating)."""
        c = self.config
        return [layer.self_attn.kind.new_cache(batch_size, c.kv_heads, c.head_dim, max_len,
                                               dtype, device) for layer in self.decoder.layers]

    def attention_modules(self) -> dict[str, list[nn.Module]]:
        """The attention modules by role, one per layer (attention/recorder.py)."""
        return {"decoder": [layer.self_attn for layer in self.decoder.layers]}
