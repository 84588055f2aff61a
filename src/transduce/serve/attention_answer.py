"""How /v1/attention answers, whatever the model's shape: the maps computed on the
decoding worker and kept in a small cache bounded in bytes (the page asks for one layer
at a time), the layers a request selects, and the JSON written in pieces of a few
thousand numbers, giving the event loop back between pieces. A whole model's maps of a
1,000-token sentence are a few hundred MB of JSON, which built in one piece blocked
every other request (/health included) for seconds and held the text in memory twice.
A request for more numbers than the server's max_attention_values is refused before
any is written.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import AsyncIterator, Callable, Hashable, Sequence

import torch
from fastapi.responses import StreamingResponse

from transduce.attention_maps import AttentionMaps
from transduce.serve.limits import ApiError
from transduce.serve.service import Service, timed

CACHE_BYTES = 256 * 2**20      # the newest maps are kept even when larger
PIECE_VALUES = 16384           # numbers per piece written between returns to the loop
KINDS = ("encoder", "decoder", "cross")


class MapsAnswers:
    """The maps of one model's requests: computed once per key on the decoding worker,
    selected by kind and layer, sent as streamed JSON."""

    def __init__(self, service: Service, kinds: Sequence[str]):
        modules = service.model.model.attention_modules()
        self.service = service
        self.layers = {kind: len(modules.get(kind, [])) for kind in kinds}   # per kind
        self.cache = MapsCache(CACHE_BYTES)

    def selected(self, kinds: Sequence[str], layers: list[int] | None) -> dict[str, list[int]]:
        """Kind -> the 1-based layers of it to send (those asked for, default all, that
        the kind has); a layer beyond every kind's is refused (422)."""
        deepest = max(self.layers.values())
        wanted = layers or list(range(1, deepest + 1))
        for index, layer in enumerate(wanted):
            if layer > deepest:
                raise ApiError(422, f"layers[{index}]: {layer} is more than the model's "
                                    f"{deepest} layers", f"layers[{index}]")
        return {kind: [layer for layer in dict.fromkeys(wanted) if layer <= self.layers[kind]]
                for kind in dict.fromkeys(kinds)}

    def kinds(self, asked: list[str], given: bool, rollout: bool) -> list[str]:
        """The kinds a request is answered (asked: its kinds, given: whether it named
        them); a rollout's are the self-attention kinds the model has (422 where it
        names cross-attention, or the model has none)."""
        if not rollout:
            return asked
        if given and "cross" in asked:
            raise ApiError(422, "kinds: a rollout runs through a stack's self-attention "
                                "layers; cross-attention has no stack of its own: ask for "
                                "\"encoder\" or \"decoder\"", "kinds")
        kinds = [kind for kind in asked if kind != "cross" and self.layers[kind]]
        if not kinds:
            raise ApiError(422, "rollout: this model has no self-attention layers to roll "
                                "out through (an RNN's attention is cross-attention alone)",
                           "rollout")
        return kinds

    async def maps(self, key: Hashable, compute: Callable[[Hashable], AttentionMaps],
                   tokens: int, rollout: bool = False) -> AttentionMaps:
        """The maps of `key` (a request's settings): the cache's, else compute(key) run
        alone on the decoding worker, counted as `tokens`; rollout: their rollout
        (AttentionMaps.rollout, off the event loop), cached too."""
        found = self.cache.get(key)
        if found is None:
            run = timed(lambda jobs: [compute(job.payload) for job in jobs])
            found, _ = await self.service.submit(("attention", object()), run, key, tokens, 1)
            self.cache.put(key, found)
        if not rollout:
            return found
        rolled = self.cache.get((key, "rollout"))
        if rolled is None:
            rolled = await asyncio.to_thread(found.rollout)
            self.cache.put((key, "rollout"), rolled)
        return rolled

    def response(self, head: dict, maps: AttentionMaps, selected: dict[str, list[int]],
                 decimals: int) -> StreamingResponse:
        """The answer: `head`'s fields, then "layers", "heads" and the selected "maps";
        refused (413) when over max_attention_values."""
        _check_size(maps, selected, self.service.limits.max_attention_values)
        heads = next(int(_of(maps, kind)[0].shape[0]) for kind in KINDS if _of(maps, kind))
        head = {**head, "layers": self.layers, "heads": heads}
        return StreamingResponse(_answer(head, maps, selected, decimals),
                                 media_type="application/json")


def _check_size(maps: AttentionMaps, selected: dict[str, list[int]], limit: int) -> None:
    """Refuse (413) an answer of more than `limit` numbers, saying how to ask for less."""
    count = sum(_of(maps, kind)[layer - 1].numel()
                for kind, numbers in selected.items() for layer in numbers)
    if count > limit:
        raise ApiError(413, f"the maps asked for are {count} numbers, more than the limit of "
                            f"{limit} (max_attention_values); ask for fewer \"layers\" or "
                            f"\"kinds\", or a shorter text", "layers")


async def _answer(head: dict, maps: AttentionMaps, selected: dict[str, list[int]],
                  decimals: int) -> AsyncIterator[str]:
    """The JSON of the head's fields and "maps", piece by piece: kind -> layer ->
    (H, T, S)."""
    yield _dumps(head)[:-1] + ',"maps":{'
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
    """The most recently used maps by a request's settings (text, search, languages...),
    within a budget of bytes; the newest entry stays even when it alone is over the
    budget."""

    def __init__(self, budget: int):
        self.budget, self.entries, self.bytes = budget, OrderedDict(), 0

    def get(self, key: Hashable) -> AttentionMaps | None:
        maps = self.entries.get(key)
        if maps is not None:
            self.entries.move_to_end(key)
        return maps

    def put(self, key: Hashable, maps: AttentionMaps) -> None:
        if key in self.entries:
            self.bytes -= _bytes(self.entries.pop(key))
        self.entries[key] = maps
        self.bytes += _bytes(maps)
        while len(self.entries) > 1 and self.bytes > self.budget:
            self.bytes -= _bytes(self.entries.popitem(last=False)[1])


def _bytes(maps: AttentionMaps) -> int:
    return sum(weights.nbytes for kind in KINDS for weights in _of(maps, kind))
