"""Reading other toolkits' checkpoints into ours: Hugging Face GPT-2 (hf_gpt2.py),
BERT (hf_bert.py) and Marian (hf_marian.py, the OPUS-MT translation models). Each
importer maps the weights name by name onto a model of this package that computes the
same function, and refuses, naming the file, key or option, what it cannot reproduce;
the result is an ordinary checkpoint directory (checkpoint.py), written whole or not at
all. (The package is not called `import`, a Python keyword.)"""

from transduce.errors import TransduceError


class ForeignCheckpointError(TransduceError, ValueError):
    """Another toolkit's checkpoint that cannot be imported: unreadable, incomplete, or
    with an option our models do not have; the message names the file and key."""


def check_foreign_options(hf: dict, config_file, model_type: str, fixed: dict,
                          activation_key: str, default_activation: str,
                          activations: dict[str, str]) -> str:
    """A Hugging Face configuration of `model_type` whose `fixed` options have the values
    our models compute and whose activation we have -> that activation's name of ours."""
    import json

    if hf.get("model_type") != model_type:
        raise ForeignCheckpointError(f"{config_file}: model_type={hf.get('model_type')!r}; "
                                     f"only {model_type!r} checkpoints can be imported here")
    for name, ours in fixed.items():
        if name in hf and hf[name] != ours:
            raise ForeignCheckpointError(f"{config_file}: {name}={json.dumps(hf[name])} is "
                                         f"not supported (only {json.dumps(ours)})")
    activation = hf.get(activation_key, default_activation)
    if activation not in activations:
        raise ForeignCheckpointError(f"{config_file}: {activation_key}={activation!r} is "
                                     f"not supported (choose one of {', '.join(activations)})")
    return activations[activation]


def check_directories(hf_dir, out, config_name: str) -> None:
    """A Hugging Face checkpoint directory to read, and an output that is not it."""
    if not (hf_dir / config_name).is_file():
        raise ForeignCheckpointError(f"{hf_dir}: not a Hugging Face checkpoint (no {config_name})")
    if out.resolve() == hf_dir.resolve():
        raise ForeignCheckpointError(f"{out}: the output would replace the checkpoint being "
                                     f"imported; choose another directory")


def unprefixed_names(tensors: dict, prefix: str, source) -> dict[str, str]:
    """The stored keys by name without `prefix` (a head class's "transformer." or
    "model."), which checkpoints save with or without; a weight under both is refused."""
    names: dict[str, str] = {}
    for key in tensors:
        name = key.removeprefix(prefix)
        if name in names:
            raise ForeignCheckpointError(f"{source}: {key!r} is stored twice (with and "
                                         f"without the {prefix!r} prefix)")
        names[name] = key
    return names


def take_weight(tensors: dict, names: dict, source, name: str, *shape: int):
    """The tensor a foreign checkpoint calls `name`, in float32, of `shape` (its own
    layout); `names` maps its names to the stored keys and loses this one, so that what
    is left at the end is what no mapping took."""
    if name not in names:
        raise ForeignCheckpointError(f"{source}: missing weight {name!r}")
    tensor = tensors[names.pop(name)]
    if tuple(tensor.shape) != shape:
        raise ForeignCheckpointError(f"{source}: {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the configuration needs {shape}")
    return tensor.float().contiguous()


# After the error and the helpers, which the importers import from this package.
from transduce.importers.hf_gpt2 import import_gpt2  # noqa: E402
from transduce.importers.hf_bert import fresh_heads, import_bert  # noqa: E402
from transduce.importers.hf_marian import import_marian  # noqa: E402

__all__ = ["ForeignCheckpointError", "check_foreign_options", "take_weight", "import_gpt2",
           "import_bert", "fresh_heads", "import_marian"]
