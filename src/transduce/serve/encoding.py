"""The routes of an encoder-only model: /v1/embed and, when it has a classification head,
/v1/classify, or /v1/tag for a token classifier, or /v1/answer for a question answerer
(OpenAI's /v1/embeddings: embeddings.py). Texts of concurrent requests with
the same settings share a call of the library, up to --batch-tokens, which runs them in
batches of its own size (SentenceEncoder.batch_tokens: small on a CPU)."""

from __future__ import annotations

from fastapi import APIRouter

from transduce.config import ConfigError
from transduce.decode.encode import Line, SentenceEncoder
from transduce.decode.tagging import entities
from transduce.serve.limits import ApiError, check_texts, check_tokens
from transduce.serve.schemas import AnswerRequest, AnswerResponse, ClassifyRequest, \
    ClassifyResponse, EmbedRequest, EmbedResponse, Entity, FoundAnswer, Prediction, \
    TaggedWord, TagRequest, TagResponse, Timings
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
        vectors, timings = await embedded(service, body.texts, tokens, normalize, pooling)
        return EmbedResponse(embeddings=vectors, dimensions=encoder.model.config.d_model,
                             pooling=pooling, normalized=normalize, truncated=cut,
                             timings=timings)

    if encoder.classifies:
        @router.post("/v1/classify", response_model=ClassifyResponse,
                     responses=ERROR_RESPONSES, summary="The most probable label of each text")
        async def classify(body: ClassifyRequest) -> ClassifyResponse:
            try:
                encoder.check_inputs(body.text_pairs is not None)
            except ConfigError as error:
                raise ApiError(422, f"text_pairs: {error}", "text_pairs") from None
            cut, tokens = _check(service, body.texts, body.truncate, body.text_pairs)
            pairs = body.text_pairs is not None
            payload = list(zip(body.texts, body.text_pairs or [None] * len(body.texts)))

            def classify_jobs(jobs):
                items = [item for job in jobs for item in job.payload]
                return split_by_job(jobs, encoder.classify(
                    [a for a, _ in items], pairs=[b for _, b in items] if pairs else None))

            found, timings = await service.submit(("classify", pairs), timed(classify_jobs),
                                                  payload, tokens, len(body.texts))
            return ClassifyResponse(predictions=[Prediction(**vars(p)) for p in found],
                                    truncated=cut, timings=timings)

    if encoder.tags:
        @router.post("/v1/tag", response_model=TagResponse, responses=ERROR_RESPONSES,
                     summary="Each word's tag, and the entities the BIO tags mark")
        async def tag(body: TagRequest) -> TagResponse:
            check_texts(body.texts, service.limits, "texts")
            room = encoder.model.config.max_positions - 2        # [CLS] chunk [SEP]
            tokens = sum(n + 2 * max(1, -(-n // room))
                         for n in token_counts(encoder, body.texts))
            run = timed(lambda jobs: split_by_job(jobs, encoder.tag(
                [text for job in jobs for text in job.payload])))
            found, timings = await service.submit(("tag",), run, list(body.texts), tokens,
                                                  len(body.texts))
            return TagResponse(
                words=[[TaggedWord(**vars(word)) for word in line] for line in found],
                entities=[[Entity(**vars(e)) for e in entities(
                    [w.word for w in line], [w.tag for w in line])] for line in found],
                timings=timings)

    if encoder.answers:
        @router.post("/v1/answer", response_model=AnswerResponse, responses=ERROR_RESPONSES,
                     summary="Each question's answer: a span of its context")
        async def answer(body: AnswerRequest) -> AnswerResponse:
            check_texts(body.questions, service.limits, "questions")
            check_texts(body.contexts, service.limits, "contexts")
            if len(body.contexts) != len(body.questions):
                raise ApiError(422, f"contexts: {len(body.contexts)} contexts for "
                                    f"{len(body.questions)} questions; give one for each",
                               "contexts")
            tokens = sum(token_counts(encoder, body.questions)) + \
                sum(token_counts(encoder, body.contexts))
            settings = (body.top_k, body.max_answer_tokens, body.no_answer)
            run = timed(lambda jobs: split_by_job(jobs, encoder.answer(
                [q for job in jobs for q, _ in job.payload],
                [c for job in jobs for _, c in job.payload], top_k=settings[0],
                max_answer_pieces=settings[1], no_answer=settings[2])))
            found, timings = await service.submit(("answer", *settings), run,
                                                  list(zip(body.questions, body.contexts)),
                                                  tokens, len(body.questions))
            return AnswerResponse(answers=[[FoundAnswer(**vars(a)) for a in answers]
                                           for answers in found], timings=timings)

    return router


async def embedded(service: Service, lines: list[Line], tokens: int, normalize: bool,
                   pooling: str) -> tuple[list[list[float]], Timings]:
    """The lines' vectors (texts, or PromptIds), from a job on the decoding worker that
    the lines of requests asking for the same pooling and normalisation share (from
    /v1/embed and /v1/embeddings alike), and its timings."""
    encoder: SentenceEncoder = service.model
    run = timed(lambda jobs: split_by_job(jobs, encoder.embed(
        [line for job in jobs for line in job.payload], normalize=normalize,
        pooling=pooling).tolist()))
    return await service.submit(("embed", normalize, pooling), run, lines, tokens,
                                len(lines))


def _check(service: Service, texts: list[str], truncate: bool,
           seconds: list[str] | None = None) -> tuple[list[bool], int]:
    """Limits and the model's length (its positions less the item's markers: [CLS] and
    [SEP], or a pair's three, RoBERTa's four) -> which texts (or pairs, with `seconds`)
    are cut, and the tokens the request adds to a batch."""
    encoder: SentenceEncoder = service.model
    config = encoder.model.config
    check_texts(texts, service.limits, "texts")
    lengths = token_counts(encoder, texts)
    if seconds is not None:
        if len(seconds) != len(texts):
            raise ApiError(422, f"text_pairs: {len(seconds)} second texts for {len(texts)} "
                                f"texts; give one for each", "text_pairs")
        check_texts(seconds, service.limits, "text_pairs")
        lengths = [a + b for a, b in zip(lengths, token_counts(encoder, seconds))]
    markers = item_markers(config, pairs=seconds is not None)
    limit = config.max_positions - markers
    return check_tokens(lengths, limit, "texts", truncate), sum(min(n, limit) + markers
                                                                for n in lengths)


def item_markers(config, *, pairs: bool) -> int:
    """The tokens an item adds to its texts': [CLS] and [SEP], or a pair's three
    (RoBERTa's four: <s> A </s></s> B </s>)."""
    return 3 + (config.type_vocab_size == 1) if pairs else 2


def token_counts(encoder: SentenceEncoder, texts: list[str]) -> list[int]:
    """Each text's tokens, without [CLS] and [SEP]."""
    return [len(ids) for ids in encoder.tokenizer.encode([t.strip() for t in texts])]

