"""Search over the model's output distribution, one token per step through the KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from transduce.model.transformer import Transformer

EXTRA_LENGTH = 50  # the paper: maximum output length = input length + 50


@torch.no_grad()
def greedy_search(model: Transformer, src: Tensor, *, bos_id: int, eos_id: int,
                  max_len: int | None = None) -> Tensor:
    """Pick the most likely token at every step until eos or max_len.

    src (B, S) right-padded ids -> (B, L) generated ids without bos; each row ends with
    eos (unless cut at max_len) and is padded with pad_id after it. max_len defaults to
    the paper's S + 50, capped by the model's max_positions.
    """
    pad_id = model.config.pad_id
    if max_len is None:
        max_len = min(src.shape[1] + EXTRA_LENGTH, model.config.max_positions)
    state = model.prefill(src, max_len)
    batch = src.shape[0]
    token = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    generated = []
    for _ in range(max_len):
        logits = model.decode_step(token, state)[:, -1]                  # (B, V)
        token = logits.argmax(dim=-1, keepdim=True).masked_fill_(finished[:, None], pad_id)
        generated.append(token)
        finished |= token[:, 0] == eos_id
        if finished.all():
            break
    return torch.cat(generated, dim=1)
