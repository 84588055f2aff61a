"""torch.compile captures the training forward and backward whole: no graph breaks, with
dynamic shapes, for every attention impl that runs on the CPU. A break splits the
compiled step into pieces with Python between them and costs most of what compiling
gains: on an H100, one in SDPA's causal flag (a symbolic bool under dynamic shapes)
made the compiled base model train slower than the uncompiled one.

The graphs are captured with the "eager" backend: the same tracing as Inductor, without
generating kernels, so the test is quick."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from transduce.attention.local import sliding_window_attention
from transduce.attention.sparse import Pattern, pattern_attention
from transduce.config import preset
from transduce.data.packing import sentence_numbers
from transduce.model import build_model

# (batch, source length, target length): equal lengths (SDPA's own causal flag), unequal
# ones, and a new batch size. Dynamo's duck sizing gives the first batch a graph of its
# own (one symbol for both lengths); the next two share the second.
SHAPES = [(4, 13, 13), (6, 17, 9), (3, 20, 21)]


def batches(vocab: int):
    generator = torch.Generator().manual_seed(0)
    for batch, source, target in SHAPES:
        src = torch.randint(4, vocab, (batch, source), generator=generator)
        tgt = torch.randint(4, vocab, (batch, target), generator=generator)
        src[0, -3:] = 0   # padding on both sides
        tgt[1, -2:] = 0
        yield src, tgt


def forward(model, arch: str, src, tgt):
    return model(tgt, project=False) if arch == "decoder" else model(src, tgt, project=False)


@pytest.mark.parametrize("arch,impl", [("transformer", "sdpa"), ("transformer", "naive"),
                                       ("transformer", "flash"), ("decoder", "sdpa")])
def test_the_training_step_compiles_to_one_graph_and_computes_the_same(arch, impl):
    config = preset("gpt-tiny" if arch == "decoder" else "tiny", src_vocab_size=300,
                    tgt_vocab_size=300, attention_impl=impl, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(config).train()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend=counter)
    graphs = []
    for src, tgt in batches(300):
        expected = forward(model, arch, src, tgt)
        expected_grads = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
        got = forward(compiled, arch, src, tgt)
        got_grads = torch.autograd.grad(got.square().sum(), list(model.parameters()))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        graphs.append(counter.frame_count)
    # A length the graphs were not traced at takes no graph of its own (a kernel that
    # loops over range(0, T, block) fixes T, and each new length compiled again).
    assert graphs[-1] == graphs[-2] <= 2


def test_dropout_compiles_without_a_break():
    """Training with dropout on: the CPU's own dropout draw (model/dropout.py) gives way
    to torch's inside a compiled graph, which fuses it."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", src_vocab_size=300, tgt_vocab_size=300)).train()
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend="eager")
    for src, tgt in batches(300):
        compiled(src, tgt, project=False).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_packed_rows_compile_to_one_graph_and_compute_the_same():
    """Packed pairs (attention/masks.py Segments, positions counted per sentence), as
    `transduce train --pack-length --compile` steps them: one graph, the same numbers."""
    config = preset("tiny", src_vocab_size=300, tgt_vocab_size=300, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(config).train()
    compiled = torch.compile(model, dynamic=False, fullgraph=True, backend="eager")
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, 300, (3, 16), generator=generator)
    tgt = torch.randint(4, 300, (3, 16), generator=generator)
    segments = (sentence_numbers([[5, 9], [16], [2, 3, 4]], 16),
                sentence_numbers([[7, 6], [12], [4, 4, 4]], 16))
    expected = model(src, tgt, project=False, segments=segments)
    got = compiled(src, tgt, project=False, segments=segments)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_causal_linear_attention_compiles_once_for_lengths_within_a_chunk():
    """Causal linear attention walks its queries a chunk (64) at a time: lengths that
    fit one chunk share one graph, as a decoder's batches of new lengths need."""
    config = preset("gpt-tiny", src_vocab_size=300, tgt_vocab_size=300,
                    attention_type="linear", dropout=0.0)
    torch.manual_seed(0)
    model = build_model(config).train()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend=counter)
    for _, _, target in SHAPES:
        tgt = torch.randint(4, 300, (2, target), generator=torch.Generator().manual_seed(target))
        torch.testing.assert_close(compiled(tgt, project=False), model(tgt, project=False),
                                   rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


WINDOWED = {"sliding": lambda q, k, v, keys: sliding_window_attention(q, k, v, keys, 16,
                                                                     causal=True),
            "strided": lambda q, k, v, keys: pattern_attention(
                q, k, v, keys, Pattern(16, stride=16), causal=True)}


@pytest.mark.parametrize("kind", WINDOWED)
def test_windowed_attention_compiles_within_one_block_and_over_two(kind):
    """Length 11, one block of the 16-key window (Dynamo folds the block count into the
    head count, which then compare as symbols), and 20, two blocks and one strided key;
    four query heads on two key/value heads: no break, the eager numbers."""
    def attend(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        q = x.unflatten(2, (4, 16)).transpose(1, 2)                        # (B, 4, T, 16)
        k = x[..., :32].unflatten(2, (2, 16)).transpose(1, 2)              # (B, 2, T, 16)
        return WINDOWED[kind](q, k, k.flip(-1), keys)

    compiled = torch.compile(attend, dynamic=True, fullgraph=True, backend="eager")
    generator = torch.Generator().manual_seed(0)
    for batch, length in [(3, 11), (2, 20)]:
        x = torch.randn(batch, length, 64, generator=generator)
        keys = torch.ones(batch, length, dtype=torch.bool)
        keys[0, -3:] = False
        torch.testing.assert_close(compiled(x, keys), attend(x, keys))
