"""How a sentence-transformers model makes its embeddings, read from its directory so
that the import embeds as it does: modules.json lists the modules after the
transformer; 1_Pooling/config.json (or wherever modules.json says) names the pooling
mode, and a Normalize module L2-normalises. BGE pools [CLS]; all-MiniLM, E5 and most
others take the mean over the tokens; both are ours (EncoderOnly.sentence_embeddings).

    modules.json                [{"path": "", "type": "sentence_transformers.models.Transformer"},
                                 {"path": "1_Pooling", "type": "...models.Pooling"},
                                 {"path": "2_Normalize", "type": "...models.Normalize"}]
    1_Pooling/config.json       {"pooling_mode_cls_token": false,
                                 "pooling_mode_mean_tokens": true, ...}

A pooling we do not compute (max, weighted mean, last token, several at once) or a
module after it that changes the vectors (Dense, LayerNorm) is refused by name, as
vectors made otherwise would be silently wrong; without modules.json nothing is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transduce.importers import ForeignCheckpointError

MODULES = "modules.json"
# pooling_mode_* -> ours; the others, which sentence-transformers also has, are refused.
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def read_sentence_embedding(hf_dir: Path) -> dict[str, Any] | None:
    """{"pooling": "mean" or "cls", "normalize": bool} of a sentence-transformers
    directory, or None when it is none (no modules.json, or no Pooling module)."""
    modules_file = hf_dir / MODULES
    if not modules_file.is_file():
        return None
    modules = _read(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ForeignCheckpointError(f"{modules_file}: expected a list of modules")
    pooling, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if pooling is None and kind != "Pooling":
            raise ForeignCheckpointError(f"{modules_file}: a {kind} module before the "
                                         f"pooling; only Transformer, Pooling, Normalize")
        if kind == "Pooling":
            pooling = _pooling(hf_dir / str(module.get("path", "")) / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise ForeignCheckpointError(
                f"{modules_file}: the embeddings go through a {kind} module "
                f"({module.get('path')!r}) after pooling, which the import does not carry; "
                f"remove {MODULES} to import the transformer alone")
    return None if pooling is None else {"pooling": pooling, "normalize": normalize}


def _pooling(config_file: Path) -> str:
    """The Pooling module's one mode that we compute, named by its config.json."""
    if not config_file.is_file():
        raise ForeignCheckpointError(f"{config_file}: missing (the Pooling module's "
                                     f"settings, which {MODULES} names)")
    values = _read(config_file)
    if not isinstance(values, dict):
        raise ForeignCheckpointError(f"{config_file}: expected a JSON object")
    chosen = [name for name in (*POOLING_MODES, *OTHER_MODES) if values.get(name)]
    if len(chosen) != 1 or chosen[0] not in POOLING_MODES:
        raise ForeignCheckpointError(
            f"{config_file}: pooling {', '.join(chosen) or 'none'}; only one of "
            f"{', '.join(POOLING_MODES)} is reproduced (remove {MODULES} to import the "
            f"transformer alone)")
    return POOLING_MODES[chosen[0]]


def _read(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ForeignCheckpointError(f"{file}: unreadable ({error})") from None
