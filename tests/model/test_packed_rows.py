"""Packed rows (several pairs a row, attention/masks.py Segments) compute every pair as it
is alone: the same hidden states and the same gradients, for every position kind and
the kernels that run on a CPU."""

import pytest
import torch

from transduce.attention.masks import positions_in_segments
from transduce.config import preset
from transduce.data.packing import sentence_numbers
from transduce.model import build_model

VOCAB = 300
# Each row's pairs as (source length, target length); row length 24. The second row ends
# without padding on the target side, the third is one pair.
ROWS = [[(5, 7), (9, 4), (3, 6)], [(12, 10), (11, 14)], [(1, 1)]]
LENGTH = 24


def pairs(generator):
    return [[(torch.randint(4, VOCAB, (s,), generator=generator),
              torch.randint(4, VOCAB, (t,), generator=generator)) for s, t in row] for row in ROWS]


def packed(rows):
    """-> src, tgt (B, LENGTH) right-padded with 0, and their sentence numbers."""
    src = torch.zeros(len(rows), LENGTH, dtype=torch.long)
    tgt = torch.zeros(len(rows), LENGTH, dtype=torch.long)
    for r, row in enumerate(rows):
        src_ids, tgt_ids = torch.cat([s for s, _ in row]), torch.cat([t for _, t in row])
        src[r, :len(src_ids)], tgt[r, :len(tgt_ids)] = src_ids, tgt_ids
    numbers = [sentence_numbers([[len(x[side]) for x in row] for row in rows], LENGTH)
               for side in (0, 1)]
    return src, tgt, numbers


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rotary", "t5", "alibi"])
@pytest.mark.parametrize("impl", ["sdpa", "naive", "flash"])
def test_packed_rows_compute_each_pair_as_alone(positional, impl):
    config = preset("tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.0,
                    positional=positional, attention_impl=impl, num_kv_heads=2)
    torch.manual_seed(0)
    model = build_model(config).double().train()   # float64: any real difference stands out
    rows = pairs(torch.Generator().manual_seed(1))
    src, tgt, numbers = packed(rows)
    hidden = model(src, tgt, project=False, segments=tuple(numbers))        # (B, L, C)
    probe = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2),
                        dtype=torch.float64)
    real = (numbers[1] >= 0).unsqueeze(-1)
    got_grads = torch.autograd.grad((hidden * probe * real).sum(), list(model.parameters()))

    expected_loss = 0.0
    for r, row in enumerate(rows):
        at = 0
        for s, t in row:
            alone = model(s[None], t[None], project=False)[0]               # (t, C)
            torch.testing.assert_close(hidden[r, at:at + len(t)], alone, rtol=1e-10, atol=1e-10)
            expected_loss = expected_loss + (alone * probe[r, at:at + len(t)]).sum()
            at += len(t)
    expected_grads = torch.autograd.grad(expected_loss, list(model.parameters()))
    for got, expected in zip(got_grads, expected_grads):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


def test_positions_count_from_each_sentence_start():
    numbers = sentence_numbers([[2, 3], [4]], 6)
    assert numbers.tolist() == [[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, -1, -1]]
    assert positions_in_segments(numbers).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]


def test_packed_rows_refuse_attention_without_softmax():
    config = preset("tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, attention_type="linear")
    model = build_model(config)
    src, tgt, numbers = packed(pairs(torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="packed rows need softmax attention"):
        model(src, tgt, segments=tuple(numbers))
