"""The CUDA paths: kernels, training and decoding on a GPU agree with the CPU.

Skipped without a GPU. On a machine with one, `python -m pytest` runs these and the rest
of the suite on CUDA where the code picks the GPU by itself (the training loop does).
"""

import json

import pytest
import torch

from tests.attention.reference import reference_attention
from tests.attention.test_kernels import grads, make_mask
from tests.train.test_objective import VOCAB, packed_batches
from transduce.attention import attention
from transduce.config import TrainConfig, preset
from transduce.data.tokenizer import Tokenizer
from transduce.decode.generate import Generator
from transduce.decode.translate import Translator
from transduce.model import build_model, load_model
from transduce.train import prefetch
from transduce.train.loop import train
from transduce.train.objective import SequenceObjective

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
IMPLS = ["naive", "sdpa", "flash"]  # triton on CUDA: tests/attention/test_triton.py


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_kernels_on_cuda_match_the_float64_reference(impl, causal):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 37, 32, device="cuda", requires_grad=True)
    k = torch.randn(2, 2, 45, 32, device="cuda", requires_grad=True)
    v = torch.randn(2, 2, 45, 32, device="cuda", requires_grad=True)
    mask = make_mask("holes", 2, 4, 37, 45).cuda()
    with _no_tf32():
        out = attention(q, k, v, mask, causal=causal, impl=impl)
        got = grads(out, (q, k, v))
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    expected, _ = reference_attention(q64, k64, v64, mask.cpu(), causal)
    torch.testing.assert_close(out.detach().cpu().double(), expected, rtol=0, atol=1e-4)
    for g, want in zip(got, grads(expected, (q64, k64, v64))):
        torch.testing.assert_close(g.cpu().double(), want, rtol=0, atol=5e-4)


@pytest.mark.parametrize("impl", [*IMPLS, "triton"])
def test_bfloat16_kernels_on_cuda_are_close_to_the_reference(impl):
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 8, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = attention(q, k, v, causal=True, impl=impl)
    expected, _ = reference_attention(q.cpu(), k.cpu(), v.cpu(), causal=True)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=0, atol=2e-2)


def test_training_on_cuda_in_bfloat16_learns(tiny_corpus, tmp_path):
    config = preset("tiny", src_vocab_size=300, tgt_vocab_size=300, attention_impl="triton")
    out = tmp_path / "run"
    run = train(tiny_corpus, out, config,
                TrainConfig(max_tokens=400, warmup_steps=10, max_steps=60, log_every=20,
                            eval_every=1000, save_every=1000, dtype="bfloat16"))
    records = [json.loads(line) for line in (out / "log.jsonl").open()]
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert next(load_model(run).parameters()).device.type == "cpu"  # checkpoints load anywhere


def test_training_with_cuda_graphs_logs_the_compiled_runs_losses(tiny_corpus, tmp_path):
    """`transduce train --compile --pack-length L --cuda-graphs` against the same run
    compiled without the graphs: the graphs replay the same kernels, so the same losses
    step by step (dropout off: the graphs draw their random numbers their own way)."""
    config = preset("tiny", src_vocab_size=300, tgt_vocab_size=300, dropout=0.0)

    def losses(name: str, graphs: bool) -> list[float]:
        train(tiny_corpus, tmp_path / name, config,
              TrainConfig(max_tokens=512, pack_length=64, warmup_steps=10, max_steps=8,
                          log_every=1, eval_every=1000, save_every=1000, dtype="bfloat16",
                          compile=True, cuda_graphs=graphs))
        return [json.loads(line)["loss"] for line in (tmp_path / name / "log.jsonl").open()
                if json.loads(line)["event"] == "train"]

    with _no_tf32():
        want, got = losses("compiled", False), losses("graphed", True)
    assert len(got) == 8 and got == pytest.approx(want, rel=1e-3)


