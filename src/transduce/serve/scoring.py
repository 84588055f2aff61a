"""Scores of token sequences (each token's log-probability and the likeliest tokens in
its place: decode/token_logprobs.py), computed by a job on the decoding worker, after
the generation that made them, so that the model runs on its one thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from transduce.decode.generate import Generator
from transduce.decode.token_logprobs import TokenLogprobs
from transduce.serve.batcher import Job
from transduce.serve.schemas import Timings
from transduce.serve.service import Service, split_by_job, timed


@dataclass
class Scoring:
    """A logprobs job's payload: the sequences to score, and how many of the likeliest
    tokens to give in each place."""

    sequences: list[list[int]]
    top: int

    def __len__(self) -> int:
        return len(self.sequences)


async def scored(service: Service, sequences: list[list[int]], top: int
                 ) -> tuple[list[TokenLogprobs], Timings]:
    """The sequences' scores, from a job on the decoding worker (jobs asking for the same
    `top` share its batches), and its timings."""
    generator: Generator = service.model

    def run(jobs: Sequence[Job]) -> list[list]:
        every = [s for job in jobs for s in job.payload.sequences]
        return split_by_job(jobs, generator.token_logprobs(every, jobs[0].payload.top))

    job = service.enqueue(("logprobs", top), timed(run), Scoring(sequences, top),
                          sum(map(len, sequences)), len(sequences))
    return await service.wait(job)
