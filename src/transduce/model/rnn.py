"""RNN encoder-decoders with attention: the models the Transformer replaced.

Both read the source with a bidirectional GRU (or LSTM) of d_model / 2 units per
direction, so that each encoder state h_j has d_model values, and start the decoder from
tanh(W mean_j h_j). They differ in where attention sits:

    Bahdanau et al. (2015), arch "rnn-bahdanau": additive scores from the previous decoder
    state; the context enters the recurrence.
        c_t = Attend(s_{t-1}, h)             s_t = RNN([y_{t-1}; c_t], s_{t-1})
        o_t = tanh(W_o [s_t; c_t; y_{t-1}])  p(y_t) = softmax(E o_t)

    Luong et al. (2015), arch "rnn-luong": "general" scores s_t^T W h_j (or "dot",
    s_t^T h_j) from the current state, combined after the recurrence. Without input
    feeding, training runs the decoder RNN over the whole target at once; with it
    (input_feeding), the previous attentional vector o_{t-1} joins the input, and the
    decoder runs step by step as Bahdanau's does.
        s_t = RNN(y_{t-1} [; o_{t-1}], s_{t-1})   c_t = Attend(s_t, h)
        o_t = tanh(W_c [c_t; s_t])                p(y_t) = softmax(E o_t)

The interface is the Transformer's (forward, prefill, decode_step, a state with reorder),
so training, search, translation and evaluation run unchanged.
Shapes: ids (B, S) / (B, T) right-padded; states (B, S, C) with C = d_model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from transduce.attention import masks
from transduce.attention.scores import AdditiveAttention, DotAttention, GeneralAttention
from transduce.config import ModelConfig
from transduce.model.counting import CountedParameters
from transduce.model.dropout import Dropout
from transduce.model.transformer import init_embeddings

# The decoder RNN's state: (L, B, C), or (hidden, cell) for an LSTM.
Hidden = Tensor | tuple[Tensor, Tensor]


@dataclass
class RNNState:
    """What decoding carries between steps: the source side (fixed) and the decoder RNN's
    state (replaced each step; its size does not grow with the output)."""

    memory: Tensor             # (B, S, C) encoder states, the attention's values
    keys: Tensor               # (B, S, C) the attention's projected keys
    memory_mask: Tensor        # (B, 1, S)
    hidden: Hidden
    length: int = 0
    feed: Tensor | None = None  # (B, 1, C) the last attentional vector, with input feeding

    @property
    def nbytes(self) -> int:
        """Bytes of the per-hypothesis decoding state (the RNN's, instead of a KV cache)."""
        fed = () if self.feed is None else (self.feed,)
        return sum(t.nelement() * t.element_size() for t in (*_tensors(self.hidden), *fed))

    def reorder(self, rows: Tensor, sources: Tensor | None = None) -> None:
        """Keep target rows `rows` (R',) in that order; see DecoderState.reorder. The RNN's
        attention keeps a copy of the source side per target row, so it follows `rows`
        whenever the rows change sentence (sources given) or number."""
        self.hidden = _map_hidden(self.hidden, lambda t: t.index_select(1, rows))
        if self.feed is not None:
            self.feed = self.feed.index_select(0, rows)
        if sources is not None or rows.numel() != self.memory.shape[0]:
            self.memory = self.memory.index_select(0, rows)
            self.keys = self.keys.index_select(0, rows)
            self.memory_mask = self.memory_mask.index_select(0, rows)


class RNNEncoderDecoder(CountedParameters, nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.arch not in ("rnn-bahdanau", "rnn-luong"):
            raise ValueError(f"RNNEncoderDecoder builds rnn-bahdanau or rnn-luong, not {config.arch!r}")
        c = self.config = config
        # The (source, target) languages trained on (a checkpoint writes them in its
        # config.json; load_model reads them back; None when unknown).
        self.languages: tuple[str, str] | None = None
        self.language_codes: dict[str, int] | None = None     # multilingual: none here
        d = c.d_model
        self.additive = c.arch == "rnn-bahdanau"
        self.input_feeding = c.input_feeding
        self.src_embedding = nn.Embedding(c.src_vocab_size, d, padding_idx=c.pad_id)
        self.tgt_embedding = self.src_embedding if c.shares_embeddings else \
            nn.Embedding(c.tgt_vocab_size, d, padding_idx=c.pad_id)
        self.output_proj = nn.Linear(d, c.tgt_vocab_size, bias=False)
        unique = {id(e): e for e in (self.src_embedding, self.tgt_embedding)}  # tied: once
        init_embeddings(list(unique.values()), c.pad_id)
        if c.tie_embeddings in ("all", "decoder"):
            self.output_proj.weight = self.tgt_embedding.weight
        else:
            nn.init.normal_(self.output_proj.weight, std=d ** -0.5)

        rnn = nn.GRU if c.rnn_cell == "gru" else nn.LSTM
        self.encoder = rnn(d, d // 2, c.num_encoder_layers, batch_first=True, bidirectional=True,
                           dropout=c.dropout if c.num_encoder_layers > 1 else 0.0)
        self.bridge = nn.Linear(d, d)
        decoder_input = 2 * d if self.additive or self.input_feeding else d
        self.decoder = rnn(decoder_input, d, c.num_decoder_layers, batch_first=True,
                           dropout=c.dropout if c.num_decoder_layers > 1 else 0.0)
        self.attention = AdditiveAttention(d, d, d) if self.additive else \
            DotAttention() if c.luong_score == "dot" else GeneralAttention(d, d)
        self.readout = nn.Linear(3 * d if self.additive else 2 * d, d)
        self.dropout = Dropout(c.dropout)

    def source_mask(self, src: Tensor) -> Tensor:
        """src (B, S) -> (B, 1, 1, S), as the Transformer's."""
        return masks.padding_mask_from_ids(src, self.config.pad_id)

    def attention_modules(self) -> dict[str, list[nn.Module]]:
        """The attention modules by role (attention/recorder.py): one source-target
        attention, called once per target step (Bahdanau) or once per pass (Luong)."""
        return {"encoder": [], "decoder": [], "cross": [self.attention]}

    def forward(self, src: Tensor, tgt: Tensor, *, project: bool = True) -> Tensor:
        """src (B, S), tgt (B, T) (the shifted-right target) -> logits (B, T, V), or with
        project=False the readout (B, T, C) that output_proj maps to them."""
        return self._decode(tgt, self._start(src), project)

    def prefill(self, src: Tensor, max_len: int, *, src_mask: Tensor | None = None,
                cache_dtype: torch.dtype | None = None) -> RNNState:
        """Encode once and start the decoder. An RNN keeps no KV cache (max_len and an
        int8 cache type have nothing to apply to)."""
        if cache_dtype in (torch.int8, torch.int4):
            raise ValueError(f"an {str(cache_dtype).removeprefix('torch.')} KV cache needs a "
                             "Transformer: an RNN decoder caches no keys and values")
        return self._start(src)

    def decode_step(self, tokens: Tensor, state: RNNState) -> Tensor:
        """tokens (B, T_new) follow the state.length tokens already read -> logits
        (B, T_new, V); the state moves past them."""
        return self._decode(tokens, state)

    def _start(self, src: Tensor) -> RNNState:
        """src (B, S) -> the encoder states and the decoder's initial state."""
        mask = self.source_mask(src)[:, 0]                                  # (B, 1, S)
        lengths = mask.sum(dim=2).squeeze(1).clamp(min=1).cpu()
        packed = pack_padded_sequence(self.dropout(self.src_embedding(src)), lengths,
                                      batch_first=True, enforce_sorted=False)
        memory, _ = pad_packed_sequence(self.encoder(packed)[0], batch_first=True,
                                        total_length=src.shape[1])          # (B, S, C)
        mean = memory.sum(dim=1) / lengths.to(memory.device, memory.dtype)[:, None]
        start = torch.tanh(self.bridge(mean)).expand(self.config.num_decoder_layers, -1, -1)
        start = start.contiguous()                                          # (L, B, C)
        hidden = (start, torch.zeros_like(start)) if self.config.rnn_cell == "lstm" else start
        feed = memory.new_zeros(memory.shape[0], 1, memory.shape[2]) if self.input_feeding else None
        return RNNState(memory, self.attention.project_keys(memory), mask, hidden, feed=feed)

    def _decode(self, tokens: Tensor, state: RNNState, project: bool = True) -> Tensor:
        """tokens (B, T) -> logits (B, T, V) (or the readout (B, T, C) when not project),
        advancing state.hidden by T steps."""
        embedded = self.dropout(self.tgt_embedding(tokens))                 # (B, T, C)
        if self.additive:
            outputs, contexts = [], []
            for t in range(tokens.shape[1]):
                query = _top(state.hidden).unsqueeze(1)                      # (B, 1, C)
                context, _ = self.attention(query, state.memory, state.memory,
                                            state.memory_mask, projected_keys=state.keys)
                step_input = torch.cat([embedded[:, t:t + 1], context], dim=-1)
                output, state.hidden = self.decoder(step_input, state.hidden)
                outputs.append(output)
                contexts.append(context)
            output, context = torch.cat(outputs, dim=1), torch.cat(contexts, dim=1)
            readout = self.dropout(torch.tanh(self.readout(torch.cat([output, context, embedded], -1))))
        elif self.input_feeding:
            readout = torch.cat([self._luong_step(embedded[:, t:t + 1], state)
                                 for t in range(tokens.shape[1])], dim=1)
        else:
            output, state.hidden = self.decoder(embedded, state.hidden)      # (B, T, C)
            readout = self._luong_readout(output, state)
        state.length += tokens.shape[1]
        return self.output_proj(readout) if project else readout             # (B, T, C)

    def _luong_readout(self, output: Tensor, state: RNNState) -> Tensor:
        """Decoder states (B, T, C) -> attentional vectors o_t (B, T, C), dropped out."""
        context, _ = self.attention(output, state.memory, state.memory, state.memory_mask,
                                    projected_keys=state.keys)
        return self.dropout(torch.tanh(self.readout(torch.cat([context, output], dim=-1))))

    def _luong_step(self, embedded: Tensor, state: RNNState) -> Tensor:
        """Input feeding, one step: [y_{t-1}; o_{t-1}] (B, 1, 2C) into the RNN -> o_t."""
        output, state.hidden = self.decoder(torch.cat([embedded, state.feed], dim=-1),
                                            state.hidden)
        state.feed = self._luong_readout(output, state)
        return state.feed


def _tensors(hidden: Hidden) -> tuple[Tensor, ...]:
    return hidden if isinstance(hidden, tuple) else (hidden,)


def _map_hidden(hidden: Hidden, function) -> Hidden:
    return tuple(map(function, hidden)) if isinstance(hidden, tuple) else function(hidden)


def _top(hidden: Hidden) -> Tensor:
    """The last layer's hidden state (B, C): what attention is queried with."""
    return (hidden[0] if isinstance(hidden, tuple) else hidden)[-1]
