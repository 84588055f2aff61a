"""What the written-out inference passes share (decoder_step.py, encoder_pass.py): built
for the layouts they support only, their layers compiled by TorchScript on first use,
once, whichever decoding thread gets there first."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch import nn


def compiled(module: nn.Module) -> nn.Module:
    """`module` compiled by TorchScript, or as it is where TorchScript is missing or cannot
    compile it (the same code then runs as Python). TorchScript's deprecation warning is
    kept out of the caller's warnings."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(module)
    except Exception:  # noqa: BLE001  any failure to compile leaves the Python code
        return module


class CompiledOnFirstCall:
    """Calls `module`, compiled by TorchScript at the first call (script=False: never).
    Decoding workers may share it: the compiled module is reentrant."""

    def __init__(self, module: nn.Module, script: bool = True):
        self.module = module
        self._compiled = not script          # True: nothing left to compile
        self._compiling = threading.Lock()

    @property
    def is_scripted(self) -> bool:
        """Whether the module runs compiled (known after the first call)."""
        return isinstance(self.module, torch.jit.ScriptModule)

    def __call__(self, *args: Any) -> Any:
        if not self._compiled:
            with self._compiling:
                if not self._compiled:
                    self.module, self._compiled = compiled(self.module), True
        return self.module(*args)


class WrittenOut:
    """A written-out pass over a module's layers (subclasses: `supports`, and an
    __init__(module, script) that sets `layers`)."""

    layers: CompiledOnFirstCall

    @staticmethod
    def supports(module: nn.Module) -> bool:
        raise NotImplementedError

    @classmethod
    def build(cls, module: nn.Module, script: bool = True) -> "WrittenOut | None":
        """The pass over `module`, or None where its layout is one the pass leaves to
        the modules."""
        return cls(module, script) if cls.supports(module) else None

    @property
    def is_scripted(self) -> bool:
        """Whether the layers run compiled (known after the first call)."""
        return self.layers.is_scripted
