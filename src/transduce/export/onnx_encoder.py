"""An encoder-only model (BERT) as one ONNX graph for classifying and embedding lines:

    sentence_encoder.onnx   ids (B, T) int64, segments (B, T) int64 -> hidden (B, T, C),
                            pooled (B, C), embeddings (B, C), and logits (B, num_labels)
                            when the model has a classification head

A model without segment types (an imported DistilBERT) does not read segments, and its
graph takes ids alone. A token classifier's logits are each token's, (B, T, num_labels),
a question answerer's each token's start and end scores, (B, T, 2).

ids are right-padded with the pad id, which the graph masks as the model does; pooled
is the [CLS] state through the pooler (dense + tanh, or ReLU), embeddings the mean of
the hidden states over the real tokens (not normalised), logits the classifier's (no
softmax). Every size is dynamic; the export is traced as the encoder-decoder's is
(export/onnx.py says why).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from transduce.export.onnx_files import traced_graph
from transduce.model import EncoderOnly
from transduce.onnx_format import SENTENCE_ENCODER


class SentenceEncoderGraph(nn.Module):
    """ids and segments -> every output the SentenceEncoder reads."""

    def __init__(self, model: EncoderOnly):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, segments: Tensor) -> tuple[Tensor, ...]:
        """ids (B, T), segments (B, T) -> hidden (B, T, C), pooled (B, C), embeddings
        (B, C)[, logits (B, K)]."""
        hidden = self.model(ids, segments)
        pooled = self.model.pool(hidden, ids)
        embeddings = self.model.mean_of_real_tokens(hidden, ids)
        if self.model.classifier is None:
            return hidden, pooled, embeddings
        c = self.model.config
        logits = self.model.tag_logits(hidden) if c.token_classifier else \
            self.model.span_logits(hidden) if c.question_answering else \
            self.model.classify_logits(pooled)
        return hidden, pooled, embeddings, logits


def export_sentence_encoder(model: EncoderOnly, out: Path, opset: int) -> list[str]:
    """Trace OUT/sentence_encoder.onnx from two rows, one padded -> the graphs written."""
    c = model.config
    ids = torch.randint(4, c.src_vocab_size, (2, 6))
    ids[1, 4:] = c.pad_id
    segments = torch.zeros_like(ids)
    segments[0, 3:] = min(1, max(c.type_vocab_size - 1, 0))    # RoBERTa's has one type
    outputs = ["hidden", "pooled", "embeddings"] + (["logits"] if c.num_labels else [])
    axes = {"ids": {0: "rows", 1: "length"}, "segments": {0: "rows", 1: "length"},
            "hidden": {0: "rows", 1: "length"}, **{name: {0: "rows"} for name in outputs[1:]}}
    if c.token_classifier or c.question_answering:
        axes["logits"] = {0: "rows", 1: "length"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tracer notes on size checks taken at trace time
        with traced_graph(out / SENTENCE_ENCODER) as path:
            torch.onnx.export(
                SentenceEncoderGraph(model), (ids, segments), str(path),
                dynamo=False, opset_version=opset, input_names=["ids", "segments"],
                output_names=outputs, dynamic_axes=axes)
    return [SENTENCE_ENCODER]
