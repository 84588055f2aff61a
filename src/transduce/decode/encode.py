"""Lines in, labels or vectors out: an encoder-only model (BERT) classifying and embedding.

    encoder = SentenceEncoder.load("runs/genre/ema")
    encoder.classify(["And Jesus wept."])      # -> [Prediction("gospels and Acts", 0.93, {...})]
    encoder.embed(lines, normalize=True)      # -> (N, C) float32 numpy array

Each line is read as [CLS] line [SEP] (the tokenizer's bos and eos), segment 0. Lines
are sorted by length and batched by tokens, N lines in give N results out in order. A
line longer than the model reads is truncated with a warning naming it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from transduce import checkpoint
from transduce.config import ConfigError
from transduce.data.tokenizer import TextTokenizer
from transduce.decode.inputs import checked_texts
from transduce.decode.options import DecodeDtype, decoding_dtype
from transduce.decode.translate import length_sorted_batches
from transduce.errors import LineTruncated
from transduce.model import EncoderOnly, load_model
from transduce.model.packed import decoding_copy


@dataclass
class Prediction:
    label: str
    probability: float
    probabilities: dict[str, float]     # every class, in the classifier's order


class SentenceEncoder:
    """An encoder-only model with its tokenizer, ready to classify or embed lines."""

    def __init__(self, model: EncoderOnly, tokenizer: TextTokenizer,
                 device: torch.device | str = "cpu", dtype: DecodeDtype = "float32"):
        """The model is run by a copy in `dtype` whose Linear weights are packed for
        oneDNN (model/packed.py); the model passed in is left as it is."""
        if not isinstance(model, EncoderOnly):
            raise ConfigError(f"classify and embed need an encoder-only model (arch "
                              f"'encoder'); this one is arch={model.config.arch!r}")
        dtype = decoding_dtype(dtype, device)
        self.labels = model.labels
        self.model = decoding_copy(model, getattr(torch, dtype), device)
        self.tokenizer, self.device = tokenizer, torch.device(device)

    @classmethod
    def load(cls, path: Path | str, device: torch.device | str = "cpu",
             dtype: DecodeDtype = "float32") -> "SentenceEncoder":
        """A checkpoint directory, or a run directory (its latest checkpoint)."""
        directory = checkpoint.resolve(Path(path))
        return cls(load_model(directory, device), checkpoint.load_tokenizer(directory), device,
                   dtype)

    def classify(self, lines: Sequence[str], *, batch_tokens: int = 4096,
                 first_line_number: int = 1) -> list[Prediction]:
        """The most probable class of each line, with every class's probability."""
        if self.model.classifier is None:
            raise ConfigError("this model has no classification head: fine-tune it with "
                              "`transduce train --task classify --init MODEL`")
        names = self.labels or [str(i) for i in range(self.model.config.num_labels)]
        probabilities = np.zeros((len(lines), len(names)), dtype=np.float32)
        for indices, ids in self._batches(lines, batch_tokens, first_line_number):
            with torch.inference_mode():
                pooled = self.model.pool(self.model(ids))
                logits = self.model.classify_logits(pooled).float()          # (B, K)
            probabilities[indices] = logits.softmax(dim=-1).cpu().numpy()
        return [Prediction(names[int(row.argmax())], float(row.max()),
                           dict(zip(names, map(float, row)))) for row in probabilities]

    def embed(self, lines: Sequence[str], *, normalize: bool = False, batch_tokens: int = 4096,
              first_line_number: int = 1) -> np.ndarray:
        """Each line's mean last hidden state over its tokens ([CLS] and [SEP] included,
        padding not), L2-normalised if asked -> (N, C) float32."""
        vectors = np.zeros((len(lines), self.model.config.d_model), dtype=np.float32)
        for indices, ids in self._batches(lines, batch_tokens, first_line_number):
            with torch.inference_mode():
                pooled = self.model.sentence_embeddings(ids, normalize=normalize).float()
            vectors[indices] = pooled.cpu().numpy()
        return vectors

    def _batches(self, lines: Sequence[str], batch_tokens: int, first_line_number: int):
        """(indices of the lines, their ids (B, T) right-padded) by length."""
        if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
            raise ConfigError(f"batch_tokens={batch_tokens!r}: must be a positive integer "
                              f"(tokens per batch, padding counted)")
        t = self.tokenizer
        limit = self.model.config.max_positions - 2                        # [CLS], [SEP]
        lines = checked_texts(lines, "line", first_line_number)
        encoded = t.encode([line.strip() for line in lines])
        for offset, ids in enumerate(encoded):
            if len(ids) > limit:
                warnings.warn(f"line {first_line_number + offset}: {len(ids)} tokens, truncated "
                              f"to the model's limit of {limit}", LineTruncated, stacklevel=4)
                encoded[offset] = ids[:limit]
        rows = [[t.bos_id, *ids, t.eos_id] for ids in encoded]
        for indices in length_sorted_batches(rows, batch_tokens):
            width = max(len(rows[i]) for i in indices)
            batch = torch.full((len(indices), width), self.model.config.pad_id, dtype=torch.long)
            for row, index in enumerate(indices):
                batch[row, :len(rows[index])] = torch.tensor(rows[index])
            yield np.asarray(indices), batch.to(self.device)
