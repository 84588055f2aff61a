"""Attention maps: what each layer and head attends to while a model reads a text, in
each of the three shapes: an encoder-decoder translating a sentence, an encoder-only
model reading a text (or a pair), a language model continuing a prompt.

The sentence is translated (beam search); then one teacher-forced forward pass over the
chosen translation runs with every attention module recording its weights
(attention/recorder.py: forward hooks, the naive kernel). That pass computes the
log-probabilities the search used, which `attention_maps` checks, so the maps are those
of the translation shown: in float32 to rounding, in bfloat16 or int8 to the rounding
of activations, which the pass over one row rounds otherwise than the search over its
beams (up to 1.5% of the score over 150 test verses in bfloat16, 0.8% in int8). An
encoder-only model's maps are those of its one pass over the text; a language model's,
those of one pass over the prompt and its greedy continuation. Any model that exposes
`attention_modules()` can be drawn.

Their rollout (Abnar & Zuidema 2020, `AttentionMaps.rollout`) follows attention
through a stack's self-attention layers: each layer's weights averaged over its heads,
mixed half and half with the identity of the residual connection, and multiplied from
the first layer up, so that layer l's map says how much each position there draws on
each input position.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from transduce import atomic
from transduce.attention.recorder import Recorded, record_attention
from transduce.config import ConfigError
from transduce.data.tokenizer import BOS_ID, EOS_ID
from transduce.decode.encode import SentenceEncoder
from transduce.decode.generate import Generator
from transduce.decode.search import beam_search, forbid_doubles, max_lengths
from transduce.decode.translate import Translator, pad_sources
from transduce.model.decoder_only import DecoderOnly
from transduce.model.encoder_only import EncoderOnly

# How far the recorded pass's score may be from the search's when the model decodes in
# bfloat16 or int8 (relative, and in nats near 0): three times the most seen.
ROUNDED_TOLERANCE = 0.05


@dataclass
class AttentionMaps:
    """Weights per layer, each (heads, queries, keys); the RNNs have cross-attention only,
    an encoder-only model encoder self-attention only, a language model decoder
    self-attention only."""

    source_tokens: list[str]      # the encoder's input pieces, eos included
    target_inputs: list[str]      # the decoder's input pieces: bos, then the output
    target_outputs: list[str]     # what each decoder position predicts: the output, eos
    #                               (a multilingual model's: given its target code first)
    translation: str              # (an encoder-only model's: its text; a language
    #                               model's: the prompt and its continuation)
    log_prob: float | None        # of the translation (continuation), recomputed by the
    #                               recorded pass; None for an encoder-only model
    encoder: list[Tensor]         # (H, S, S) per layer
    decoder: list[Tensor]         # (H, T, T) per layer
    cross: list[Tensor]           # (H, T, S) per layer

    def rollout(self) -> AttentionMaps:
        """The maps of each stack's self-attention rolled out (attention_rollout), one
        map per layer (1, T, T) in place of its heads; cross-attention has no stack of
        its own to roll out through and is left out."""
        return dataclasses.replace(self, encoder=attention_rollout(self.encoder),
                                   decoder=attention_rollout(self.decoder), cross=[])


def attention_rollout(layers: list[Tensor], residual: float = 0.5) -> list[Tensor]:
    """Abnar & Zuidema (2020)'s attention rollout of one stack's self-attention, (H, T,
    T) per layer -> (1, T, T) per layer: R_l = B_l ... B_1 with B = (1 - residual) *
    mean over heads + residual * I. Every row of R sums to 1 as the weights' rows do,
    and a causal stack's rollout stays causal. Computed in float64."""
    rolled, product = [], None
    for weights in layers:
        tokens = weights.shape[-1]
        mixed = (1 - residual) * weights.double().mean(0) + \
            residual * torch.eye(tokens, dtype=torch.float64, device=weights.device)
        product = mixed if product is None else mixed @ product
        rolled.append(product.float()[None])
    return rolled


