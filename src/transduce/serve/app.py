"""The HTTP app: the routes the loaded model's kind calls for, around one decoding worker.

    app = create_app(transduce.load("runs/small/ema"), name="small")
    uvicorn.run(app)                   # or `transduce serve --model runs/small/ema`

Every kind gets GET /health, /v1/models, /metrics, the page at / and the OpenAPI
document at /openapi.json (rendered at /docs, with a script the server serves itself:
docs.py), and a PyTorch model /v1/attention (its maps). A translation model adds
/v1/translate, /translate and /languages (LibreTranslate's); a language model
/v1/generate, /v1/completions and /v1/chat/completions (OpenAI's); an encoder-only model
/v1/embed, /v1/embeddings (OpenAI's) and, with a classification head, /v1/classify, with
a head of one output (a cross-encoder) /v1/rerank, with a token classifier /v1/tag, or
with a question answerer /v1/answer. The worker starts and stops with the app's
lifespan: on shutdown the queue is closed to new work and what is queued is decoded
before the worker stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any, Callable

import torch
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from transduce.attention import one_query
from transduce.data.tool_calls import call_format
from transduce.decode import continuous_generation
from transduce.decode.encode import SentenceEncoder
from transduce.decode.generate import Generator
from transduce.decode.translate import Translator
from transduce.serve import attention, chat, completions, docs, embeddings, encoding, \
    generation, page, rerank, translation
from transduce.serve.batcher import Batcher
from transduce.serve.continuous import decodes_in_streams
from transduce.serve.limits import Limits
from transduce.serve.metrics import Metrics
from transduce.serve.middleware import BodyLimitMiddleware, MetricsMiddleware
from transduce.serve.processes import DecoderProcess, start_processes
from transduce.serve.service import Service
from transduce.serve.validation import install_error_handlers

JSON_OVERHEAD_BYTES = 64 * 1024
BYTES_PER_CHARACTER = 12    # the most one character takes in a body: a character beyond
                            # the BMP is two \uXXXX escapes in JSON, %XX x 4 in a form
DRAIN_TIMEOUT_S = 600.0


def model_kind(model) -> str:
    """ "translation", "generation" or "encoder", by the object transduce.load gave."""
    for kind, cls in (("translation", Translator), ("generation", Generator),
                      ("encoder", SentenceEncoder)):
        if isinstance(model, cls):
            return kind
    raise TypeError(f"cannot serve a {type(model).__name__}: expected what transduce.load "
                    f"returns (Translator, Generator or SentenceEncoder)")


def create_app(model, *, name: str = "model", limits: Limits | None = None,
               languages: tuple[str, str] | None = None,
               reload: Callable[[], Any] | None = None) -> FastAPI:
    """An ASGI app serving `model`; languages (source, target) name a translation
    model's pair for LibreTranslate's clients (default: the pair its checkpoint records,
    else es -> en, the built-in corpus's), and a multilingual model's default pair (two
    of its codes: a ConfigError otherwise). reload() -> a copy of `model`, loaded the
    same way: with limits.decoders above one, the decoders after the first then decode
    their continuous translations in processes of their own that call it (processes.py:
    it must pickle); without it, every decoder is a thread of this process."""
    limits = limits or Limits()
    kind = model_kind(model)
    multilingual = kind == "translation" and bool(model.language_codes)
    if multilingual and languages:
        model.direction(*languages)            # two of its codes, or refused by name
    languages = languages or getattr(model.model, "languages", None) or \
        (None if multilingual else ("es", "en"))
    metrics = Metrics()
    batcher = Batcher(metrics, batch_tokens=limits.batch_tokens,
                      window_s=limits.window_ms / 1000, max_queue=limits.max_queue,
                      batching=limits.batching, continuous=limits.continuous,
                      others_coming=lambda: metrics.in_flight > metrics.queue_depth,
                      decoders=limits.decoders,
                      cores=torch.get_num_threads() if limits.decoders > 1 else None)
    processes = decoder_processes(model, limits, reload)
    service = Service(model, name, limits, metrics, batcher,
                      languages if kind == "translation" else None, processes)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if decodes_in_streams(model, limits):
            # The continuous search's kernel: built here on a machine's first start
            # (about 20 s, then cached), not in the first requests' step, and before the
            # decoder processes, which then load it.
            await asyncio.to_thread(one_query.available)
        await asyncio.to_thread(start_processes, processes.values())
        batcher.start()
        try:
            yield
        finally:
            batcher.close(DRAIN_TIMEOUT_S)
            for process in processes.values():
                process.close()

    app = FastAPI(title="transduce serve", version="1", lifespan=lifespan,
                  description=f"A {kind} model ({name}) behind a batching decoder.",
                  docs_url=None, redoc_url=None)          # docs.routes: no CDN
    app.state.service = service
    app.state.summary = summary(service, kind)         # the server logs it as it starts
    install_error_handlers(app)
    router = {"translation": translation.routes, "generation": generation.routes,
              "encoder": encoding.routes}[kind](service)
    app.include_router(router)
    app.include_router(attention.routes(service, kind))    # where the model records maps
    if kind == "generation":
        app.include_router(chat.routes(service))        # an instruct model's conversations
        app.include_router(completions.routes(service))   # OpenAI's clients, harnesses
    if kind == "encoder":
        app.include_router(embeddings.routes(service))    # OpenAI's clients
    if kind == "encoder" and model.scores:
        app.include_router(rerank.routes(service))        # a cross-encoder: Cohere's, Jina's
    app.include_router(_common_routes(service, kind))
    app.include_router(page.routes(kind))
    app.include_router(docs.routes(app.title, app.openapi_url))
    app.add_middleware(BodyLimitMiddleware,
                       max_bytes=limits.max_texts * limits.max_chars * BYTES_PER_CHARACTER
                       + JSON_OVERHEAD_BYTES)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def decoder_processes(model, limits: Limits, reload: Callable[[], Any] | None
                      ) -> dict[int, DecoderProcess]:
    """By decoder rank, the processes that decode continuous translations, where there
    are several decoders and a way to load the model again: every decoder but the first,
    which decodes in the server's process, where light load stays (a process's decoding
    team, woken with each step's report by the server, served one client 0.92x as fast
    in one measurement, alike in a later one; every decoder in a process ran 1.035x at
    32 clients there, within the spread). Else none: all decode in threads."""
    if reload is None or not decodes_in_streams(model, limits):
        return {}
    return {rank: DecoderProcess(reload, rank) for rank in range(1, limits.decoders)}


def _common_routes(service: Service, kind: str):
    from fastapi import APIRouter

    router = APIRouter()

    @router.head("/health", include_in_schema=False)     # load balancers' probes
    @router.get("/health", summary="Liveness, the model's kind and the queue's depth")
    async def health() -> dict:
        return {"status": "ok", "kind": kind, "model": service.name,
                "queue_depth": service.metrics.queue_depth}

    @router.get("/v1/models", summary="The loaded model: kind, languages, config, size")
    async def models() -> dict:
        return {"data": [describe(service, kind)]}

    @router.get("/metrics", response_class=PlainTextResponse,
                summary="Prometheus text format: requests, latency, batches, queue")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


def summary(service: Service, kind: str) -> str:
    """One line of what is served and how: the model, its type, the batching."""
    model, limits = service.model, service.limits
    network = model.model
    size = f", {network.num_parameters():,} parameters" \
        if hasattr(network, "num_parameters") else ""
    how = f"decoding in {model.dtype}" if engine(model) == "torch" else \
        "through ONNX Runtime"
    cache = kv_dtype(model) if kind != "encoder" else None
    if cache is not None:
        how += f" with {cache} KV caches"
    if not limits.batching:
        batching = "no batching"
    elif kind == "encoder" or not limits.continuous or not continuous_capable(model):
        batching = "dynamic batching"
    else:
        batching = "continuous batching"
    if limits.decoders > 1 and decodes_in_streams(model, limits):
        batching += f", {limits.decoders} decoders"
    doubles = "; no_doubles unless a request says otherwise" if limits.no_doubles else ""
    return f"Serving {service.name}: a {kind} model{size}, {how}; {batching}{doubles}"


def engine(model) -> str:
    """What runs the model: "torch", or "onnxruntime" for an ONNX export."""
    return "torch" if isinstance(model.model, torch.nn.Module) else "onnxruntime"


def kv_dtype(model) -> str | None:
    """A decoding model's KV-cache type where it is not its decoding type's."""
    if isinstance(model, Translator):
        return model.kv_dtype
    return None if model.cache_dtype is None else str(model.cache_dtype).split(".")[-1]


def continuous_capable(model) -> bool:
    """Whether a translation or language model decodes continuously here (greedy and
    sampled generation; every beam search of a translation model)."""
    if isinstance(model, Translator):
        return model.decodes_continuously
    return continuous_generation.supports(model)


def describe(service: Service, kind: str) -> dict:
    """What /v1/models says of the model."""
    model = service.model
    network = model.model
    config = network.config
    parameters = network.num_parameters() if hasattr(network, "num_parameters") else None
    tokenizer = model.tokenizer
    info = {"id": service.name, "kind": kind, "config": dataclasses.asdict(config),
            "parameters": parameters,
            "vocabulary": {"size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
                           "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id},
            "limits": dataclasses.asdict(service.limits),
            "engine": engine(model), "dtype": model.dtype,
            "attention_maps": attention.serves_attention_maps(model)}   # /v1/attention
    if kind != "encoder":
        info["kv_dtype"] = kv_dtype(model)
    if getattr(tokenizer, "separate", False):     # a target vocabulary of its own
        info["vocabulary"]["target_size"] = tokenizer.target_tokenizer.vocab_size
    if kind == "translation":
        info["languages"] = dict(zip(("source", "target"), service.languages)) \
            if service.languages else None
        codes = getattr(model.model, "language_codes", None)
        if codes:
            info["language_codes"] = sorted(codes)
    if kind == "generation":     # whether /v1/chat/completions answers, and takes tools
        template = getattr(tokenizer, "chat_template", None)
        info["chat"] = template is not None
        form = None if template is None else call_format(template.template)
        info["tool_calls"] = None if form is None else form.name   # how calls are read
    if kind == "encoder":
        info["labels"] = model.labels
        info["classifier_inputs"] = model.classifier_inputs   # "pairs": send text_pairs
        info["sentence_embedding"] = model.embedding_defaults   # what /v1/embed does unasked
        info["classifies"] = model.classifies            # /v1/classify
        info["tags"] = model.tags                        # a token classifier: /v1/tag
        info["answers"] = model.answers                  # a question answerer: /v1/answer
        info["reranks"] = model.scores                   # a cross-encoder: /v1/rerank
    return info
