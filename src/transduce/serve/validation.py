"""Bad input -> a 4xx JSON error that names the field and the problem, never a 500.

FastAPI's own errors (422 validation lists, 400 unreadable bodies, 404, 405) are
rewritten into the one shape every route answers with: {"error": message, "field": path},
the path written as in JSON ("texts[2]", "stop[0]").
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Iterable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from transduce.decode.languages import Direction, LanguageError
from transduce.serve.limits import ApiError
from transduce.serve.schemas import ErrorBody, LanguagePair, OpenAIErrorBody



def _error_responses(body: type) -> dict[int | str, dict[str, Any]]:
    """The refusals a route documents in /openapi.json, with the body's schema."""
    return {status: {"model": body, "description": text} for status, text in (
        (400, "malformed body"), (413, "over a limit (named in the error)"),
        (422, "a field with a wrong type or value (named in the error)"),
        (429, "the queue is full; see Retry-After"))}


ERROR_RESPONSES = _error_responses(ErrorBody)
OPENAI_ERROR_RESPONSES = _error_responses(OpenAIErrorBody)   # OPENAI_PATHS' routes


def checked_direction(translator, body: LanguagePair,
                      default: tuple[str, str] | None) -> Direction:
    """A request's source_lang and target_lang (each None: the server's `default` pair's)
    as the translator's tokens; a language its model lacks (or none named, for a
    multilingual model without a default pair) is a 422 naming the field."""
    source, target = default if default and translator.language_codes else (None, None)
    try:
        return translator.direction(body.source_lang or source, body.target_lang or target)
    except LanguageError as error:
        field = f"{error.side}_lang"
        raise ApiError(422, f"{field}: {error}", field) from None


def read_json(text: str) -> Any:
    """A request body's JSON; a body Python's reader cannot take is a 400 saying why
    (malformed where, nested too deeply, a number too long)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"malformed JSON: {error.msg} at line {error.lineno} column "
                            f"{error.colno}") from None
    except RecursionError:
        raise ApiError(400, "the JSON body is nested too deeply") from None
    except ValueError:          # an integer of more digits than Python converts
        raise ApiError(400, f"the JSON body has a number of more than "
                            f"{sys.get_int_max_str_digits()} digits") from None


def field_path(location: Sequence[Any]) -> str:
    """("body", "texts", 2) -> "texts[2]"."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path


def validation_error(errors: Iterable[dict], prefix: tuple = ("body",)) -> ApiError:
    """The first of pydantic's errors as an ApiError: 400 for a body that is no JSON,
    422 otherwise, naming the field."""
    errors = [(_location(e, prefix), e) for e in errors]
    if not errors:
        return ApiError(422, "invalid request")
    # A union's members fail each in turn; the deepest location is the most telling.
    location, first = max(errors, key=lambda pair: len(pair[0]))
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {})
        return ApiError(400, f"malformed JSON: {ctx.get('error', 'cannot be parsed')}")
    name = field_path(location)
    if first.get("type") == "missing" and not name:
        return ApiError(422, "the body is missing: send a JSON object")
    if first.get("type") == "missing":
        return ApiError(422, f"{name}: required field missing", name or None)
    if first.get("type") == "extra_forbidden":
        return ApiError(422, f"{name}: unknown field", name or None)
    message = first.get("msg", "invalid").removeprefix("Value error, ")   # our validators'
    value = first.get("input")
    if isinstance(value, float) and not math.isfinite(value):
        message = f"{json.dumps(value)} is not a number it takes: give a finite number"
    if not name:
        return ApiError(422, f"the body: {message}")
    return ApiError(422, f"{name}: {message}", name)


def _location(error: dict, prefix: tuple) -> tuple:
    """pydantic's location without the prefix ("body") and the union members' names."""
    location = tuple(error.get("loc", ()))
    if location[:len(prefix)] == prefix:
        location = location[len(prefix):]
    return tuple(p for p in location if not _union_tag(p))


def _union_tag(part: Any) -> bool:
    """pydantic names the member of a union that failed ("str", "list[...]",
    "function-after[...]", a model's class: "RerankText") in the location; no field is
    named so."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")
                                      or part[:1].isupper())


async def _why_unreadable(request: Request) -> str:
    """What is wrong with a body FastAPI could not parse, read again (it is cached)."""
    try:
        read_json((await request.body()).decode("utf-8"))
    except UnicodeDecodeError as error:
        return f"the body is not valid UTF-8 (byte {error.start})"
    except ApiError as error:
        return error.message
    return "the body is not valid UTF-8 JSON"


# Routes in OpenAI's shape: their errors in its shape too.
OPENAI_PATHS = ("/v1/chat/", "/v1/completions", "/v1/embeddings")


def install_error_handlers(app: FastAPI) -> None:
    """Route every refusal through ApiError's JSON shape (OpenAI's on its routes)."""

    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        openai = request.url.path.startswith(OPENAI_PATHS)
        return JSONResponse(error.openai_body() if openai else error.body(),
                            status_code=error.status, headers=error.headers)

    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        kind = media_type(request)
        if not is_json(kind):
            return await api_error(request, ApiError(415, f"content-type {kind!r}: send "
                                                          f"application/json"))
        return await api_error(request, validation_error(error.errors()))

    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = str(error.detail)
        if error.status_code == 400 and "parsing the body" in message:
            message = await _why_unreadable(request)
        elif error.status_code == 404:
            posts = sorted(path for path, operations in request.app.openapi()["paths"].items()
                           if "post" in operations)
            message = f"no route {request.url.path} (this model's server answers POST on " \
                      f"{', '.join(posts)})"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return await api_error(request, ApiError(error.status_code, message,
                                                 headers=dict(error.headers or {})))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)


def media_type(request: Request) -> str:
    """The request's content-type without its parameters, lower case ("" when none)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def is_json(kind: str) -> bool:
    """application/json or a +json type; none given is read as JSON."""
    return kind in ("", "application/json") or kind.endswith("+json")
