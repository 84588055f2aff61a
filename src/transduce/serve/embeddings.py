"""/v1/embeddings: an encoder-only model's sentence embeddings in the shape of OpenAI's
embeddings API, so that its client, and the libraries built on it (LangChain's
OpenAIEmbeddings, LlamaIndex, vector databases' loaders), embed with the served model.

Each input is embedded as /v1/embed embeds it by default, pooled and normalised as the
checkpoint records (an imported sentence-transformers model's way), in the same
batches. An input is a text, read as [CLS] text [SEP], or token ids of the model's own
vocabulary, read as they are (a client that tokenized with another model's tokenizer,
as LangChain does unless told not to, sends ids this model would misread: send texts).
An input longer than the model reads is refused (413), as OpenAI refuses one; /v1/embed
can cut it instead. encoding_format "base64" (what OpenAI's client asks for) gives each
vector's float32 values, little-endian, in base64: the same numbers, a third of the
bytes.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter

from transduce.decode.encode import Line, SentenceEncoder
from transduce.decode.inputs import PromptIds, ids_problem
from transduce.serve.encoding import embedded
from transduce.serve.limits import ApiError, check_texts
from transduce.serve.schemas import Embedding, EmbeddingsRequest, EmbeddingsResponse, \
    EmbeddingsUsage
from transduce.serve.service import Service
from transduce.serve.validation import OPENAI_ERROR_RESPONSES


def routes(service: Service) -> APIRouter:
    router = APIRouter()
    encoder: SentenceEncoder = service.model

    @router.post("/v1/embeddings", response_model=EmbeddingsResponse,
                 responses=OPENAI_ERROR_RESPONSES,
                 summary="Sentence embeddings in the shape of OpenAI's embeddings API")
    async def embeddings(body: EmbeddingsRequest) -> EmbeddingsResponse:
        width = encoder.model.config.d_model
        if body.dimensions is not None and body.dimensions != width:
            raise ApiError(422, f"dimensions: {body.dimensions}, but this model's embeddings "
                                f"have {width}, and it was not trained for shorter ones "
                                f"(leave dimensions out)", "dimensions")
        items = _read(service, body)
        defaults = encoder.embedding_defaults
        tokens = sum(map(len, items))
        vectors, timings = await embedded(service, items, tokens, defaults["normalize"],
                                          defaults["pooling"])
        return EmbeddingsResponse(
            data=[Embedding(index=i, embedding=_encoded(vector, body.encoding_format))
                  for i, vector in enumerate(vectors)],
            model=service.name, usage=EmbeddingsUsage(prompt_tokens=tokens,
                                                      total_tokens=tokens),
            timings=timings)

    return router


def _read(service: Service, body: EmbeddingsRequest) -> list[PromptIds]:
    """The request's inputs as the ids the model reads (a text's with its [CLS] and
    [SEP]); too many, too long a text or more tokens than the model reads is 413, ids
    the model lacks 422, naming the input."""
    encoder: SentenceEncoder = service.model
    config = encoder.model.config
    given = body.input
    single = isinstance(given, str) or isinstance(given[0], int)
    inputs: list[Line] = [given] if single else list(given)
    name = (lambda index: "input") if single else (lambda index: f"input[{index}]")
    if len(inputs) > service.limits.max_texts:
        raise ApiError(413, f"input: {len(inputs)} inputs, more than the limit of "
                            f"{service.limits.max_texts} per request (max_texts)", "input")
    if isinstance(inputs[0], str):     # the shapes do not mix: texts, or ids
        check_texts(inputs, service.limits, "input", indexed=not single)
        items = [PromptIds(ids) for ids in encoder.item_ids(inputs)]
    else:
        items = [PromptIds(ids) for ids in inputs]
        for index, ids in enumerate(items):
            problem = ids_problem(ids, config.src_vocab_size)
            if problem:
                raise ApiError(422, f"{name(index)}: {problem}", name(index))
    for index, ids in enumerate(items):
        if len(ids) > config.max_positions:
            raise ApiError(413, f"{name(index)}: {len(ids)} tokens, more than the "
                                f"{config.max_positions} positions the model reads "
                                f"(a text's [CLS] and [SEP] counted)", name(index))
    return items


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the client asked: its numbers, or its float32 values (which they are)
    little-endian in base64."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
