"""/v1/rerank (and /v2/rerank): a cross-encoder's ranking of documents by relevance to
a query, in the shape of Cohere's and Jina's rerank APIs, for their clients and the
rerankers of LangChain and LlamaIndex built on them (pointed at this server's URL).

Each document is read in a pair with the query, [CLS] query [SEP] document [SEP]; a
pair longer than the model reads is cut as the tokenizers library cuts one, as
sentence-transformers' CrossEncoder cuts it (and as Cohere cuts long documents).
relevance_score is the sigmoid of the model's logit, in (0, 1), as Cohere, Jina and
text-embeddings-inference give it; results come the most relevant first. The pairs of
concurrent requests share batches.
"""

from __future__ import annotations

import secrets
from typing import Sequence

import numpy as np
from fastapi import APIRouter

from transduce.decode.encode import SentenceEncoder, ranked
from transduce.serve.batcher import Job
from transduce.serve.encoding import token_counts
from transduce.serve.limits import check_texts
from transduce.serve.schemas import RerankRequest, RerankResponse, RerankResult, RerankText, \
    RerankUsage
from transduce.serve.service import Service, split_by_job, timed
from transduce.serve.validation import ERROR_RESPONSES


def routes(service: Service) -> APIRouter:
    router = APIRouter()
    encoder: SentenceEncoder = service.model

    def score_jobs(jobs: Sequence[Job]) -> list[list[float]]:
        pairs = [pair for job in jobs for pair in job.payload]
        return split_by_job(jobs, encoder.score(
            [query for query, _ in pairs], pairs=[document for _, document in pairs],
            warn=False).tolist())

    @router.post("/v2/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES,
                 include_in_schema=False)
    @router.post("/v1/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES,
                 summary="Documents ranked by relevance to a query: Cohere's and Jina's "
                         "rerank")
    async def rerank(body: RerankRequest) -> RerankResponse:
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        check_texts([body.query], service.limits, "query", indexed=False)
        check_texts(documents, service.limits, "documents")
        tokens = _tokens(encoder, body.query, documents)
        scores, timings = await service.submit(
            ("rerank",), timed(score_jobs), [(body.query, d) for d in documents], tokens,
            len(documents))
        results = [RerankResult(index=r.index, relevance_score=r.relevance,
                                document=RerankText(text=documents[r.index])
                                if body.return_documents else None)
                   for r in ranked(np.asarray(scores), body.top_n)]
        return RerankResponse(id=secrets.token_hex(12), model=service.name, results=results,
                              usage=RerankUsage(total_tokens=tokens), timings=timings)

    return router


def _tokens(encoder: SentenceEncoder, query: str, documents: list[str]) -> int:
    """The tokens the model reads for the pairs: [CLS] query [SEP] document [SEP] each
    (RoBERTa's, a separator more), cut to its positions."""
    config = encoder.model.config
    markers = 3 + (config.type_vocab_size == 1)
    (asked,) = token_counts(encoder, [query])
    return sum(min(asked + length + markers, config.max_positions)
               for length in token_counts(encoder, documents))
