"""Where an exported graph's weights go: inside the graph, or, past protobuf's 2 GB limit
on one message (NLLB-600M's decoder step is 2.6 GB), in one file beside it, GRAPH.data;
and a weight two graphs hold, once (the tied embedding: onnx_tied.py; in int8,
onnx_int8_tables.py), in the decoder step's GRAPH.data, where the encoder reads it.

torch.onnx.export writes each weight of a graph over the limit as a file of its own,
named after the weight (onnx__MatMul_3838, ...): a hundred files, and names that two
graphs exported to one directory can share. So each graph is traced into a directory
of its own, then written where it belongs with its weights in one file (`traced_graph`).
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from pathlib import Path
from typing import Iterator

from transduce.export.onnx_tied import multiply_by_gathered_tables

# Weights above this many bytes in all go to GRAPH.data (protobuf refuses 2 GiB).
INLINE_BYTES = 1 << 30
# Weights of at least this many bytes are looked for in another graph's GRAPH.data.
SHARED_BYTES = 1 << 20


@contextlib.contextmanager
def traced_graph(path: Path) -> Iterator[Path]:
    """The file to trace the graph `path` into; on leaving, the graph is at `path`,
    its weights inside it or in PATH.data, a tied embedding stored once."""
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".traced-") as scratch:
        traced = Path(scratch) / path.name
        yield traced
        rewrite_graph(traced, path)


def rewrite_graph(source: Path, path: Path) -> None:
    """Write the graph at `source` (its weights inside it or in files beside it) as
    `path`, its output multiplied by the embedding table it is tied to (onnx_tied.py),
    its weights inside it, or in one PATH.data when they hold more than INLINE_BYTES;
    `source` and its weight files are removed (path may be source)."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    stored = {entry.value for tensor in _initializers(model)
              for entry in tensor.external_data if entry.key == "location"}
    if stored:
        onnx.load_external_data_for_model(model, str(source.parent))
    multiply_by_gathered_tables(model)
    for name in stored:
        (source.parent / name).unlink()
    if path != source:
        source.unlink()
    save_graph(model, path)


def share_stored_weights(path: Path, donor: Path) -> int:
    """The weights of the graph at `path` that the graph at `donor` stores in its
    GRAPH.data, byte for byte, are read from there (a donor holding such a weight inside
    its graph stores its weights in GRAPH.data first); PATH.data is written without them
    -> the bytes no longer stored twice."""
    import onnx

    apart = path.with_name(path.name + ".data").is_file()
    model = onnx.load(str(path))
    held = {_key(tensor, [tensor.raw_data]): tensor for tensor in _initializers(model)
            if len(tensor.raw_data) >= SHARED_BYTES}
    _store_apart_if_shared(held.keys(), donor)
    donated = _stored_tensors(donor)
    shared = 0
    for key in held.keys() & donated.keys():
        tensor = held[key]
        shared += len(tensor.raw_data)
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for entry_key, value in donated[key].items():
            tensor.external_data.add(key=entry_key, value=value)
    if shared:
        save_graph(model, path, external=apart)     # the rest where it was
    return shared


def _store_apart_if_shared(keys, donor: Path) -> None:
    """A donor that keeps its weights inside its graph (under INLINE_BYTES: an int8
    export, a model of a few hundred MB) and holds a weight whose _key is among `keys`
    (another graph's weights of SHARED_BYTES or more) has them written to DONOR.data,
    where the other graph can read them."""
    import onnx

    if not keys or donor.with_name(donor.name + ".data").is_file():
        return
    model = onnx.load(str(donor))
    if any(len(t.raw_data) >= SHARED_BYTES and _key(t, [t.raw_data]) in keys
           for t in _initializers(model)):
        save_graph(model, donor, external=True)


def _stored_tensors(graph: Path) -> dict[tuple, dict[str, str]]:
    """The weights a graph keeps in its GRAPH.data, of SHARED_BYTES or more: (their
    shape, type and digest) -> their external_data entries (location, offset, length)."""
    import onnx

    data = graph.with_name(graph.name + ".data")
    if not data.is_file():
        return {}
    model = onnx.load(str(graph), load_external_data=False)
    found = {}
    with data.open("rb") as file:
        for tensor in _initializers(model):
            entries = {entry.key: entry.value for entry in tensor.external_data}
            if entries.get("location") != data.name or \
                    int(entries.get("length", 0)) < SHARED_BYTES:
                continue
            file.seek(int(entries.get("offset", 0)))
            found[_key(tensor, _pieces(file, int(entries["length"])))] = entries
    return found


def _pieces(file, length: int) -> Iterator[bytes]:
    """`length` bytes of `file` from where it stands, 64 MB at a time (NLLB's table is
    1 GB)."""
    while length > 0 and (piece := file.read(min(length, 1 << 26))):
        length -= len(piece)
        yield piece


def _key(tensor, pieces) -> tuple:
    """What identifies a weight's value: its shape, type and the digest of its bytes."""
    digest = hashlib.blake2b()
    for piece in pieces:
        digest.update(piece)
    return tuple(tensor.dims), tensor.data_type, digest.hexdigest()


def save_graph(model, path: Path, external: bool | None = None) -> None:
    """The graph at `path`, its weights (those it holds: some may be read from another
    graph's file) inside it, or in PATH.data (`external`; default: when they pass
    INLINE_BYTES)."""
    import onnx

    data = path.with_name(path.name + ".data")
    if external is None:
        external = sum(len(tensor.raw_data) for tensor in _initializers(model)) > INLINE_BYTES
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=external,
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
