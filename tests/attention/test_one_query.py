"""The one-query kernel (C++): each row's queries over its own range of a cache's keys,
against the float64 reference on that range; GQA groups, head sizes compiled in and not,
views of larger buffers, one key, an empty range; clear errors; and a build that cannot
run leaves decoding to PyTorch's kernel."""

import pytest
import torch

from tests.attention.reference import reference_attention
from transduce.attention import one_query

needs_kernel = pytest.mark.skipif(not one_query.available(),
                                  reason="the one-query kernel could not be built here "
                                         "(g++ and ninja: scripts/install-system-packages.sh)")


def cache_views(B, Hkv, T, D, capacity=None):
    """k, v (B, Hkv, T, D) as views of buffers with more slots (a cache's layout)."""
    capacity = capacity or T + 5
    k, v = torch.randn(B, Hkv, capacity, D) * 2, torch.randn(B, Hkv, capacity, D)
    return k[:, :, :T], v[:, :, :T]


def reference(q, k, v, starts, ends):
    """Row by row over its own keys, in float64: (B, Hkv, G, D)."""
    B, Hkv, G, D = q.shape
    out = torch.zeros(B, Hkv, G, D, dtype=torch.float64)
    for b in range(B):
        s, e = int(starts[b]), int(ends[b])
        if e > s:
            queries = q[b:b + 1].reshape(1, Hkv * G, 1, D)           # heads of a group
            found, _ = reference_attention(queries, k[b:b + 1, :, s:e], v[b:b + 1, :, s:e])
            out[b] = found.view(Hkv, G, D)
    return out


@needs_kernel
@pytest.mark.parametrize("Hkv,G,D", [(4, 1, 64), (2, 3, 64), (1, 4, 32), (2, 2, 128),
                                     (3, 1, 24)])
def test_each_row_attends_its_own_range_as_the_float64_reference(Hkv, G, D):
    torch.manual_seed(D + G)
    B, T = 7, 19
    k, v = cache_views(B, Hkv, T, D)
    q = torch.randn(B, Hkv, G, D)
    starts = torch.tensor([0, 3, 3, 10, 18, 0, 7])
    ends = torch.tensor([19, 19, 19, 19, 19, 1, 12])           # one key; a shorter range
    out = one_query.one_query_attention(q, k, v, starts, ends, D ** -0.5)
    assert out.shape == (B, Hkv, G, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, k, v, starts, ends),
                               atol=2e-6, rtol=1e-5)


@needs_kernel
def test_an_empty_range_gives_zeros_and_rows_do_not_depend_on_each_other():
    torch.manual_seed(1)
    k, v = cache_views(3, 2, 9, 64)
    q = torch.randn(3, 2, 1, 64)
    starts, ends = torch.tensor([0, 4, 9]), torch.tensor([9, 9, 9])
    out = one_query.one_query_attention(q, k, v, starts, ends, 0.125)
    assert torch.equal(out[2], torch.zeros(2, 1, 64))
    alone = one_query.one_query_attention(q[1:2], k[1:2], v[1:2], starts[1:2], ends[1:2], 0.125)
    assert torch.equal(out[1:2], alone)


@needs_kernel
def test_rows_split_over_threads_give_what_one_thread_gives():
    """Wide enough that each (row, head) is a task of its own on PyTorch's threads."""
    torch.manual_seed(2)
    k, v = cache_views(40, 4, 200, 64)
    q = torch.randn(40, 4, 1, 64)
    starts, ends = torch.arange(40) * 3, torch.full((40,), 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = one_query.one_query_attention(q, k, v, starts, ends, 0.125)
        torch.set_num_threads(1)
        assert torch.equal(split, one_query.one_query_attention(q, k, v, starts, ends, 0.125))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(split.double(), reference(q, k, v, starts, ends),
                               atol=2e-6, rtol=1e-5)


@needs_kernel
def test_bad_input_is_refused_with_what_is_wrong():
    k, v = cache_views(2, 2, 5, 64)
    q = torch.randn(2, 2, 1, 64)
    starts, ends = torch.tensor([0, 0]), torch.tensor([5, 5])
    with pytest.raises(RuntimeError, match=r"row 1 reads keys \[0, 6\) of 5"):
        one_query.one_query_attention(q, k, v, starts, torch.tensor([5, 6]), 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        one_query.one_query_attention(q.double(), k, v, starts, ends, 0.125)
    with pytest.raises(RuntimeError, match=r"must be \(B, Hkv, G, D\)"):
        one_query.one_query_attention(q[:, :1], k, v, starts, ends, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        one_query.one_query_attention(q, k, v, starts.int(), ends, 0.125)
    with pytest.raises(RuntimeError, match="unit stride"):
        one_query.one_query_attention(q, torch.randn(2, 2, 5, 128)[..., ::2], v, starts, ends,
                                      0.125)


def test_without_the_kernel_callers_are_told_and_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(one_query.KERNEL, "loaded", False)
    with pytest.raises(RuntimeError, match="not built here"):
        one_query.one_query_attention(*[torch.zeros(1)] * 5, 0.1)
    monkeypatch.setattr(one_query.KERNEL, "loaded", None)
    monkeypatch.setenv(one_query.SWITCH, "0")
    assert not one_query.available()


def test_a_failed_build_warns_once_and_reports_unavailable(monkeypatch):
    from torch.utils import cpp_extension

    def broken(**_):
        raise RuntimeError("Error building extension\nno compiler")
    monkeypatch.setattr(one_query.KERNEL, "loaded", None)
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.warns(UserWarning, match="could not be built .no compiler.*PyTorch's"):
        assert not one_query.available()
    assert not one_query.available()                    # decided once per process
