"""Reading other toolkits' checkpoints into ours: Hugging Face GPT-2 (hf_gpt2.py), BLOOM
(hf_bloom.py), GPT-NeoX (hf_gpt_neox.py, with Pythia), StableLM (hf_stablelm.py), OLMo 2
(hf_olmo2.py), Phi-1, 1.5 and 2 (hf_phi.py), BERT (hf_bert.py), RoBERTa (hf_roberta.py,
with XLM-R and CamemBERT), Marian (hf_marian.py, the OPUS-MT translation models),
NLLB-200 and M2M-100 (hf_nllb.py), mBART-50 (hf_mbart.py), T5 (hf_t5.py, with Flan-T5
and mT5), Llama (hf_llama.py, with Mistral, Qwen2, Qwen3 and Phi-3) and Gemma 3 and
Gemma 2 (hf_gemma.py), and PEFT's LoRA adapters of those language models, merged (peft.py).
Each importer maps the weights name by name onto a model of this package that computes
the same function, and refuses, naming the file, key or option, what it cannot
reproduce; the result is an ordinary checkpoint directory (checkpoint.py), written whole
or not at all. (The package is not called `import`, a Python keyword.)"""

from transduce.errors import TransduceError


class ForeignCheckpointError(TransduceError, ValueError):
    """Another toolkit's checkpoint that cannot be imported: unreadable, incomplete, or
    with an option our models do not have; the message names the file and key."""


def check_foreign_options(hf: dict, config_file, model_type: str | tuple[str, ...],
                          fixed: dict, activation_key: str, default_activation: str,
                          activations: dict[str, str]) -> str:
    """A Hugging Face configuration of `model_type` (or one of them) whose `fixed` options
    have the values our models compute and whose activation we have -> that
    activation's name of ours."""
    check_type_and_fixed_options(hf, config_file, model_type, fixed)
    activation = hf.get(activation_key, default_activation)
    if activation not in activations:
        raise ForeignCheckpointError(f"{config_file}: {activation_key}={activation!r} is "
                                     f"not supported (choose one of {', '.join(activations)})")
    return activations[activation]


def check_type_and_fixed_options(hf: dict, config_file, model_type: str | tuple[str, ...],
                                 fixed: dict) -> None:
    """A Hugging Face configuration of `model_type` (or one of them) whose `fixed` options,
    where it names them, have the values our models compute."""
    import json

    types = (model_type,) if isinstance(model_type, str) else model_type
    found = hf.get("model_type")
    if found not in types:
        command = IMPORTED_BY.get(found) if isinstance(found, str) else None
        hint = f": import it with `transduce import {command}`" if command else ""
        raise ForeignCheckpointError(f"{config_file}: model_type={found!r}; only "
                                     f"{' or '.join(map(repr, types))} checkpoints can be "
                                     f"imported here{hint}")
    for name, ours in fixed.items():
        if name in hf and hf[name] != ours:
            raise ForeignCheckpointError(f"{config_file}: {name}={json.dumps(hf[name])} is "
                                         f"not supported (only {json.dumps(ours)})")


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


def check_tied_copy(tensors: dict, names: dict, source, name: str, tied_to, tied_name: str,
                    why: str) -> None:
    """A stored copy of a tied matrix (`name`, an lm_head.weight) must equal the matrix
    it is tied to (`tied_to`, float32, stored as `tied_name`); `why` ends the refusal."""
    import torch

    if name in names:
        stored = tensors[names.pop(name)]
        if stored.shape != tied_to.shape or not torch.equal(stored.float(), tied_to):
            raise ForeignCheckpointError(f"{source}: {name!r} differs from {tied_name!r}; "
                                         f"{why}")


def refuse_unread(names: dict, source, ignored=None) -> None:
    """After the mapping: the stored keys that no take_weight read (`names`, a foreign
    name -> its key), less those `ignored` (a compiled pattern over the names) matches,
    are refused, the first named."""
    unknown = sorted(key for name, key in names.items()
                     if ignored is None or not ignored.match(name))
    if unknown:
        raise ForeignCheckpointError(f"{source}: unknown weight {unknown[0]!r}"
                                     + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1
                                        else ""))


