import pytest
import torch

from transduce.attention import masks


def test_padding_mask_from_lengths():
    mask = masks.padding_mask(torch.tensor([3, 1, 0]), max_len=4)
    assert mask.shape == (3, 1, 1, 4) and mask.dtype == torch.bool
    assert mask[:, 0, 0].tolist() == [[True, True, True, False], [True, False, False, False],
                                      [False, False, False, False]]


def test_padding_mask_defaults_to_longest_and_rejects_2d():
    assert masks.padding_mask(torch.tensor([2, 5])).shape == (2, 1, 1, 5)
    with pytest.raises(ValueError, match="1-D"):
        masks.padding_mask(torch.ones(2, 2, dtype=torch.long))


def test_padding_mask_from_ids_marks_non_pad():
    ids = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    assert torch.equal(masks.padding_mask_from_ids(ids, pad_id=0)[:, 0, 0], ids != 0)


def test_causal_mask_square_is_lower_triangular():
    mask = masks.causal_mask(4)
    assert mask.shape == (1, 1, 4, 4)
    assert torch.equal(mask[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_causal_mask_aligns_queries_with_the_last_keys():
    # Two new queries after three cached keys: query 0 is position 3, query 1 position 4.
    mask = masks.causal_mask(2, 5)[0, 0]
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_causal_mask_explicit_offset():
    mask = masks.causal_mask(3, 3, offset=-1)[0, 0]
    assert mask.tolist() == [[False, False, False], [True, False, False], [True, True, False]]


def test_combine_is_and_and_skips_none():
    a = torch.tensor([True, True, False])
    b = torch.tensor([True, False, False])
    assert masks.combine(None, a, None, b).tolist() == [True, False, False]
    assert masks.combine(None) is None
    assert masks.combine(a) is a


def test_group_heads_layouts():
    per_head = torch.rand(2, 6, 3, 5) > 0.5
    grouped = masks.group_heads(per_head, kv_heads=2, group=3)
    assert grouped.shape == (2, 2, 3, 3, 5)
    assert torch.equal(grouped[1, 1, 2], per_head[1, 5])
    assert masks.group_heads(per_head[:, :1], 2, 3).shape == (2, 1, 1, 3, 5)
