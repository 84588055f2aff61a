"""Lines in, labels or vectors out: an encoder-only model (BERT) classifying and embedding.

    encoder = SentenceEncoder.load("runs/genre/ema")
    encoder.classify(["And Jesus wept."])      # -> [Prediction("gospels and Acts", 0.93, {...})]
    encoder.embed(lines, normalize=True)      # -> (N, C) float32 numpy array
    encoder.embed(lines, pooling="cls")       # [CLS]'s state (BGE's way) rather than the mean

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
from transduce.checkpoint import POOLINGS
from transduce.config import ConfigError
from transduce.data.tokenizer import TextTokenizer
from transduce.decode.inputs import checked_texts
from transduce.decode.onnx_encoder_engine import OnnxSentenceEncoder
from transduce.decode.onnx_engine import check_onnx_settings, runs_on_onnxruntime
from transduce.decode.options import DecodeDtype, Engine, decoding_dtype
from transduce.decode.translate import length_sorted_batches
from transduce.errors import LineTruncated
from transduce.model import EncoderOnly, load_model
from transduce.model.packed import decoding_copy


def embedding_defaults(recorded: dict | None) -> dict:
    """{"pooling", "normalize"} of embed() when not given: the checkpoint's record, else
    the mean, not normalised."""
    return dict(recorded or {"pooling": "mean", "normalize": False})


@dataclass
class Prediction:
    label: str
    probability: float
    probabilities: dict[str, float]     # every class, in the classifier's order


class SentenceEncoder:
    """An encoder-only model with its tokenizer, ready to classify or embed lines."""

    def __init__(self, model: EncoderOnly | OnnxSentenceEncoder, tokenizer: TextTokenizer,
                 device: torch.device | str = "cpu", dtype: DecodeDtype = "float32", *,
                 in_place: bool = False):
        """A PyTorch model is run by a copy in `dtype` whose Linear weights are packed for
        oneDNN (model/packed.py); the model passed in is left as it is, unless in_place
        (see Translator). An
        OnnxSentenceEncoder (an ONNX export) runs as exported, on the CPU."""
        if isinstance(model, OnnxSentenceEncoder):
            check_onnx_settings(dtype, None, device)
            self.labels, self.model = model.labels, model
            self.embedding_defaults = embedding_defaults(model.sentence_embedding)
            self.tokenizer, self.device = tokenizer, torch.device("cpu")
            return
        if not isinstance(model, EncoderOnly):
            raise ConfigError(f"classify and embed need an encoder-only model (arch "
                              f"'encoder'); this one is arch={model.config.arch!r}")
        dtype = decoding_dtype(dtype, device)
        self.labels = model.labels
        self.embedding_defaults = embedding_defaults(model.sentence_embedding)
        self.model = decoding_copy(model, getattr(torch, dtype), device, in_place=in_place)
        self.tokenizer, self.device = tokenizer, torch.device(device)

    @classmethod
    def load(cls, path: Path | str, device: torch.device | str = "cpu",
             dtype: DecodeDtype = "float32", engine: Engine = "auto") -> "SentenceEncoder":
        """A checkpoint directory, a run directory (its latest checkpoint), or an ONNX
        export (engine "auto" runs it with ONNX Runtime, as Translator.load does)."""
        if runs_on_onnxruntime(path, engine):
            return cls(OnnxSentenceEncoder(path), checkpoint.load_tokenizer(Path(path)), device,
                       dtype)
        directory = checkpoint.resolve(Path(path))
        return cls(load_model(directory, device), checkpoint.load_tokenizer(directory), device,
                   dtype, in_place=True)

    def classify(self, lines: Sequence[str], *, batch_tokens: int = 4096,
                 first_line_number: int = 1) -> list[Prediction]:
        """The most probable class of each line, with every class's probability."""
        if not self.classifies:
            raise ConfigError("this model has no classification head: fine-tune it with "
                              "`transduce train --task classify --init MODEL`")
        names = self.labels or [str(i) for i in range(self.model.config.num_labels)]
        probabilities = np.zeros((len(lines), len(names)), dtype=np.float32)
        for indices, ids in self._batches(lines, batch_tokens, first_line_number):
            logits = self._class_logits(ids).float()                           # (B, K)
            probabilities[indices] = logits.softmax(dim=-1).cpu().numpy()
        return [Prediction(names[int(row.argmax())], float(row.max()),
                           dict(zip(names, map(float, row)))) for row in probabilities]

    def embed(self, lines: Sequence[str], *, normalize: bool | None = None,
              pooling: str | None = None, batch_tokens: int = 4096,
              first_line_number: int = 1) -> np.ndarray:
        """Each line's last hidden states pooled, "mean" over its tokens ([CLS] and [SEP]
        included, padding not) or "cls" ([CLS]'s), L2-normalised if asked -> (N, C)
        float32. None: as the checkpoint records (an imported sentence-transformers
        model's way), else mean and not normalised (embedding_defaults)."""
        pooling = self.embedding_defaults["pooling"] if pooling is None else pooling
        normalize = self.embedding_defaults["normalize"] if normalize is None else normalize
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling={pooling!r}: choose one of {', '.join(POOLINGS)}")
        vectors = np.zeros((len(lines), self.model.config.d_model), dtype=np.float32)
        for indices, ids in self._batches(lines, batch_tokens, first_line_number):
            pooled = self._embeddings(ids, pooling).float()                    # (B, C)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            vectors[indices] = pooled.cpu().numpy()
        return vectors

    @property
    def classifies(self) -> bool:
        """Whether the model has a classification head (classify needs one)."""
        return self.model.config.num_labels > 0

    @torch.inference_mode()
    def _class_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> (B, num_labels), from either engine."""
        if isinstance(self.model, OnnxSentenceEncoder):
            return self.model.class_logits(ids)
        return self.model.classify_logits(self.model.pool(self.model(ids)))

    @torch.inference_mode()
    def _embeddings(self, ids: torch.Tensor, pooling: str) -> torch.Tensor:
        """ids (B, T) -> the pooled hidden states (B, C), from either engine."""
        if isinstance(self.model, OnnxSentenceEncoder):
            return self.model.embeddings(ids, pooling)
        return self.model.sentence_embeddings(ids, pooling=pooling)

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
