"""The routes of a translation (encoder-decoder) model: /v1/translate, LibreTranslate's
/translate and /languages (its /v1/attention: attention.py). A multilingual model
(decode/languages.py) translates between the languages each request names.

Sentences of concurrent requests with the same search settings are decoded together by
the worker (batcher.py): a Transformer's continuously (continuous.py: sentences join and
leave the running search between steps), other models' in batches that Translator
sorts and pads; either way each sentence gets what it would alone.
"""

from __future__ import annotations

from typing import Sequence
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request
from pydantic import ValidationError

from transduce.decode.languages import Direction, LanguageError
from transduce.decode.translate import Translation, Translator
from transduce.serve.batcher import Job
from transduce.serve.continuous import translation_stream
from transduce.serve.limits import ApiError, check_texts, check_tokens
from transduce.serve.schemas import LibreTranslateRequest, Timings, \
    TranslateRequest, TranslateResponse, Translated
from transduce.serve.service import Service, split_by_job, timed
from transduce.serve.validation import ERROR_RESPONSES, checked_direction, is_json, \
    media_type, read_json, validation_error

LANGUAGE_NAMES = {"en": "English", "es": "Spanish", "de": "German", "fr": "French",
                  "it": "Italian", "pt": "Portuguese"}


def routes(service: Service) -> APIRouter:
    """The translation routes, bound to the service's Translator."""
    router = APIRouter()
    translator: Translator = service.model

    @router.post("/v1/translate", response_model=TranslateResponse, responses=ERROR_RESPONSES,
                 summary="Translate sentences, with scores, n-best lists and timings")
    async def translate(body: TranslateRequest) -> TranslateResponse:
        if body.nbest > body.beam:
            raise ApiError(422, f"nbest: {body.nbest} is more than beam ({body.beam}); a "
                                f"beam search finds at most beam hypotheses", "nbest")
        limit = translator.max_source_tokens
        if body.max_length is not None and body.max_length > limit:
            raise ApiError(422, f"max_length: {body.max_length} is more than the model's "
                                f"{limit} positions", "max_length")
        way = checked_direction(translator, body, service.languages)
        found, timings = await _translate(service, body.texts, "texts", body.beam,
                                          body.alpha, body.nbest, body.max_length,
                                          body.truncate, way, no_doubles=body.no_doubles)
        return TranslateResponse(translations=[
            Translated(text=h[0].text, score=h[0].score, truncated=cut,
                       nbest=[{"text": t.text, "score": t.score} for t in h]
                       if body.nbest > 1 else None) for h, cut in found], timings=timings)

    _add_libretranslate_routes(router, service)
    return router


def _add_libretranslate_routes(router: APIRouter, service: Service) -> None:
    """POST /translate and GET /languages, as LibreTranslate answers them."""

    @router.post("/translate", responses=ERROR_RESPONSES, openapi_extra=LIBRE_BODY,
                 summary="LibreTranslate-compatible translation (JSON or form body)")
    async def libre_translate(request: Request) -> dict:
        body = await _libre_body(request)
        way = _libre_direction(service, body.source, body.target)
        texts = [body.q] if isinstance(body.q, str) else body.q
        found, _ = await _translate(service, texts, "q", max(4, body.alternatives + 1), 0.6,
                                    body.alternatives + 1, None, False, way, no_doubles=None)
        best = [h[0].text for h, _ in found]
        others = [[t.text for t in h[1:]] for h, _ in found]
        single = isinstance(body.q, str)
        answer: dict = {"translatedText": best[0] if single else best}
        if body.alternatives:
            answer["alternatives"] = others[0] if single else others
        if body.source == "auto":
            detected = {"confidence": 100.0, "language": (way.languages or
                                                         service.languages)[0]}
            answer["detectedLanguage"] = detected if single else [detected] * len(texts)
        return answer

    @router.get("/languages", summary="LibreTranslate-compatible list of languages")
    async def languages() -> list[dict]:
        codes = service.model.language_codes
        if codes:        # any to any, under the model's own codes
            return [{"code": code, "name": code, "targets": sorted(codes)}
                    for code in sorted(codes)]
        source, target = service.languages
        return [{"code": source, "name": LANGUAGE_NAMES.get(source, source),
                 "targets": [target]}]


