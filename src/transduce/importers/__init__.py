"""Reading other toolkits' checkpoints into ours: Hugging Face GPT-2 (hf_gpt2.py). Each
importer maps the weights name by name onto a model of this package that computes the
same function, and refuses, naming the file, key or option, what it cannot reproduce;
the result is an ordinary checkpoint directory (checkpoint.py), written whole or not at
all. (The package is not called `import`, a Python keyword.)"""

from transduce.errors import TransduceError


class ForeignCheckpointError(TransduceError, ValueError):
    """Another toolkit's checkpoint that cannot be imported: unreadable, incomplete, or
    with an option our models do not have; the message names the file and key."""


# After the error, which hf_gpt2 imports from this package.
from transduce.importers.hf_gpt2 import import_gpt2  # noqa: E402

__all__ = ["ForeignCheckpointError", "import_gpt2"]
