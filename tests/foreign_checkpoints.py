"""What the importers' tests share: a copy of a small Hugging Face checkpoint with its
config or weights changed, and the check that an import was refused leaving nothing."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from transduce.importers import ForeignCheckpointError


def damaged(small_hf, tmp_path, config=None, weights=None):
    """A copy of small_hf; config(values) / weights(tensors) change it in place or
    return the replacement."""
    directory = tmp_path / "hf"
    shutil.copytree(small_hf, directory)
    if config:
        values = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(config(values) or values))
    if weights:
        tensors = load_file(str(directory / "model.safetensors"))
        save_file(weights(tensors) or tensors, str(directory / "model.safetensors"))
    return directory


def assert_refused(importer, directory, tmp_path, *messages):
    """importer(directory, out) raises naming every message, and writes nothing."""
    out = tmp_path / "out"
    with pytest.raises(ForeignCheckpointError) as error:
        importer(directory, out)
    for message in messages:
        assert message in str(error.value)
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