def test_training_batches_reach_the_gpu_from_pinned_memory(tiny_corpus, tmp_path, monkeypatch):
    """Each batch is copied from page-locked memory (no wait for the queued kernels),
    unchanged: three steps, and the fourth step's batch prepared."""
    pinned_copies, pinned = [], prefetch.pinned

    def recorded(batch):
        moved = pinned(batch)
        pinned_copies.append(all(t.is_pinned() for t in (moved.src, moved.tgt_in, moved.tgt_out,
                                                         moved.tgt_lengths))
                             and torch.equal(moved.tgt_out, batch.tgt_out))
        return moved

    monkeypatch.setattr(prefetch, "pinned", recorded)
    train(tiny_corpus, tmp_path / "run", preset("tiny", src_vocab_size=300, tgt_vocab_size=300),
          TrainConfig(max_tokens=400, max_steps=3, eval_every=1000, save_every=1000))
    assert pinned_copies == [True] * 4


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("impl", ["sdpa", "triton"])
def test_the_compiled_packed_objective_steps_like_the_eager_one(mode, impl):
    """The model and its loss compiled as one graph over packed rows of one shape
    (`transduce train --compile --pack-length`), and the same replayed as CUDA graphs
    (reduce-overhead; bench/train_cuda.py's "... packed graphed"): the eager losses
    through four Adam steps, and the eager gradients in the first. (Not the weights:
    Adam turns the rounding noise of gradients that are zero in exact arithmetic, such
    as the key projection's bias, into steps of the full learning rate.) impl "triton":
    attention and the post-norm sub-layers' ends as Triton kernels in the graphs."""
    def trained(compile_mode: str | None) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = build_model(preset("tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                                   dropout=0.0, attention_impl=impl)).cuda().train()
        objective = SequenceObjective(model, language_model=False, label_smoothing=0.1)
        net = objective if compile_mode is None else \
            torch.compile(objective, dynamic=False, mode=compile_mode)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        losses, first_grads = [], []
        for batch in [*packed_batches()] * 2:
            if compile_mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            loss = net(*(None if t is None else
                         tuple(x.cuda() for x in t) if isinstance(t, tuple) else t.cuda()
                         for t in batch))
            loss.backward()
            losses.append(loss.item())
            first_grads = first_grads or [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return losses, first_grads

    with _no_tf32():
        want_losses, want_grads = trained(None)
        got_losses, got_grads = trained(mode)
    assert got_losses == pytest.approx(want_losses, rel=1e-4)
    for got, want in zip(got_grads, want_grads):   # (the floor: rounding noise, as above)
        torch.testing.assert_close(got, want, rtol=0,
                                   atol=max(1e-4 * want.abs().max().item(), 1e-6))


def test_decoding_on_cuda_equals_decoding_on_the_cpu(tiny_corpus):
    torch.manual_seed(0)
    tokenizer = Tokenizer(tiny_corpus / "spm.model")
    vocab = tokenizer.vocab_size
    model = build_model(preset("tiny", src_vocab_size=vocab, tgt_vocab_size=vocab)).eval()
    lines = ["uno dos", "el perro grande come", "casa"]
    with _no_tf32():
        on_cpu = Translator(model, tokenizer).translate(lines, beam=4)
        on_gpu = Translator(model, tokenizer, device="cuda").translate(lines, beam=4)
    assert on_gpu == on_cpu

    lm = build_model(preset("gpt-tiny", src_vocab_size=vocab, tgt_vocab_size=vocab,
                            max_positions=64)).eval()
    with _no_tf32():
        on_cpu = Generator(lm, tokenizer).generate(lines, max_new_tokens=10)
        on_gpu = Generator(lm, tokenizer, device="cuda").generate(lines, max_new_tokens=10)
        cached = Generator(lm, tokenizer, device="cuda", kv_dtype="int8").generate(
            lines, max_new_tokens=10)
    assert on_gpu == on_cpu and len(cached) == 3


class _no_tf32:
    """float32 products in full precision while comparing with the CPU."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved
