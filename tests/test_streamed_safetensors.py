"""The safetensors file written one tensor at a time (streamed_safetensors.py): read back
by safetensors itself, equal to what its own writer writes, every dtype, empty and
scalar tensors, metadata; Pending tensors computed one at a time, as they are written."""

import json
import struct
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from transduce.streamed_safetensors import DTYPE_CODES, Pending, write


def sample_tensors():
    torch.manual_seed(0)
    tensors = {f"t_{str(dtype).removeprefix('torch.')}":
               (torch.randn(3, 5) * 100).to(dtype) for dtype in DTYPE_CODES}
    tensors.update({"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
                    "odd": torch.arange(7, dtype=torch.uint8)})   # 7 bytes: offsets unaligned
    return tensors


def test_safetensors_reads_back_what_its_own_writer_writes(tmp_path):
    tensors = sample_tensors()
    write(tmp_path / "ours.safetensors", tensors, {"format": "pt", "note": "é"})
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    ours, theirs = load_file(str(tmp_path / "ours.safetensors")), \
        load_file(str(tmp_path / "theirs.safetensors"))
    assert ours.keys() == theirs.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], theirs[name]), name
    with safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "note": "é"}
    raw = (tmp_path / "ours.safetensors").read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    assert length % 8 == 0 and json.loads(raw[8:8 + length])["odd"]["data_offsets"][1] - \
        json.loads(raw[8:8 + length])["odd"]["data_offsets"][0] == 7


def test_pending_tensors_are_computed_one_at_a_time_as_they_are_written(tmp_path):
    """Each is computed when its turn comes, and freed before the next one is."""
    computed, earlier = [], []

    def compute(value):
        def run():
            computed.append(value)
            assert all(ref() is None for ref in earlier)      # the previous one is gone
            tensor = torch.full((4, 3), value)
            earlier.append(weakref.ref(tensor))
            return tensor
        return run

    tensors = {"a": torch.ones(2), "b": Pending(torch.float32, (4, 3), compute(2.0)),
               "c": Pending(torch.float32, (4, 3), compute(3.0))}
    write(tmp_path / "w.safetensors", tensors)
    assert computed == [2.0, 3.0]
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert torch.equal(loaded["a"], torch.ones(2))
    assert torch.equal(loaded["b"], torch.full((4, 3), 2.0))
    assert torch.equal(loaded["c"], torch.full((4, 3), 3.0))


def test_a_pending_tensor_that_is_not_what_it_announced_is_refused(tmp_path):
    wrong = {"w": Pending(torch.float32, (2, 2), lambda: torch.zeros(2, 3))}
    with pytest.raises(ValueError, match=r"w: computed torch.float32 \(2, 3\), announced "
                                         r"torch.float32 \(2, 2\)"):
        write(tmp_path / "w.safetensors", wrong)
    with pytest.raises(ValueError, match="x: safetensors has no code for torch.complex64"):
        write(tmp_path / "x.safetensors", {"x": torch.zeros(2, dtype=torch.complex64)})
