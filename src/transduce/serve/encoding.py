"""The routes of an encoder-only model: /v1/embed and, when it has a classification head,
/v1/classify. Texts of concurrent requests with the same settings share batches."""

from __future__ import annotations

from fastapi import APIRouter

from transduce.decode.encode import SentenceEncoder
from transduce.serve.limits import ApiError, check_texts, check_tokens
from transduce.serve.schemas import ClassifyRequest, ClassifyResponse, EmbedRequest, \
    EmbedResponse, Prediction
from transduce.serve.service import Service, split_by_job, timed
from transduce.serve.validation import ERROR_RESPONSES


def routes(service: Service) -> APIRouter:
    router = APIRouter()
    encoder: SentenceEncoder = service.model

    @router.post("/v1/embed", response_model=EmbedResponse, responses=ERROR_RESPONSES,
                 summary="Sentence embeddings: the last hidden states pooled (mean or "
                         "[CLS])")
    async def embed(body: EmbedRequest) -> EmbedResponse:
        cut, tokens = _check(service, body.texts, body.truncate)
        defaults = encoder.embedding_defaults
        pooling = defaults["pooling"] if body.pooling is None else body.pooling
        normalize = defaults["normalize"] if body.normalize is None else body.normalize
        key = ("embed", normalize, pooling)
        run = timed(lambda jobs: split_by_job(jobs, encoder.embed(
            [t for job in jobs for t in job.payload], normalize=normalize, pooling=pooling,
            batch_tokens=service.limits.batch_tokens).tolist()))
        vectors, timings = await service.submit(key, run, body.texts, tokens, len(body.texts))
        return EmbedResponse(embeddings=vectors, dimensions=encoder.model.config.d_model,
                             pooling=pooling, normalized=normalize, truncated=cut,
                             timings=timings)

    if encoder.classifies:
        @router.post("/v1/classify", response_model=ClassifyResponse,
                     responses=ERROR_RESPONSES, summary="The most probable label of each text")
        async def classify(body: ClassifyRequest) -> ClassifyResponse:
            if body.text_pairs is None:
                cut, tokens = _check(service, body.texts, body.truncate)
                payload = [(text, None) for text in body.texts]
            else:
                cut, tokens = _check_pairs(service, body.texts, body.text_pairs,
                                           body.truncate)
                payload = list(zip(body.texts, body.text_pairs))
            pairs = body.text_pairs is not None

            def classify_jobs(jobs):
                items = [item for job in jobs for item in job.payload]
                return split_by_job(jobs, encoder.classify(
                    [a for a, _ in items], pairs=[b for _, b in items] if pairs else None,
                    batch_tokens=service.limits.batch_tokens))

            found, timings = await service.submit(("classify", pairs), timed(classify_jobs),
                                                  payload, tokens, len(body.texts))
            return ClassifyResponse(predictions=[Prediction(**vars(p)) for p in found],
                                    truncated=cut, timings=timings)

    return router


def _check(service: Service, texts: list[str], truncate: bool) -> tuple[list[bool], int]:
    """Limits and the model's length (its positions less [CLS] and [SEP]) -> which texts
    are cut, and the tokens the request adds to a batch."""
    encoder: SentenceEncoder = service.model
    check_texts(texts, service.limits, "texts")
    limit = encoder.model.config.max_positions - 2
    lengths = [len(ids) for ids in encoder.tokenizer.encode([t.strip() for t in texts])]
    return check_tokens(lengths, limit, "texts", truncate), sum(min(n, limit) + 2
                                                                for n in lengths)


def _check_pairs(service: Service, texts: list[str], seconds: list[str],
                 truncate: bool) -> tuple[list[bool], int]:
    """_check for pairs: each text with its second text, both within the limits, and
    together within the model's positions less the pair's markers."""
    encoder: SentenceEncoder = service.model
    if len(seconds) != len(texts):
        raise ApiError(422, f"text_pairs: {len(seconds)} second texts for {len(texts)} texts; "
                            f"give one for each", "text_pairs")
    check_texts(texts, service.limits, "texts")
    check_texts(seconds, service.limits, "text_pairs")
    one_segment = encoder.model.config.type_vocab_size == 1   # <s> A </s></s> B </s>
    limit = encoder.model.config.max_positions - 3 - one_segment
    encode = encoder.tokenizer.encode
    pairs = zip(encode([t.strip() for t in texts]), encode([t.strip() for t in seconds]))
    lengths = [len(a) + len(b) for a, b in pairs]
    cut = check_tokens(lengths, limit, "texts", truncate)
    return cut, sum(min(n, limit) + 3 + one_segment for n in lengths)

