"""The encoder-only Transformer (BERT): the encoder's layers over a sentence or a pair of
sentences, with the heads of its pre-training and fine-tuning.

    hidden = model(ids, segments)               # (B, T) -> (B, T, C); pad id masked
    pooled = model.pool(hidden, ids)            # dense + tanh over [CLS]: (B, C)
    model.mlm_logits(hidden)                    # (B, T, V): the masked-LM head
    model.nsp_logits(pooled)                    # (B, 2): is sentence B the next one?
    model.classify_logits(pooled)               # (B, num_labels)
    model.tag_logits(hidden)                    # (B, T, num_labels): a token classifier's
    model.span_logits(hidden)                   # (B, T, 2): a question answerer's start, end
    model.sentence_embeddings(ids)              # mean over real tokens ([CLS]'s): (B, C)

The input is [CLS] A [SEP] (B [SEP]), segment 0 for A and its markers, 1 for B.
Embeddings (Devlin et al. 2019): token + learned position + segment, then LayerNorm and
dropout. The layers are post-norm with exact GELU, as the encoder-decoder's EncoderLayer
computes them. DistilBERT (Sanh et al. 2019) is the same model without segment
embeddings (type_vocab_size 0) and with a ReLU pooler (its pre_classifier).

ModernBERT (Warner et al. 2024) is the same model in a newer layout, each part a field
of ModelConfig: pre-norm layers of bias-free LayerNorms (the first without its attention
norm), rotary positions, GeGLU feed-forward networks, sliding-window layers (64 tokens
each side) with one full layer in three, and heads that read through a prediction head
(dense, GELU, norm: prediction_head), over [CLS] or the mean of the tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transduce.attention import masks
from transduce.config import ModelConfig
from transduce.model.counting import CountedParameters
from transduce.model.dropout import Dropout
from transduce.model.layers import activation_module, norm_module
from transduce.model.transformer import Encoder, init_linear_layers, positional_encoding, \
    rotary_embedding

INIT_STD = 0.02   # BERT's initialiser: every weight N(0, 0.02), biases 0, LayerNorm 1 / 0
POOLER_ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu}


class SegmentedEmbedding(nn.Module):
    """Token + position + segment embeddings, LayerNorm, dropout: BERT's input layer.
    Without segment types (type_vocab_size 0) segment ids are not read. Embeddings
    narrower than the layers (embedding_size: ELECTRA-small's) are then projected to
    d_model."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        width = c.embedding_width
        self.embedding = nn.Embedding(c.src_vocab_size, width)
        self.positions = positional_encoding(c, width)   # a table (learned, BERT's), or None
        self.segments = nn.Embedding(c.type_vocab_size, width) if c.type_vocab_size \
            else None
        self.norm = norm_module(c, width)
        self.dropout = Dropout(c.dropout)
        self.project = nn.Linear(width, c.d_model) if c.embedding_size else None

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        """ids (B, T), segments (B, T) (None: all 0) -> (B, T, C)."""
        x = self.embedding(ids)                                   # (B, T, E)
        if self.positions is not None:
            x = x + self.positions(ids.shape[1])
        if self.segments is not None:
            x = x + (self.segments.weight[0] if segments is None else self.segments(segments))
        x = self.dropout(self.norm(x))
        return x if self.project is None else self.project(x)    # (B, T, C)


class MaskedLMHead(nn.Module):
    """dense + activation (GELU in BERT) + LayerNorm, then the token embeddings (tied) and
    a bias: (B, T, V). Its dense layer maps to the embeddings' width (an ELECTRA
    generator's, where they are narrower than the layers)."""

    def __init__(self, config: ModelConfig, embedding: nn.Embedding):
        super().__init__()
        width = config.embedding_width
        self.dense = nn.Linear(config.d_model, width, bias=config.bias)
        self.activation = activation_module(config.activation)   # BERT's hidden_act
        self.norm = norm_module(config, width)
        self.decoder = nn.Linear(width, config.src_vocab_size)
        self.decoder.weight = embedding.weight

    def transform(self, hidden: Tensor) -> Tensor:
        """(..., C) -> (..., E): what the tied output matrix multiplies."""
        return self.norm(self.activation(self.dense(hidden)))

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.transform(hidden))


