"""What marks a directory as written by transduce, so that --force replaces nothing else.

A checkpoint, average, conversion, import or ONNX export holds our config.json, whose
"model" section names the architecture. A Hugging Face or CTranslate2 export holds its
format's config.json instead, which a directory the user downloaded holds too, so those
exports also write EXPORT_MARKER, naming the format and the checkpoint's steps.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = "config.json"
EXPORT_MARKER = "transduce-export.json"


def write_export_marker(directory: Path, format_name: str, steps: int | None,
                        **more) -> None:
    """Mark an export of `format_name` (from a checkpoint of `steps` training steps),
    with `more` that its user needs (a multilingual model's language code pieces)."""
    (directory / EXPORT_MARKER).write_text(json.dumps(
        {"written_by": "transduce", "format": format_name, "trained_steps": steps, **more},
        indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def written_by_transduce(directory: Path) -> bool:
    """Whether `directory` holds an export marker, or a config.json of ours."""
    if (directory / EXPORT_MARKER).is_file():
        return True
    try:
        config = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model"), dict) \
        and "arch" in config["model"]
