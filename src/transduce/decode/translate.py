"""Text in, text out: tokenise, batch by length, search, detokenise, restore the order.

    model = transduce.load("runs/small/average")
    model.translate(["En el principio crió Dios los cielos y la tierra."])  # -> [str]
    model.translate_nbest(lines, nbest=3, beam=4)      # -> [[Translation(text, score)]]
    nllb.translate(lines, source_lang="eng_Latn", target_lang="fra_Latn")   # multilingual
    transduce.load("exported/onnx")     # an ONNX export, run by ONNX Runtime (same searches)

N lines in give N lines out in the same order; an empty line gives an empty line.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import torch

from transduce import checkpoint
from transduce.config import ConfigError, choices
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, check_vocabularies
from transduce.decode import continuous
from transduce.decode.greedy import greedy_hypotheses
from transduce.decode.inputs import checked_texts
from transduce.decode.languages import Direction, direction
from transduce.decode.onnx_engine import OnnxEngine, check_onnx_settings, runs_on_onnxruntime
from transduce.decode.options import (KEY_VALUE_CACHES, DecodeDtype, Engine, KvDtype,
                                      SearchOptions, decoding_dtype, use_instead)
from transduce.decode.parallel import auto_workers, map_batches
from transduce.decode.search import Hypothesis, beam_search
from transduce.errors import InputTooLong, LineTruncated
from transduce.model import Seq2SeqModel, load_model
from transduce.model.packed import decoding_copy

Progress = Callable[[int], None]


@dataclass
class Translation:
    text: str
    score: float


# What the models that translate nothing are for, by arch.


class Translator:
    """A trained model with its tokenizer, ready to translate."""

    def __init__(self, model: Seq2SeqModel | OnnxEngine, tokenizer: Tokenizer,
                 device: torch.device | str = "cpu", dtype: DecodeDtype = "float32",
                 kv_dtype: KvDtype | None = None, workers: int | Literal["auto"] = 1, *,
                 in_place: bool = False):
        """model: a PyTorch model, or an OnnxEngine (an ONNX export run by ONNX Runtime).
        A PyTorch model is decoded by a copy in `dtype` whose Linear weights are packed
        for oneDNN (model/packed.py); "bfloat16" runs on the AMX / AVX512-BF16 units of
        recent CPUs, "int8" multiplies the widest products in int8 (model/int8.py),
        "auto" (the CLI's default) picks by the CPU (decoding_dtype). Search scores stay
        float32.
        kv_dtype: the self-attention cache's type (default: the model's); attention runs
        in that type, and "int8" quantizes it per token and head, "int4" per group of 32.
        workers: batches decoded side by side on the CPU, each on its share of PyTorch's
        threads (decode/parallel.py); the translations are the same. "auto" (the CLI's
        default): two on a CPU with two threads or more, else one.
        in_place: decode with `model` itself, converted (load() does: the model it read
        is its own, and one as large as half the memory would not fit twice)."""
        if workers == "auto":
            workers = auto_workers(not isinstance(model, OnnxEngine)
                                   and torch.device(device).type == "cpu")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers={workers!r}: must be an integer >= 1 or 'auto'")
        if workers > 1 and (isinstance(model, OnnxEngine) or torch.device(device).type != "cpu"):
            raise ConfigError(f"workers={workers}: parallel workers decode PyTorch models on "
                              f"the CPU (a GPU, or ONNX Runtime, has threads of its own)")
        self.workers = workers
        self._warmed = False      # a first batch decoded: lazily built state exists
        c = model.config
        if c.arch in ("decoder", "encoder"):
            raise ConfigError(f"translation needs an encoder-decoder; this model is arch="
                              f"{c.arch!r}: {use_instead(c.arch)}")
        check_vocabularies(tokenizer, c.src_vocab_size, c.tgt_vocab_size,
                           c.shares_embeddings)
        if isinstance(model, OnnxEngine):
            check_onnx_settings(dtype, kv_dtype, device)
            self.model, self.tokenizer, self.device = model, tokenizer, torch.device("cpu")
            self.dtype, self.kv_dtype = "float32", None
            return
        if kv_dtype is not None and kv_dtype not in choices(KvDtype):
            raise ConfigError(f"kv_dtype={kv_dtype!r}: choose None or one of "
                              f"{', '.join(choices(KvDtype))}")
        if kv_dtype in ("int8", "int4") and (
                model.config.arch != "transformer"
                or model.config.attention_type not in KEY_VALUE_CACHES):
            raise ConfigError(f"kv_dtype={kv_dtype!r} quantizes the keys and values of softmax "
                              f"or sliding-window attention; this model (arch="
                              f"{model.config.arch!r}, attention_type="
                              f"{model.config.attention_type!r}) has none")
        dtype = decoding_dtype(dtype, device)
        self.kv_dtype = kv_dtype
        # A copy for decoding, its Linear weights packed for oneDNN (model/packed.py):
        # the model passed in is left as it is, in its mode and dtype (unless in_place).
        self.model = decoding_copy(model, getattr(torch, dtype), device, in_place=in_place)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = dtype

    @classmethod
    def load(cls, path: Path | str, device: torch.device | str = "cpu",
             dtype: DecodeDtype = "float32", kv_dtype: KvDtype | None = None,
             engine: Engine = "auto",
             workers: int | Literal["auto"] = 1) -> "Translator":
        """A checkpoint directory, a run directory (its latest checkpoint), or an ONNX
        export. engine "auto" runs an ONNX export with ONNX Runtime and a checkpoint
        with PyTorch; naming one refuses the other kind of directory."""
        if runs_on_onnxruntime(path, engine):
            return cls(OnnxEngine(path), Tokenizer(Path(path) / checkpoint.TOKENIZER), device,
                       dtype, kv_dtype, workers)
        directory = checkpoint.resolve(Path(path))
        model = load_model(directory, device)
        return cls(model, Tokenizer(directory / checkpoint.TOKENIZER), device, dtype, kv_dtype,
                   workers, in_place=True)

    @property
    def cache_dtype(self) -> torch.dtype | None:
        """The self-attention caches' type (None: the model's)."""
        return getattr(torch, self.kv_dtype) if self.kv_dtype else None

    @functools.cached_property
    def decodes_continuously(self) -> bool:
        """Whether sentences can join and leave a running search (decode/continuous.py):
        a PyTorch Transformer with softmax attention's KV caches, quantized or not."""
        return continuous.supports(self.model, self.cache_dtype)

    @property
    def language_codes(self) -> dict[str, int] | None:
        """A multilingual model's language codes -> ids (decode/languages.py)."""
        return getattr(self.model, "language_codes", None)

    def direction(self, source_lang: str | None, target_lang: str | None) -> Direction:
        """The tokens a translation from source_lang into target_lang is given (None: the
        model's own pair); a language the model does not have is a ConfigError."""
        return direction(self.language_codes, getattr(self.model, "languages", None),
                         source_lang, target_lang)

    @property
    def max_source_tokens(self) -> int:
        """Source tokens the model can read, eos included."""
        return self.model.config.max_positions

    def translate(self, lines: Sequence[str], *, beam: int = 4, alpha: float = 0.6,
                  batch_tokens: int = 4096, batch_sentences: int = 0, strict: bool = False,
                  first_line_number: int = 1, progress: Progress | None = None,
                  max_length: int | None = None, source_lang: str | None = None,
                  target_lang: str | None = None, no_doubles: bool = False) -> list[str]:
        """Translate lines -> the best translation of each line.

        Batches hold about batch_tokens source tokens counting padding, and at most
        batch_sentences lines when it is not 0. A line over the model's length limit is
        truncated with a warning naming it, or refused with strict=True. progress(n) is
        called as each batch of n lines ends. max_length caps each output's tokens (None:
        the source's length + 50). source_lang, target_lang: a multilingual model's
        languages (its codes, such as eng_Latn; None: the pair it records). no_doubles:
        a token never directly follows itself (search.forbid_doubles).
        """
        options = SearchOptions(beam=beam, alpha=alpha, batch_tokens=batch_tokens,
                                batch_sentences=batch_sentences, max_length=max_length,
                                no_doubles=no_doubles)
        found = self._search(lines, options, strict, first_line_number, progress,
                             self.direction(source_lang, target_lang))
        return [hypotheses[0].text for hypotheses in found]

    def translate_nbest(self, lines: Sequence[str], nbest: int, *, beam: int = 4,
                        alpha: float = 0.6, batch_tokens: int = 4096, batch_sentences: int = 0,
                        strict: bool = False, first_line_number: int = 1,
                        progress: Progress | None = None, max_length: int | None = None,
                        source_lang: str | None = None, target_lang: str | None = None,
                        no_doubles: bool = False) -> list[list[Translation]]:
        """Translate lines -> the nbest (<= beam) best translations of each line with their
        scores, best first. Options as in translate()."""
        options = SearchOptions(beam=beam, alpha=alpha, nbest=nbest, batch_tokens=batch_tokens,
                                batch_sentences=batch_sentences, max_length=max_length,
                                no_doubles=no_doubles)
        return self._search(lines, options, strict, first_line_number, progress,
                            self.direction(source_lang, target_lang))

    def _search(self, lines: Sequence[str], options: SearchOptions, strict: bool,
                first_line_number: int, progress: Progress | None,
                way: Direction) -> list[list[Translation]]:
        ids = self.encode(lines, strict, first_line_number, way.source_prefix)
        empty = [Translation("", 0.0)] * options.nbest
        results: list[list[Translation]] = [empty for _ in lines]
        cache_dtype = self.cache_dtype

        def search(indices: list[int]) -> list[list[Hypothesis]]:   # on a worker
            src = pad_sources([ids[i] for i in indices], self.device)
            forced = torch.tensor([way.forced] * len(indices), device=self.device) \
                if way.forced else None                                    # (B, F)
            with torch.inference_mode():
                if options.beam == 1:     # the same answer in fewer operations
                    return greedy_hypotheses(self.model, src, bos_id=BOS_ID, eos_id=EOS_ID,
                                             alpha=options.alpha, max_len=options.max_length,
                                             cache_dtype=cache_dtype, forced=forced,
                                             no_doubles=options.no_doubles)
                return beam_search(self.model, src, bos_id=BOS_ID, eos_id=EOS_ID,
                                   beam=options.beam, alpha=options.alpha, nbest=options.nbest,
                                   max_len=options.max_length, cache_dtype=cache_dtype,
                                   forced=forced, no_doubles=options.no_doubles)

        batches = length_sorted_batches(ids, options.batch_tokens, options.batch_sentences)
        for indices, found in map_batches(search, batches, self.workers,
                                          first_alone=not self._warmed):
            self._warmed = True
            decode = self.tokenizer.target_tokenizer.decode
            for index, hypotheses in zip(indices, found):
                results[index] = [Translation(decode(h.tokens), h.score) for h in hypotheses]
            if progress is not None:
                progress(len(indices))
        return results

    def encode(self, lines: Sequence[str], strict: bool = False, first_line_number: int = 1,
               prefix: Sequence[int] = ()) -> list[list[int]]:
        """Source token ids per line, stripped, after `prefix` (a multilingual model's
        source language), within the model's limit (a longer line is truncated with a
        warning naming it, or refused with strict=True); an empty line gives no ids (and
        is not searched)."""
        limit = self.max_source_tokens - 1 - len(prefix)  # room for eos and the prefix
        lines = checked_texts(lines, "line", first_line_number)
        encoded = self.tokenizer.encode([line.strip() for line in lines])
        for offset, ids in enumerate(encoded):
            if len(ids) > limit:
                where = f"line {first_line_number + offset}"
                if strict:
                    raise InputTooLong(f"{where}: {len(ids)} tokens, more than the model's "
                                       f"limit of {limit}")
                warnings.warn(f"{where}: {len(ids)} tokens, truncated to the model's limit of "
                              f"{limit}", LineTruncated, stacklevel=4)
                encoded[offset] = ids[:limit]
        return [list(prefix) + ids if ids else ids for ids in encoded] if prefix else encoded


def length_sorted_batches(ids: Sequence[Sequence[int]], batch_tokens: int,
                          batch_sentences: int = 0) -> list[list[int]]:
    """Indices of the non-empty lines sorted by length, cut into batches of about
    batch_tokens source tokens counting padding (a long line alone rather than never), and
    at most batch_sentences lines when that is not 0."""
    order = sorted((i for i, x in enumerate(ids) if len(x)), key=lambda i: len(ids[i]))
    batches, current = [], []
    for index in order:
        full = batch_sentences and len(current) >= batch_sentences
        if current and (full or (len(current) + 1) * (len(ids[index]) + 1) > batch_tokens):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def pad_sources(rows: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Token id lists -> (B, S): each row + eos, right-padded with pad."""
    width = max(len(r) for r in rows) + 1
    src = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        src[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        src[i, len(row)] = EOS_ID
    return src.to(device)


def load(path: Path | str, device: torch.device | str = "cpu", dtype: DecodeDtype = "float32",
         kv_dtype: KvDtype | None = None, engine: Engine = "auto") -> Translator:
    """transduce.load(RUN): a Translator for a checkpoint, a run directory or an ONNX
    export."""
    return Translator.load(path, device, dtype, kv_dtype, engine)