async def _translate(service: Service, texts: list[str], name: str, beam: int, alpha: float,
                     nbest: int, max_length: int | None, truncate: bool, way: Direction, *,
                     no_doubles: bool | None
                     ) -> tuple[list[tuple[list[Translation], bool]], Timings]:
    """Check the texts against the limits, queue them, await -> [(hypotheses, truncated)]
    per text, and the timings. Texts join others of the same settings and languages.
    no_doubles None: the server's (Limits.no_doubles)."""
    translator: Translator = service.model
    if no_doubles is None:
        no_doubles = service.limits.no_doubles
    check_texts(texts, service.limits, name)
    limit = translator.max_source_tokens - 1 - len(way.source_prefix)
    lengths = [len(ids) for ids in translator.tokenizer.encode([t.strip() for t in texts])]
    cut = check_tokens(lengths, limit, name, truncate)
    search = (beam, float(alpha), nbest, max_length)
    key = ("translate", *search, way.languages, no_doubles)
    run = timed(lambda jobs: _run_translations(translator, key, service.limits.batch_tokens,
                                               jobs))
    tokens = sum(min(n, limit) + 1 + len(way.source_prefix) for n in lengths)
    found, timings = await service.submit(key, run, texts, tokens, len(texts),
                                          translation_stream(translator, *search,
                                                             service.decoder_processes,
                                                             languages=way.languages,
                                                             no_doubles=no_doubles))
    return list(zip(found, cut)), timings


def _run_translations(translator: Translator, key: tuple, batch_tokens: int,
                      jobs: Sequence[Job]) -> list[list[list[Translation]]]:
    """On the worker: every job's texts translated together -> per job, per text, its
    hypotheses."""
    _, beam, alpha, nbest, max_length, languages, no_doubles = key
    source, target = languages or (None, None)
    lines = [text for job in jobs for text in job.payload]
    return split_by_job(jobs, translator.translate_nbest(
        lines, nbest, beam=beam, alpha=alpha, max_length=max_length, batch_tokens=batch_tokens,
        source_lang=source, target_lang=target, no_doubles=no_doubles))


async def _libre_body(request: Request) -> LibreTranslateRequest:
    """LibreTranslate's clients send JSON or a form; both are read strictly."""
    raw = await request.body()
    kind = media_type(request)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the body is not valid UTF-8 (byte {error.start})") from None
    if kind == "application/x-www-form-urlencoded":
        try:
            data = _form(parse_qsl(text, keep_blank_values=True, errors="strict"))
        except UnicodeDecodeError:
            raise ApiError(400, "the form has a percent-encoded value that is not UTF-8") \
                from None
    elif is_json(kind):
        data = read_json(text) if text else {}
    else:
        raise ApiError(415, f"content-type {kind!r}: send application/json or "
                            f"application/x-www-form-urlencoded")
    try:
        return LibreTranslateRequest.model_validate(data)
    except ValidationError as error:
        raise validation_error(error.errors(), prefix=()) from None


def _form(pairs: list[tuple[str, str]]) -> dict:
    """Form fields -> the JSON body they stand for: q repeated is a list, alternatives an
    integer when it is written as one, any other field its last value."""
    data: dict = {}
    for name, value in pairs:
        if name == "q" and "q" in data:
            data["q"] = (data["q"] if isinstance(data["q"], list) else [data["q"]]) + [value]
        else:
            data[name] = value
    alternatives = data.get("alternatives")
    if isinstance(alternatives, str) and alternatives.isdecimal() and len(alternatives) < 19:
        data["alternatives"] = int(alternatives)     # longer: refused as it is written
    return data


def _libre_direction(service: Service, source: str, target: str) -> Direction:
    """LibreTranslate's pair: a multilingual model's codes (source "auto": the server's
    default pair's), else the model's own pair, with 400s as LibreTranslate answers."""
    translator: Translator = service.model
    if translator.language_codes:
        if source == "auto" and not service.languages:
            raise ApiError(400, "source: 'auto' is not offered (no language detection): "
                                "name one of the model's language codes", "source")
        try:
            return translator.direction(service.languages[0] if source == "auto" else source,
                                        target)
        except LanguageError as error:
            raise ApiError(400, f"{error.side}: {error}", error.side) from None
    _check_pair(service, source, target)
    return Direction()


def _check_pair(service: Service, source: str, target: str) -> None:
    model_source, model_target = service.languages
    if source not in ("auto", model_source):
        raise ApiError(400, f"source: {source!r} is not supported; this model translates "
                            f"{model_source} -> {model_target}", "source")
    if target != model_target:
        raise ApiError(400, f"target: {target!r} is not supported; this model translates "
                            f"{model_source} -> {model_target}", "target")


LIBRE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": LibreTranslateRequest.model_json_schema()},
    "application/x-www-form-urlencoded": {"schema": LibreTranslateRequest.model_json_schema()},
}}}