# After the error and the helpers, which the importers import from this package.
from transduce.importers.hf_gpt2 import import_gpt2  # noqa: E402
from transduce.importers.hf_bert import fresh_heads, import_bert  # noqa: E402
from transduce.importers.hf_roberta import import_roberta  # noqa: E402
from transduce.importers.hf_distilbert import import_distilbert  # noqa: E402
from transduce.importers.hf_electra import import_electra  # noqa: E402
from transduce.importers.hf_modernbert import import_modernbert  # noqa: E402
from transduce.importers.hf_deberta import import_deberta  # noqa: E402
from transduce.importers.hf_marian import import_marian  # noqa: E402
from transduce.importers.hf_llama import import_llama  # noqa: E402
from transduce.importers.hf_bloom import import_bloom  # noqa: E402
from transduce.importers.hf_gpt_neox import import_gpt_neox  # noqa: E402
from transduce.importers.hf_stablelm import import_stablelm  # noqa: E402
from transduce.importers.hf_phi import import_phi  # noqa: E402
from transduce.importers.hf_gptj import import_gptj  # noqa: E402
from transduce.importers.hf_olmo2 import import_olmo2  # noqa: E402
from transduce.importers.hf_gemma import import_gemma  # noqa: E402
from transduce.importers.hf_nllb import import_nllb  # noqa: E402
from transduce.importers.hf_mbart import import_mbart  # noqa: E402
from transduce.importers.hf_t5 import import_t5  # noqa: E402
from transduce.importers.peft import import_peft  # noqa: E402
from transduce.importers import hf_deberta, hf_distilbert, hf_electra, hf_gemma, \
    hf_gpt_neox, hf_gptj, hf_llama, hf_modernbert, hf_olmo2, hf_phi, hf_roberta, hf_stablelm, \
    hf_t5  # noqa: E402

# Which `transduce import` command reads a model_type: check_type_and_fixed_options names
# it where another command is given the directory.
IMPORTED_BY = {"gpt2": "hf-gpt2", "bloom": "hf-bloom", "bert": "hf-bert",
               "marian": "hf-marian", "m2m_100": "hf-nllb", "mbart": "hf-mbart",
               hf_gemma.MULTIMODAL: "hf-gemma",
               **dict.fromkeys(hf_gemma.MODEL_TYPES, "hf-gemma"),
               **dict.fromkeys(hf_llama.MODEL_TYPES, "hf-llama"),
               **dict.fromkeys(hf_gpt_neox.MODEL_TYPES, "hf-gpt-neox"),
               **dict.fromkeys(hf_stablelm.MODEL_TYPES, "hf-stablelm"),
               **dict.fromkeys(hf_olmo2.MODEL_TYPES, "hf-olmo2"),
               **dict.fromkeys(hf_phi.MODEL_TYPES, "hf-phi"),
               **dict.fromkeys(hf_gptj.MODEL_TYPES, "hf-gptj"),
               **dict.fromkeys(hf_roberta.MODEL_TYPES, "hf-roberta"),
               **dict.fromkeys(hf_distilbert.MODEL_TYPES, "hf-distilbert"),
               **dict.fromkeys(hf_electra.MODEL_TYPES, "hf-electra"),
               **dict.fromkeys(hf_modernbert.MODEL_TYPES, "hf-modernbert"),
               **dict.fromkeys(hf_deberta.MODEL_TYPES, "hf-deberta"),
               **dict.fromkeys(hf_t5.MODEL_TYPES, "hf-t5")}

__all__ = ["ForeignCheckpointError", "check_foreign_options", "take_weight",
           "refuse_unread", "import_gpt2", "import_llama", "import_bloom", "import_gpt_neox",
           "import_stablelm", "import_olmo2", "import_phi", "import_gptj", "import_gemma",
           "import_bert", "import_roberta", "import_distilbert", "import_electra",
           "import_modernbert", "import_deberta", "fresh_heads",
           "import_marian", "import_nllb", "import_mbart", "import_t5", "import_peft"]
