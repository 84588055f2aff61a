"""What an instruct model's directory says about conversations: its chat template
(chat_template.jinja, where transformers 4.43 and later save it, else
tokenizer_config.json's "chat_template", else that of chat_template.json, a multimodal
model's processor file) with the special tokens' strings the template reads, and the
tokens that end a reply (the eos_token_id lists of config.json and
generation_config.json: Llama 3's <|end_of_text|>, <|eom_id|> and <|eot_id|>).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transduce.data.chat import ChatError, ChatTemplate, read_chat_template
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.tokenizer import TokenizerError
from transduce.importers import ForeignCheckpointError

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")   # the latter wins
TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
               "mask_token")
END_FILES = ("config.json", "generation_config.json")


def with_chat_settings(tokenizer: HFTokenizer, hf_dir: Path) -> HFTokenizer:
    """The imported tokenizer with the directory's chat template (if it has one) and end
    tokens; a malformed one is refused naming its file."""
    template = _template(hf_dir)
    try:
        return tokenizer.with_chat(template, _end_ids(hf_dir))
    except TokenizerError as error:
        raise ForeignCheckpointError(f"{hf_dir}: eos_token_id: {error}") from None


def _template(hf_dir: Path) -> ChatTemplate | None:
    file = hf_dir / TEMPLATE_FILE
    try:
        if file.is_file():
            text = file.read_text(encoding="utf-8")
        else:
            text = None
            for file in (hf_dir / TOKEN_FILES[0], hf_dir / PROCESSOR_TEMPLATE_FILE):
                text = read_chat_template(_json(file).get("chat_template"), str(file)) \
                    if file.is_file() else None
                if text is not None:
                    break
        if text is None:
            return None
        template = ChatTemplate(text, _template_tokens(hf_dir))
        template.check(str(file))
        return template
    except (OSError, UnicodeDecodeError) as error:
        raise ForeignCheckpointError(f"{file}: unreadable ({error})") from None
    except ChatError as error:
        raise ForeignCheckpointError(str(error)) from None


def _template_tokens(hf_dir: Path) -> dict[str, str]:
    """The special tokens' strings, as transformers gives them to a template (a token
    set to null is not given)."""
    tokens: dict[str, str] = {}
    for name in TOKEN_FILES:
        if (hf_dir / name).is_file():
            values = _json(hf_dir / name)
            for key in TOKEN_NAMES:
                value = values.get(key, ...)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    tokens[key] = value
                elif value is None:
                    tokens.pop(key, None)
    return tokens


def _end_ids(hf_dir: Path) -> list[int]:
    ids: list[int] = []
    for name in END_FILES:
        if not (hf_dir / name).is_file():
            continue
        given = _json(hf_dir / name).get("eos_token_id")
        given = [given] if given is None or isinstance(given, int) else given
        if not isinstance(given, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in given if i is not None):
            raise ForeignCheckpointError(f"{hf_dir / name}: eos_token_id must be an id or a "
                                         f"list of ids, got {json.dumps(given):.60}")
        ids += [i for i in given if i is not None]
    return ids


def _json(file: Path) -> dict[str, Any]:
    from transduce.importers.hf_gpt2 import _read_json

    return _read_json(file)