@torch.no_grad()
def attention_maps(translator: Translator, sentence: str, *, beam: int = 4,
                   alpha: float = 0.6, source_lang: str | None = None,
                   target_lang: str | None = None, no_doubles: bool = False) -> AttentionMaps:
    """Translate one sentence (a multilingual model's between source_lang and
    target_lang; no_doubles: no token directly after itself, as translate's) and record
    the attention weights of that translation."""
    model, tokenizer = translator.model.eval(), translator.tokenizer
    way = translator.direction(source_lang, target_lang)
    limit = translator.max_source_tokens - 1 - len(way.source_prefix)
    source_ids = tokenizer.encode([sentence.strip()])[0][:limit]
    if not source_ids:
        raise ConfigError("attention maps need a non-empty sentence")
    src = pad_sources([list(way.source_prefix) + source_ids], translator.device)   # (1, S)
    given = list(way.forced)
    forced = torch.tensor([given], device=src.device) if given else None
    best = beam_search(model, src, bos_id=BOS_ID, eos_id=EOS_ID, beam=beam, alpha=alpha,
                       forced=forced, no_doubles=no_doubles)[0][0]
    cut = len(best.tokens) >= int(max_lengths(model, src, None, len(given))[0])   # no eos
    outputs = best.tokens if cut else best.tokens + [EOS_ID]
    inputs = [BOS_ID] + given + outputs[:-1]
    with record_attention(model.attention_modules()) as recorded:
        logits = model(src, torch.tensor([inputs], device=src.device))   # (1, T, V)
    encoder, decoder, cross = (_first_sentence(recorded, role)
                               for role in ("encoder", "decoder", "cross"))
    searched = torch.arange(len(given), len(inputs))                 # the given are not scored
    scores = logits[0, searched].float()                              # (T', V)
    if no_doubles:               # as the search scored them: each input's token refused
        forbid_doubles(scores, torch.tensor(inputs, device=scores.device)[searched])
    log_prob = float(scores.log_softmax(-1)[torch.arange(len(searched)),
                                            torch.tensor(outputs)].sum())
    tolerance = 1e-3 if translator.dtype == "float32" else ROUNDED_TOLERANCE
    if not math.isclose(log_prob, best.log_prob, rel_tol=tolerance, abs_tol=tolerance):
        raise RuntimeError(f"the recorded pass scores the translation {log_prob:.4f}, the "
                           f"search {best.log_prob:.4f}: the maps would not be its own")
    source, target = tokenizer.piece, tokenizer.target_tokenizer.piece   # separate vocabularies
    return AttentionMaps([source(i) for i in src[0].tolist()], [target(i) for i in inputs],
                         [target(i) for i in given + outputs],
                         tokenizer.target_tokenizer.decode(best.tokens), log_prob, encoder,
                         decoder, cross)


@torch.no_grad()
def encoder_attention_maps(encoder: SentenceEncoder, text: str,
                           pair: str | None = None) -> AttentionMaps:
    """An encoder-only model's pass over a text ([CLS] text [SEP]; with a pair, [CLS]
    text [SEP] pair [SEP], cut to fit as classify cuts it), every layer's self-attention
    recorded."""
    model = _torch_model(encoder, EncoderOnly)
    ids, segments = encoder.item(text, pair)                              # (1, T) each
    with record_attention(model.attention_modules()) as recorded:
        model(ids, segments)
    pieces = [encoder.tokenizer.piece(i) for i in ids[0].tolist()]
    shown = text if pair is None else f"{text} | {pair}"
    return AttentionMaps(pieces, [], [], shown, None, _first_sentence(recorded, "encoder"),
                         [], [])


@torch.no_grad()
def generation_attention_maps(generator: Generator, prompt: str, *,
                              max_new_tokens: int = 32) -> AttentionMaps:
    """A language model's greedy continuation of a prompt, and the weights of one pass
    over what the model read (each position's query over the positions up to it): the
    prompt and the continuation, which predicted the next token, or the eos (end token)
    that ended it."""
    model = _torch_model(generator, DecoderOnly)
    prompt_ids = generator.encode([prompt])[0]
    continuation = generator.generate_rows([prompt], max_new_tokens=max_new_tokens)[0]
    ended = [] if continuation.end_token is None else [continuation.end_token]
    tokens = prompt_ids + continuation.tokens + ended
    if len(tokens) < 2:
        raise ConfigError("an empty prompt of a model without bos: no position to draw")
    inputs = torch.tensor([tokens[:-1]], device=generator.device)            # (1, T)
    with record_attention(model.attention_modules()) as recorded:
        logits = model(inputs)                                                # (1, T, V)
    generated = torch.arange(len(prompt_ids) - 1, len(tokens) - 1)
    log_prob = float(logits[0].float().log_softmax(-1)[
        generated, torch.tensor(tokens[len(prompt_ids):], dtype=torch.long)].sum())
    piece = generator.tokenizer.piece
    return AttentionMaps([], [piece(i) for i in tokens[:-1]], [piece(i) for i in tokens[1:]],
                         prompt + continuation.text, log_prob, [],
                         _first_sentence(recorded, "decoder"), [])


def _torch_model(runner: SentenceEncoder | Generator, kind: type) -> torch.nn.Module:
    """The PyTorch model a SentenceEncoder or Generator runs (an ONNX export's records
    nothing), in eval mode."""
    if not isinstance(runner.model, kind):
        raise ConfigError("attention maps are recorded from a PyTorch model, not an ONNX "
                          "export: give the checkpoint it was exported from")
    return runner.model.eval()


