"""Run-time choices: the training dtype that "auto" resolves to."""

import pytest
import torch

from transduce import runtime


@pytest.mark.parametrize("flags,expected", [
    ({"avx512f", "avx512_bf16"}, "bfloat16"),      # Zen 4, Cooper Lake
    ({"avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),  # Sapphire Rapids
    ({"avx2", "fma"}, "float32"),
    (set(), "float32"),                          # no /proc/cpuinfo
])
def test_auto_is_bfloat16_only_where_the_cpu_has_bfloat16_units(monkeypatch, flags, expected):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset(flags))
    assert runtime.training_dtype("auto", torch.device("cpu")) == expected


@pytest.mark.parametrize("requested", ["float32", "bfloat16"])
def test_an_explicit_dtype_is_kept(monkeypatch, requested):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset())
    assert runtime.training_dtype(requested, torch.device("cpu")) == requested


def test_cpu_flags_reads_this_machine():
    flags = runtime.cpu_flags()
    assert isinstance(flags, frozenset)
    if flags:      # Linux: an x86 or Arm flag list
        assert {"fpu", "sse2", "fp", "asimd"} & flags
