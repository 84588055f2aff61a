"""ONNX Runtime running an encoder-only export (export/onnx_encoder.py) behind the
SentenceEncoder: `config`, `labels`, and the two things it reads of a batch,
`class_logits(ids)` and `embeddings(ids)`, as a PyTorch EncoderOnly gives them
(decode/encode.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from transduce import checkpoint
from transduce.decode.onnx_engine import ExportedModel, open_session
from transduce.onnx_format import SENTENCE_ENCODER


class OnnxSentenceEncoder(ExportedModel):
    """An encoder-only model's export run by ONNX Runtime on the CPU (threads: as
    onnx_engine.open_session)."""

    def __init__(self, directory: Path | str, threads: int = 0):
        directory = Path(directory)
        super().__init__(directory, "encoder", "classify and embed need an encoder-only model")
        self.labels = checkpoint.read_labels(directory)
        self.classifier_inputs = checkpoint.read_classifier_inputs(directory)
        self.sentence_embedding = checkpoint.read_sentence_embedding(directory)
        self.session = open_session(directory, SENTENCE_ENCODER, threads)
        # A model without segment types (DistilBERT) exports a graph of ids alone.
        self.reads_segments = "segments" in {i.name for i in self.session.get_inputs()}

    def class_logits(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        """ids (B, T) right-padded, segments (B, T) (None: all 0) -> the classifier's
        logits (B, num_labels)."""
        return self._run(ids, "logits", segments)

    def token_logits(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        """A head over each token's (a token classifier's, a question answerer's): ids,
        segments (B, T) right-padded -> (B, T, num_labels)."""
        return self._run(ids, "logits", segments)

    def embeddings(self, ids: Tensor, pooling: str = "mean") -> Tensor:
        """ids (B, T) right-padded -> the mean hidden state over real tokens, or the
        first token's ("cls"): (B, C)."""
        return self._run(ids, "hidden")[:, 0] if pooling == "cls" else \
            self._run(ids, "embeddings")

    def _run(self, ids: Tensor, output: str, segments: Tensor | None = None) -> Tensor:
        array = ids.cpu().numpy().astype(np.int64)
        feeds = {"ids": array}
        if self.reads_segments:
            feeds["segments"] = np.zeros_like(array) if segments is None \
                else segments.cpu().numpy().astype(np.int64)
        return torch.from_numpy(self.session.run([output], feeds)[0])