def _first_sentence(recorded: Recorded, role: str) -> list[Tensor]:
    """A role's weights per layer, (H, T, S): a module called once per target step (an
    RNN's attention) has its calls joined along the queries; one without heads gets one."""
    layers = []
    for calls in recorded[role]:
        weights = torch.cat(calls, dim=-2)[0]                               # ([H,] T, S)
        layers.append(weights if weights.dim() == 3 else weights.unsqueeze(0))
    return layers


DPI = 110
LABEL_INCHES = 0.16          # per piece's label, at font size 6
TITLE_CHARACTERS = 150      # of the translation, above the maps
MAX_PIXELS = 80_000_000      # of the whole figure: 320 MB as RGBA while drawn


def plot_attention_maps(maps: AttentionMaps, out: Path, *, layer: int | None = None,
                        head: int | None = None, rolled_out: bool = False) -> Path:
    """Heatmaps with the pieces on the axes: one row per (kind, layer), one column per
    head; layer and head (1-based) select one; rolled_out: the maps are a rollout's
    (AttentionMaps.rollout), one per layer, titled so. Returns the PNG's path."""
    from matplotlib.figure import Figure

    kinds = [("encoder self-attention", maps.encoder, maps.source_tokens, maps.source_tokens),
             ("decoder self-attention", maps.decoder, maps.target_inputs, maps.target_outputs),
             ("cross-attention", maps.cross, maps.source_tokens, maps.target_outputs)]
    rows, row_kinds = [], []
    for title, layers, keys, queries in kinds:
        for number, weights in enumerate(layers, start=1):
            if layer is not None and number != layer:
                continue
            heads = range(1, weights.shape[0] + 1) if head is None else [head]
            for h in heads:
                if not 1 <= h <= weights.shape[0]:
                    raise ConfigError(f"--head {h}: the model has {weights.shape[0]} heads")
            rows.append([(f"{title} rolled out through layer {number}" if rolled_out else
                          f"{title}, layer {number}, head {h}", weights[h - 1], keys, queries)
                         for h in heads])
            row_kinds.append(title)
    if not rows:
        raise ConfigError(f"--layer {layer}: the model has {max(len(k[1]) for k in kinds)} layers")
    columns = max(len(row) for row in rows)
    longest = max(len(maps.source_tokens), len(maps.target_inputs))
    size, step = _panel_size(longest, len(rows) * columns)
    figure = Figure(figsize=(size * columns, size * len(rows)))
    axes = figure.subplots(len(rows), columns, squeeze=False)
    for r, row in enumerate(rows):
        for c in range(columns):
            axis = axes[r][c]
            if c >= len(row):
                axis.axis("off")
                continue
            title, weights, keys, queries = row[c]
            axis.imshow(weights.float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0,
                        aspect="auto")
            axis.set_title(title, fontsize=8)
            # A row's heads share its queries, and a kind's rows its keys: each is
            # labelled once, at the left and at the bottom of the kind's block (text
            # is most of the drawing: a whole model's maps took three times as long).
            last_of_kind = r + 1 == len(rows) or row_kinds[r + 1] != row_kinds[r]
            axis.set_xticks(*_ticks(keys, step), rotation=90, fontsize=6)
            axis.set_yticks(*_ticks(queries, step), fontsize=6)
            axis.tick_params(labelbottom=last_of_kind, labelleft=c == 0)
    figure.suptitle(_label(_shortened(maps.translation, TITLE_CHARACTERS)), fontsize=9)
    figure.tight_layout()
    with atomic.atomic_file(out) as temporary:
        figure.savefig(temporary, format="png", dpi=DPI)
    return out


def _panel_size(longest: int, panels: int) -> tuple[float, int]:
    """(inches per side of one heatmap, label every step-th piece) for sentences of up to
    `longest` pieces: room for each piece's label where the figure stays within
    MAX_PIXELS (a whole model's maps of a 1,000-piece sentence would otherwise be a
    canvas of billions of pixels), and then only every step-th piece labelled."""
    wanted = max(3.0, LABEL_INCHES * longest + 1.2)
    size = min(wanted, math.sqrt(MAX_PIXELS / panels) / DPI)
    step = max(1, math.ceil(LABEL_INCHES * longest / max(size - 1.2, LABEL_INCHES)))
    return size, step


def _shortened(text: str, characters: int) -> str:
    """The text, cut at a word to at most `characters` with an ellipsis when longer."""
    if len(text) <= characters:
        return text
    return text[:characters - 1].rsplit(" ", 1)[0] + "…"


def _ticks(pieces: list[str], step: int) -> tuple[range, list[str]]:
    """Tick positions and labels for every step-th piece."""
    positions = range(0, len(pieces), step)
    return positions, [_label(pieces[i]) for i in positions]


def _label(piece: str) -> str:
    """Text for a label or title: control characters (from byte pieces) escaped."""
    return piece if piece.isprintable() else piece.encode("unicode_escape").decode("ascii")