class EncoderOnly(CountedParameters, nn.Module):
    """BERT on the encoder-decoder's Encoder and EncoderLayer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        embed = SegmentedEmbedding(c)
        self.encoder = Encoder(c, embed, rotary_embedding(c))
        self.pooler = nn.Linear(c.d_model, c.d_model, bias=c.bias)
        # ModernBERT's prediction head ends with a norm, and every fine-tuning head reads
        # through it.
        self.pooler_norm = norm_module(c) if c.prediction_head else None
        self.mlm_head = MaskedLMHead(c, embed.embedding)
        self.nsp_head = nn.Linear(c.d_model, 2)
        self.classifier = nn.Linear(c.d_model, c.num_labels) if c.num_labels else None
        # The classes' names, in the classifier's order (a checkpoint writes them in its
        # config.json; load_model reads them back).
        self.labels: list[str] | None = None
        # How its sentence embeddings are made by default, {"pooling", "normalize"}, when
        # the checkpoint records it (an imported sentence-transformers model's).
        self.sentence_embedding: dict | None = None
        self.head_dropout = Dropout(c.dropout)
        self._init_weights()

    def _init_weights(self) -> None:
        """BERT's: N(0, 0.02) for every matrix, zero biases, unit LayerNorms."""
        init_linear_layers(list(self.modules()))
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
        with torch.no_grad():
            self.embed.embedding.weight[self.config.pad_id].zero_()

    @property
    def embed(self) -> SegmentedEmbedding:
        return self.encoder.embed

    @property
    def output_proj(self) -> nn.Linear:
        """The tied output matrix (V, C) (what training's projected loss multiplies)."""
        return self.mlm_head.decoder

    def padding_mask(self, ids: Tensor) -> Tensor:
        """(B, T) -> (B, 1, 1, T): every non-pad token may be attended."""
        return masks.padding_mask_from_ids(ids, self.config.pad_id)

    def forward(self, ids: Tensor, segments: Tensor | None = None, *,
                key_mask: Tensor | None = None) -> Tensor:
        """ids (B, T) right-padded, segments (B, T) -> hidden states (B, T, C). key_mask
        (B, T), True for real tokens, defaults to ids != pad_id."""
        mask = self.padding_mask(ids) if key_mask is None else key_mask[:, None, None, :]
        inputs = {} if segments is None else {"segments": segments}
        return self.encoder(ids, mask, **inputs)

    def pool(self, hidden: Tensor, ids: Tensor | None = None) -> Tensor:
        """The first token's ([CLS]) state, or the mean of the real tokens' (ids (B, T)
        tell them: classifier_pooling "mean"), through dense + tanh (DistilBERT's: ReLU,
        ELECTRA's: GELU; ModernBERT's: GELU and a norm): (B, T, C) -> (B, C)."""
        if self.config.classifier_pooling == "cls":
            return self._head_transform(hidden[:, 0])
        if ids is None:
            raise ValueError("this model's pooler averages the real tokens "
                             "(classifier_pooling 'mean'): pass the ids")
        return self._head_transform(self.mean_of_real_tokens(hidden, ids))

    def _head_transform(self, states: Tensor) -> Tensor:
        """The pooler's dense layer, its activation and, for a prediction head, the norm:
        (..., C) -> (..., C)."""
        states = POOLER_ACTIVATIONS[self.config.pooler_activation](self.pooler(states))
        return states if self.pooler_norm is None else self.pooler_norm(states)

    def _token_head_input(self, hidden: Tensor) -> Tensor:
        """What a head over each token reads: its state, through the prediction head
        where the model has one (ModernBERT's), then dropout: (..., C) -> (..., C)."""
        if self.config.prediction_head:
            hidden = self._head_transform(hidden)
        return self.head_dropout(hidden)

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, V)."""
        return self.mlm_head(hidden)

    def nsp_logits(self, pooled: Tensor) -> Tensor:
        """(B, C) -> (B, 2): logit 0 "B follows A", logit 1 "B is random" (BERT's order)."""
        return self.nsp_head(pooled)

    def classify_logits(self, pooled: Tensor) -> Tensor:
        """(B, C) -> (B, num_labels), through dropout as in fine-tuning."""
        if self.classifier is None:
            raise ValueError("this model has no classification head (num_labels=0); "
                             "fine-tune it with --task classify")
        if self.config.token_classifier or self.config.question_answering:
            raise ValueError("this model's head reads each token (token_classifier or "
                             "question_answering), not the sequence")
        return self.classifier(self.head_dropout(pooled))

    def tag_logits(self, hidden: Tensor) -> Tensor:
        """A token classifier's: (B, T, C) -> (B, T, num_labels), through dropout as in
        fine-tuning."""
        if self.classifier is None or not self.config.token_classifier:
            raise ValueError("this model has no token-classification head; fine-tune it "
                             "with --task tag")
        return self.classifier(self._token_head_input(hidden))

    def span_logits(self, hidden: Tensor) -> Tensor:
        """A question answerer's: (B, T, C) -> (B, T, 2), each token's score of starting
        (0) and of ending (1) the answer."""
        if not self.config.question_answering:
            raise ValueError("this model has no question-answering head")
        return self.classifier(self._token_head_input(hidden))

    def sentence_embeddings(self, ids: Tensor, segments: Tensor | None = None, *,
                            normalize: bool = False, pooling: str = "mean") -> Tensor:
        """The last hidden states pooled as sentence-transformers pools them, "mean" over
        the non-pad tokens or "cls" (the first token's), optionally L2-normalised:
        ids (B, T) -> (B, C)."""
        hidden = self(ids, segments)
        if pooling == "cls":
            pooled = hidden[:, 0]
        elif pooling == "mean":
            pooled = self.mean_of_real_tokens(hidden, ids)
        else:
            raise ValueError(f"pooling={pooling!r}: choose 'mean' or 'cls'")
        return F.normalize(pooled, dim=-1) if normalize else pooled

    def mean_of_real_tokens(self, hidden: Tensor, ids: Tensor) -> Tensor:
        """The mean of the non-pad tokens' states: hidden (B, T, C), ids (B, T) -> (B, C)."""
        real = (ids != self.config.pad_id).unsqueeze(-1).to(hidden.dtype)      # (B, T, 1)
        return (hidden * real).sum(dim=1) / real.sum(dim=1).clamp_min(1.0)

    def attention_modules(self) -> dict[str, list[nn.Module]]:
        """The attention modules by role, one per layer (attention/recorder.py)."""
        return {"encoder": [layer.self_attn for layer in self.encoder.layers]}
