"""The kernels a training step calls, read from the step itself: its matrix products
and its attention kernels, each with the shapes, strides and dtype of its operands.

Why: MFU divides model FLOPs by a peak measured on one large square product, which the
products of a narrow model need not reach. Timing each of a step's own products alone
(bench/step_products.py) says what they need however well the rest is fused, so how
far a model of that shape can get on that machine. Read below autograd and autocast,
so the backward pass and the dtype each product really runs in are included.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm"}


@dataclass(frozen=True)
class Operand:
    """What a recorded call was given in one argument position: a tensor's layout, a
    list of operands (torch.cat's), or a value passed as it was."""
    size: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    device: str | None = None
    items: tuple[Operand, ...] | None = None
    value: object = None

    def fresh(self) -> object:
        """A new tensor of this layout (random floats, zero integers), a list of fresh
        items, or the value. The storage is filled before it is viewed with the strides:
        a broadcast operand (stride 0, an attention mask expanded over heads) has
        elements that share memory, which an in-place fill refuses."""
        if self.items is not None:
            return [item.fresh() for item in self.items]
        if self.size is None:
            return self.value
        extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride)) \
            if all(self.size) else 0
        storage = torch.empty(extent, dtype=self.dtype, device=self.device)
        storage = storage.normal_() if storage.is_floating_point() else storage.zero_()
        return storage.as_strided(self.size, self.stride)


@dataclass(frozen=True)
class Call:
    """One kind of kernel call: an aten op and the layouts of what it was given."""
    op: str                          # e.g. "aten.mm.default"
    args: tuple[Operand, ...]
    kwargs: tuple[tuple[str, Operand], ...]

    @property
    def kind(self) -> str:
        """"product", "attention" or "other"."""
        name = self.op.split(".")[1]
        if name in _PRODUCTS:
            return "product"
        return "attention" if "scaled_dot_product" in name else "other"

    @property
    def flops(self) -> float:
        """2 per multiply-add of a product (its bias add not counted); for an attention
        kernel, those of QK^T and AV over every key (B, H, T, S, D from its q and k),
        twice that for its backward pass, as the model FLOPs count them; 0 for the rest."""
        if self.kind == "product":
            a, b = (operand.size for operand in self.args[-2:])   # addmm: (bias, a, b)
            return 2.0 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
        if self.kind == "attention":
            backward = self.op.split(".")[1].endswith("_backward")
            q, k = (operand.size for operand in (self.args[1:3] if backward else self.args[:2]))
            batch, heads, queries, width = q
            return (8.0 if backward else 4.0) * batch * heads * queries * k[-2] * width
        return 0.0

    def replay(self):
        """-> a function that makes the call again on fresh operands of the same layout
        (made once, so that timing it times the kernel)."""
        func = _resolve(self.op)
        args = [operand.fresh() for operand in self.args]
        kwargs = {name: operand.fresh() for name, operand in self.kwargs}
        return lambda: func(*args, **kwargs)


class StepRecorder(TorchDispatchMode):
    """Counts every aten call made while active, by Call: `with StepRecorder() as
    recorder: step()`, then recorder.calls (Call -> how many times)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[Call] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls[Call(str(func), tuple(_operand(a) for a in args),
                        tuple((k, _operand(v)) for k, v in sorted(kwargs.items())))] += 1
        return func(*args, **kwargs)

    def of_kind(self, kind: str) -> dict[Call, int]:
        return {call: count for call, count in self.calls.items() if call.kind == kind}

    def flops(self, kind: str) -> float:
        """The FLOPs of the calls of one kind ("product" or "attention")."""
        return sum(call.flops * count for call, count in self.of_kind(kind).items())


def _operand(value) -> Operand:
    if isinstance(value, torch.Tensor):
        return Operand(tuple(value.shape), tuple(value.stride()), value.dtype,
                       str(value.device))
    if isinstance(value, (list, tuple)):
        return Operand(items=tuple(_operand(item) for item in value))
    return Operand(value=value)


def _resolve(op: str):
    """"aten.mm.default" -> torch.ops.aten.mm.default."""
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)
