"""Decoding: search strategies over the Transformer's prefill / decode_step interface."""

from transduce.decode.search import Hypothesis, beam_search, greedy_search, sample

__all__ = ["Hypothesis", "beam_search", "greedy_search", "sample"]
