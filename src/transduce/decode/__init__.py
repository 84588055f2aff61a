"""Decoding: search strategies over a model's prefill / decode_step interface (search.py),
text in and out (translate.py, streaming.py), and scoring a corpus split (evaluate.py).
Decoding never imports training."""
