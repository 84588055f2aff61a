"""POST /v1/attention: a translation with its attention maps, streamed.

The maps are computed on the decoding worker, one sentence at a time (attention_maps:
the maps of the printed translation), and kept in a small cache bounded in bytes, since
the page asks for one layer at a time. The answer is written as JSON in pieces of a few
thousand numbers, giving the event loop back between pieces: a whole model's maps of a
1,000-token sentence are a few hundred MB of JSON, which built in one piece blocked
every other request (/health included) for seconds and held the text in memory twice.
A request for more numbers than the server's max_attention_values is refused before
any is written.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import AsyncIterator, Sequence

import torch
from fastapi.responses import StreamingResponse

from transduce.attention_maps import AttentionMaps, attention_maps
from transduce.decode.translate import Translator
from transduce.serve.batcher import Job
from transduce.serve.limits import ApiError, check_texts, check_tokens
from transduce.serve.schemas import AttentionRequest
from transduce.serve.service import Service, timed
from transduce.serve.validation import checked_direction

CACHE_BYTES = 256 * 2**20      # the newest maps are kept even when larger
PIECE_VALUES = 16384           # numbers per piece written between returns to the loop
KINDS = ("encoder", "decoder", "cross")


def attention_route(service: Service):
    """The handler of POST /v1/attention for the service's Translator."""
    translator: Translator = service.model
    modules = translator.model.attention_modules()
    layers = {kind: len(modules.get(kind, [])) for kind in KINDS}
    cache = MapsCache(CACHE_BYTES)

    def run(jobs: Sequence[Job]) -> list[AttentionMaps]:
        return [attention_maps(translator, text, beam=beam, alpha=alpha, source_lang=source,
                               target_lang=target, no_doubles=no_doubles)
                for text, beam, alpha, (source, target), no_doubles
                in (job.payload for job in jobs)]

    async def attention(body: AttentionRequest) -> StreamingResponse:
        selected = _selected(body, layers)
        check_texts([body.text], service.limits, "text", indexed=False)
        if not body.text.strip():
            raise ApiError(422, "text: only white space; give a sentence to translate", "text")
        way = checked_direction(translator, body, service.languages)
        limit = translator.max_source_tokens - 1 - len(way.source_prefix)
        length = len(translator.tokenizer.encode([body.text.strip()])[0])
        check_tokens([length], limit, "text", body.truncate, indexed=False)
        no_doubles = service.limits.no_doubles if body.no_doubles is None else body.no_doubles
        key = (body.text, body.beam, float(body.alpha), way.languages or (None, None),
               no_doubles)
        maps = cache.get(key)
        if maps is None:
            maps, _ = await service.submit(("attention", object()), timed(run), key,
                                           min(length, limit) + 1, 1)
            cache.put(key, maps)
        _check_size(maps, selected, service.limits.max_attention_values)
        return StreamingResponse(_answer(maps, layers, selected, body.decimals),
                                 media_type="application/json")

    return attention


def _selected(body: AttentionRequest, layers: dict[str, int]) -> dict[str, list[int]]:
    """Kind -> the 1-based layers of it to send (those asked for, default all, that the
    kind has); a layer beyond every kind's is refused (422)."""
    deepest = max(layers.values())
    wanted = body.layers or list(range(1, deepest + 1))
    for index, layer in enumerate(wanted):
        if layer > deepest:
            raise ApiError(422, f"layers[{index}]: {layer} is more than the model's "
                                f"{deepest} layers", f"layers[{index}]")
    return {kind: [layer for layer in dict.fromkeys(wanted) if layer <= layers[kind]]
            for kind in dict.fromkeys(body.kinds)}


def _check_size(maps: AttentionMaps, selected: dict[str, list[int]], limit: int) -> None:
    """Refuse (413) an answer of more than `limit` numbers, saying how to ask for less."""
    count = sum(_of(maps, kind)[layer - 1].numel()
                for kind, numbers in selected.items() for layer in numbers)
    if count > limit:
        raise ApiError(413, f"the maps asked for are {count} numbers, more than the limit of "
                            f"{limit} (max_attention_values); ask for fewer \"layers\" or "
                            f"\"kinds\", or a shorter text", "layers")


async def _answer(maps: AttentionMaps, layers: dict[str, int], selected: dict[str, list[int]],
                  decimals: int) -> AsyncIterator[str]:
    """The JSON of AttentionResponse, piece by piece: kind -> layer -> (H, T, S)."""
    head = _dumps({"translation": maps.translation, "log_prob": maps.log_prob,
                   "source_tokens": maps.source_tokens, "target_inputs": maps.target_inputs,
                   "target_outputs": maps.target_outputs, "layers": layers,
                   "heads": int(maps.cross[0].shape[0])})
    yield head[:-1] + ',"maps":{'
    for k, (kind, numbers) in enumerate(selected.items()):
        yield ("," if k else "") + _dumps(kind) + ":{"
        for n, layer in enumerate(numbers):
            yield ("," if n else "") + f'"{layer}":['
            for h, weights in enumerate(_of(maps, kind)[layer - 1]):         # (T, S)
                yield "," if h else ""
                async for piece in _rows(weights, decimals):
                    yield piece
            yield "]"
        yield "}"
    yield "}}"


async def _rows(weights: torch.Tensor, decimals: int) -> AsyncIterator[str]:
    """One head's (T, S) weights as a JSON array of rows rounded to `decimals`, in
    pieces of about PIECE_VALUES numbers, returning to the event loop after each."""
    rows_per_piece = max(1, PIECE_VALUES // weights.shape[1])
    for start in range(0, weights.shape[0], rows_per_piece):
        block = weights[start:start + rows_per_piece]
        rounded = torch.round(block.double(), decimals=decimals).tolist()   # 0.998, not 0.99800002
        text = _dumps(rounded)[1:-1]
        yield ("[" if start == 0 else ",") + text
        await asyncio.sleep(0)
    yield "]"


def _of(maps: AttentionMaps, kind: str) -> list[torch.Tensor]:
    return {"encoder": maps.encoder, "decoder": maps.decoder, "cross": maps.cross}[kind]


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class MapsCache:
    """The most recently used maps by (text, beam, alpha, languages, no_doubles), within a
    budget of bytes; the newest entry stays even when it alone is over the budget."""

    def __init__(self, budget: int):
        self.budget, self.entries, self.bytes = budget, OrderedDict(), 0

    def get(self, key: tuple) -> AttentionMaps | None:
        maps = self.entries.get(key)
        if maps is not None:
            self.entries.move_to_end(key)
        return maps

    def put(self, key: tuple, maps: AttentionMaps) -> None:
        if key in self.entries:
            self.bytes -= _bytes(self.entries.pop(key))
        self.entries[key] = maps
        self.bytes += _bytes(maps)
        while len(self.entries) > 1 and self.bytes > self.budget:
            self.bytes -= _bytes(self.entries.popitem(last=False)[1])


def _bytes(maps: AttentionMaps) -> int:
    return sum(weights.nbytes for kind in KINDS for weights in _of(maps, kind))
