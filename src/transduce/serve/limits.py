"""What the server accepts, and the errors that tell a client what it sent wrong.

Every refusal is an ApiError: an HTTP status below 500, a message that names the field
or limit and the offending item, and the headers it needs (Retry-After for a full queue).
The app turns it into the JSON body {"error": message, "field": ...}.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transduce.config import ConfigError, ValidatedConfig, check_positive


MAX_WINDOW_MS = 1000     # a longer collection window only delays every request


@dataclass(frozen=True)
class Limits(ValidatedConfig):
    """max_chars: characters per text; max_texts: texts per request; max_queue: requests
    waiting for the decoding worker before new ones get 429; batch_tokens: source tokens
    a batch holds (padding counted); window_ms: how long the worker waits for more
    requests to join a batch; batching False decodes one request at a time (the
    behaviour of servers that serialise requests, kept for comparison); continuous False
    decodes whole batches even where sentences could join and leave a running search
    (batcher.py; kept for comparison); decoders: decoders of continuous searches side by
    side, sharing the cores (batcher.py; those after the first in processes of their
    own where create_app is given a way to load the model again, processes.py);
    max_attention_values: numbers in one /v1/attention answer (about 6 bytes of JSON
    each at 3 decimals); no_doubles: translations keep a token from directly following
    itself where a request does not say (search.forbid_doubles; LibreTranslate's
    clients cannot)."""

    max_chars: int = 5000
    max_texts: int = 128
    max_queue: int = 256
    batch_tokens: int = 4096
    window_ms: float = 5.0
    batching: bool = True
    continuous: bool = True
    decoders: int = 1
    max_attention_values: int = 2**25
    no_doubles: bool = False

    def __post_init__(self) -> None:
        self._check_bools()
        self._check_floats_finite()
        check_positive(self, "max_chars", "max_texts", "max_queue", "batch_tokens",
                       "decoders", "max_attention_values")
        if not 0 <= self.window_ms <= MAX_WINDOW_MS:
            raise ConfigError(f"Limits.window_ms={self.window_ms}: must be in "
                              f"[0, {MAX_WINDOW_MS}]")


@dataclass
class ApiError(Exception):
    """A refused request: status (4xx), a message naming what is wrong, the field (a
    JSON path such as "texts[3]") and any headers to send."""

    status: int
    message: str
    field: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)

    def body(self) -> dict:
        return {"error": self.message, **({"field": self.field} if self.field else {})}

    def openai_body(self) -> dict:
        """The body in OpenAI's shape, which its clients read the message from."""
        kind = "rate_limit_error" if self.status == 429 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.field,
                          "code": None}}


def check_texts(texts: list[str], limits: Limits, name: str, *,
                indexed: bool = True) -> None:
    """Refuse (413) a request with more texts than max_texts or a text longer than
    max_chars, naming the limit and the first offending item (`name[i]`, or `name`
    for a field that holds one text: indexed False)."""
    if len(texts) > limits.max_texts:
        raise ApiError(413, f"{name}: {len(texts)} texts, more than the limit of "
                            f"{limits.max_texts} per request (max_texts)", name)
    for index, text in enumerate(texts):
        if len(text) > limits.max_chars:
            field = _item(name, index, indexed)
            raise ApiError(413, f"{field}: {len(text)} characters, more than the limit of "
                                f"{limits.max_chars} (max_chars)", field)


def check_tokens(lengths: list[int], limit: int, name: str, truncate: bool, *,
                 indexed: bool = True) -> list[bool]:
    """Per text, whether it is over the model's `limit` tokens: refused (413) naming the
    first one, unless the client asked for truncation."""
    over = [length > limit for length in lengths]
    if not truncate:
        for index, (length, too_long) in enumerate(zip(lengths, over)):
            if too_long:
                field = _item(name, index, indexed)
                raise ApiError(413, f"{field}: {length} tokens, more than the model's limit "
                                    f"of {limit}; send \"truncate\": true to cut it instead",
                               field)
    return over


def _item(name: str, index: int, indexed: bool) -> str:
    return f"{name}[{index}]" if indexed else name
