"""Decoding: search strategies over the Transformer's prefill / decode_step interface."""

from transduce.decode.search import greedy_search

__all__ = ["greedy_search"]
