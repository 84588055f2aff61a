"""A safetensors file written one tensor at a time. safetensors' writers take every tensor
at once, so a LoRA run whose merged weights are computed layer by layer, from frozen
weights kept in 4 or 8 bits, would hold the whole float model in memory to save it:
here a tensor may be `Pending`, computed only when its bytes are written, then freed.

The format (the safetensors specification): an 8-byte little-endian length, a JSON
header naming each tensor's dtype, shape and [begin, end) byte offsets in the data that
follows (and "__metadata__", strings), padded with spaces to a multiple of 8 bytes, then
the tensors' bytes, row-major and little-endian, one after another.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Pending:
    """A tensor of this dtype and shape, computed by `compute` when it is written."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    compute: Callable[[], Tensor]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty(0, dtype=self.dtype).element_size()


def write(file: Path, tensors: Mapping[str, Tensor | Pending],
          metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (in their order) to `file`, each Pending one computed in turn."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        if dtype not in DTYPE_CODES:
            raise ValueError(f"{name}: safetensors has no code for {dtype}")
        nbytes = tensor.nbytes
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name, tensor in tensors.items():
            out.write(_bytes_of(name, tensor))


def _bytes_of(name: str, entry: Tensor | Pending) -> memoryview:
    tensor = entry.compute() if isinstance(entry, Pending) else entry
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != tuple(entry.shape):
        raise ValueError(f"{name}: computed {tensor.dtype} {tuple(tensor.shape)}, announced "
                         f"{entry.dtype} {tuple(entry.shape)}")
    flat = tensor.detach().to("cpu").contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
