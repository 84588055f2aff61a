"""Where an exported graph's weights go: inside the graph, or, past protobuf's 2 GB limit
on one message (NLLB-600M's decoder step is 2.6 GB), in one file beside it, GRAPH.data.

torch.onnx.export writes each weight of a graph over the limit as a file of its own,
named after the weight (onnx__MatMul_3838, ...): a hundred files, and names that two
graphs exported to one directory can share. So each graph is traced into a directory
of its own, then written where it belongs with its weights in one file (`traced_graph`).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

# Weights above this many bytes in all go to GRAPH.data (protobuf refuses 2 GiB).
INLINE_BYTES = 1 << 30


@contextlib.contextmanager
def traced_graph(path: Path) -> Iterator[Path]:
    """The file to trace the graph `path` into; on leaving, the graph is at `path`,
    its weights inside it or in PATH.data."""
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".traced-") as scratch:
        traced = Path(scratch) / path.name
        yield traced
        rewrite_graph(traced, path)


def rewrite_graph(source: Path, path: Path) -> None:
    """Write the graph at `source` (its weights inside it or in files beside it) as
    `path`, its weights inside it, or in one PATH.data when they hold more than
    INLINE_BYTES; `source` and its weight files are removed (path may be source)."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    stored = {entry.value for tensor in _initializers(model)
              for entry in tensor.external_data if entry.key == "location"}
    if stored:
        onnx.load_external_data_for_model(model, str(source.parent))
    large = sum(len(tensor.raw_data) for tensor in _initializers(model)) > INLINE_BYTES
    if not stored and not large:
        if path != source:
            shutil.move(source, path)
        return
    data = path.with_name(path.name + ".data")
    for name in stored:
        (source.parent / name).unlink()
    if path != source:
        source.unlink()
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=large,
                    all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
    if data.is_file():            # (written owner-only; readable as the graph is)
        data.chmod(path.stat().st_mode & 0o777)


def has_weight_files(path: Path) -> bool:
    """Whether the graph at `path` keeps weights in files beside it."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(tensor.external_data for tensor in _initializers(model))


def _initializers(model) -> Iterator:
    yield from model.graph.initializer
