"""The C++ kernels' building: a compilation says so first (a first call's pause has a
reason), a kernel already in torch's extension cache loads without a word."""

import warnings

import pytest
import torch
from torch.utils import cpp_extension

from transduce import native
from transduce.decode import beam_step
from transduce.errors import KernelBuilding


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    source = tmp_path / "kernel.cpp"
    source.write_text("// nothing\n")
    monkeypatch.setattr(cpp_extension, "load", lambda **_: None)     # no compiler run
    return native.NativeKernel(source, "test", "TRANSDUCE_TEST_KERNEL", "nothing else")


def test_a_kernel_to_compile_says_so_first(kernel, monkeypatch):
    monkeypatch.setattr(native, "_in_torch_cache", lambda name: False)
    with pytest.warns(KernelBuilding, match="compiling the test kernel for this CPU"):
        assert kernel.available()


def test_a_kernel_in_torchs_cache_loads_without_a_word(kernel, monkeypatch):
    monkeypatch.setattr(native, "_in_torch_cache", lambda name: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel.available()


@pytest.mark.skipif(not beam_step.available(), reason="the beam step kernel is not built here")
def test_a_built_kernel_is_found_in_torchs_cache():
    assert native._in_torch_cache(beam_step.KERNEL.extension_name())
    assert not native._in_torch_cache(beam_step.KERNEL.extension_name() + "_other")
    assert torch.ops.transduce.beam_extensions is not None
