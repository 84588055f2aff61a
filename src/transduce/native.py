"""C++ kernels built on first use by torch.utils.cpp_extension (g++ and ninja, installed
by the project's set-up script): tens of seconds once, then loaded from torch's
extension cache by a name that changes with the source, the PyTorch version and the
CPU's instruction set (-march=native compiles for this CPU); a compilation says so first
(KernelBuilding: the command line's `transduce: note:`). Where one cannot be built,
`available()` says so once with a warning and its callers keep PyTorch's own ops; an
environment switch turns each off."""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path

from transduce.errors import KernelBuilding, TransduceWarning


class NativeKernel:
    """One C++ source that registers torch.ops.transduce ops when loaded."""

    def __init__(self, source: Path, name: str, switch: str, fallback: str,
                 extra_cflags: tuple[str, ...] = ()):
        self.source, self.name, self.switch = source, name, switch
        self.fallback = fallback          # what callers do instead, for the warning
        self.extra_cflags = extra_cflags
        self.loaded: bool | None = None   # None: not tried yet in this process
        self._building = threading.Lock()

    def available(self) -> bool:
        """Whether the ops run here: built (or loaded from the cache) on the first call;
        False where the switch is off or the build failed."""
        if self.loaded is None:
            with self._building:
                if self.loaded is None:
                    self.loaded = os.environ.get(self.switch, "1") != "0" and self._build()
        return self.loaded

    def _build(self) -> bool:
        from torch.utils import cpp_extension

        name = self.extension_name()
        if not _in_torch_cache(name):
            warnings.warn(f"compiling the {self.name} kernel for this CPU (once: torch "
                          "keeps it in its extension cache)", KernelBuilding, stacklevel=4)
        try:
            cpp_extension.load(name=name, sources=[str(self.source)],
                               extra_cflags=["-O3", "-march=native", *self.extra_cflags],
                               is_python_module=False, verbose=False)
            return True
        except Exception as error:  # noqa: BLE001  no compiler, no ninja, a failed build
            lines = str(error).strip().splitlines() or [type(error).__name__]
            warnings.warn(f"the {self.name} kernel could not be built ({lines[-1][:300]}); "
                          f"{self.fallback}", TransduceWarning, stacklevel=4)
            return False

    def extension_name(self) -> str:
        """A name that changes with what the build depends on: the source, its flags,
        PyTorch, and the CPU's instruction set (-march=native)."""
        import torch

        digest = hashlib.sha256(self.source.read_bytes())
        digest.update(" ".join(self.extra_cflags).encode())
        digest.update(torch.__version__.encode())
        digest.update((platform.machine() + _cpu_flags_line()).encode())
        return f"transduce_{self.name.replace(' ', '_').replace('-', '_')}_{digest.hexdigest()[:16]}"


def _in_torch_cache(name: str) -> bool:
    """Whether torch's extension cache holds extension `name` built (then loading it
    takes a moment, not a compilation)."""
    from torch.utils import cpp_extension

    try:
        directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001  a private helper: a torch without it, say so
        return False
    return (directory / f"{name}.so").is_file()


def _cpu_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
