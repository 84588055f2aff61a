"""The model and its loss as the loop steps them (train/objective.py): compiled, they
are one graph (no pause for the host: the loss projects every position and weighs
padding by zero) that computes the eager loss and gradients, for translation with
length-sorted batches (shapes dynamic) and packed rows (one shape), and for a language
model."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from transduce.config import preset
from transduce.data.masking import IGNORE
from transduce.data.packing import sentence_numbers
from transduce.model import build_model
from transduce.train.objective import SequenceObjective

VOCAB = 300


def padded(batch: int, length: int, generator: torch.Generator, pad_from: int) -> torch.Tensor:
    ids = torch.randint(4, VOCAB, (batch, length), generator=generator)
    ids[-1, pad_from:] = 0
    return ids


def sorted_batches():
    """(src, tgt_in, tgt_out, segments) of three shapes, padding on both sides."""
    generator = torch.Generator().manual_seed(0)
    for batch, source, target in [(6, 17, 9), (3, 20, 21), (4, 13, 13)]:
        tgt_out = padded(batch, target, generator, target - 3)
        yield (padded(batch, source, generator, source - 2),
               padded(batch, target, generator, target - 3), tgt_out, None)


def packed_batches():
    """Two batches of the same shape, different pairs in their rows."""
    generator = torch.Generator().manual_seed(1)
    for src_lengths, tgt_lengths in [([[5, 9], [16], [2, 3, 4]], [[7, 6], [12], [4, 4, 4]]),
                                     ([[16], [8, 8], [1]], [[3], [5, 9], [16]])]:
        segments = (sentence_numbers(src_lengths, 16), sentence_numbers(tgt_lengths, 16))
        tgt_out = torch.randint(4, VOCAB, (3, 16), generator=generator)
        tgt_out[segments[1] < 0] = 0
        src = torch.randint(4, VOCAB, (3, 16), generator=generator)
        src[segments[0] < 0] = 0
        yield src, torch.randint(4, VOCAB, (3, 16), generator=generator), tgt_out, segments


def ignored_batches():
    """A language model's batches whose targets not scored are IGNORE and whose pad is
    eos, a scored target (an imported GPT-2's or Llama's)."""
    for src, tgt_in, tgt_out, segments in sorted_batches():
        tgt_out = tgt_out.masked_fill(tgt_out == 0, IGNORE)
        tgt_out[0, 0] = 0      # token 0 scored like any other
        yield src, tgt_in, tgt_out, segments


CASES = {"translation": ("tiny", sorted_batches, True),
         "packed pairs": ("tiny", packed_batches, False),
         "language model": ("gpt-tiny", sorted_batches, True),
         "language model without pad": ("gpt-tiny", ignored_batches, True)}


# Each case in float32; under bfloat16 autocast, one encoder-decoder case (packed pairs)
# and one decoder-only (the other two add 24 s of compiling to what these two cover).
@pytest.mark.parametrize("case, autocast", [(case, False) for case in CASES]
                         + [("packed pairs", True), ("language model", True)])
def test_the_compiled_objective_is_one_graph_and_computes_the_eager_loss(case, autocast):
    name, batches, dynamic = CASES[case]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(preset(name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                               dropout=0.0)).train()
    objective = SequenceObjective(model, name == "gpt-tiny", label_smoothing=0.1,
                                  pad_id=None if "without pad" in case else 0)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(objective, dynamic=dynamic, fullgraph=True, backend=counter)
    parameters = list(model.parameters())
    for batch in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            want = objective(*batch)
            got = compiled(*batch)
        want_grads = torch.autograd.grad(want, parameters)
        got_grads = torch.autograd.grad(got, parameters)
        tolerance = 1e-2 if autocast else 1e-5
        assert got.item() == pytest.approx(want.item(), rel=tolerance)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=0, atol=tolerance * w.abs().max().item())
    # One graph for every batch, whatever its shape (Dynamo also records an empty one).
    assert sum(1 for graph in counter.graphs if len(graph.graph.nodes)) == 1
