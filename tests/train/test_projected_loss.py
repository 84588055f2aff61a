"""The output projection fused with the label-smoothed loss, against the plain form:
logits, then log-softmax and smoothing, all in float64; both ways of leaving padding
out (its rows selected away, or every row projected and padding weighed by zero, as
a compiled graph does)."""

import pytest
import torch

from transduce.data.masking import IGNORE
from transduce.model.transformer import NEVER_OUTPUT
from transduce.train.loss import label_smoothed_nll, projected_label_smoothed_nll

PAD = 0


def plain_float64(hidden, weight, target, epsilon, pad=PAD):
    """The definition, differentiated by autograd: -sum_v q(v) log softmax(h W^T)(v),
    over the targets that are neither pad nor IGNORE (pad None: no token is padding,
    and the smoothing spreads over every token but the reference)."""
    log_p = torch.log_softmax(hidden @ weight.T, dim=-1)                 # (B, T, V)
    vocab = weight.shape[0]
    keep = (target != IGNORE) & (target != pad)
    reference = torch.where(keep, target, 0).unsqueeze(-1)
    q = torch.full_like(log_p, epsilon / (vocab - (1 if pad is None else 2)))
    q.scatter_(-1, reference, 1.0 - epsilon)
    if pad is not None:
        q[..., pad] = 0.0
    keep = keep.unsqueeze(-1)
    smoothed = -(q * log_p * keep).sum()
    nll = -(log_p.gather(-1, reference) * keep).sum()
    return smoothed, nll


def inputs(batch=4, length=6, dim=8, vocab=23, dtype=torch.float64):
    hidden = torch.randn(batch, length, dim, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, dim, dtype=dtype, requires_grad=True)
    target = torch.randint(1, vocab, (batch, length))
    target[0, 4:] = PAD
    target[2, 1:] = PAD
    return hidden, weight, target


@pytest.mark.parametrize("every_row", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("chunk_rows", [1, 5, 1000])
def test_loss_and_gradients_equal_the_plain_form_in_float64(epsilon, chunk_rows, every_row):
    hidden, weight, target = inputs()
    smoothed, nll = projected_label_smoothed_nll(hidden, weight, target, epsilon, PAD,
                                                 chunk_rows=chunk_rows, every_row=every_row)
    want_smoothed, want_nll = plain_float64(hidden, weight, target, epsilon)
    # the sums are float32; the terms and gradients float64
    assert smoothed.item() == pytest.approx(want_smoothed.item(), rel=1e-6)
    assert nll.item() == pytest.approx(want_nll.item(), rel=1e-6)
    upstream = 0.37   # a scale from outside (1 / tokens), passed through
    got = torch.autograd.grad(upstream * smoothed, (hidden, weight))
    want = torch.autograd.grad(upstream * want_smoothed, (hidden, weight))
    for g, w in zip(got, want):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("every_row", [False, True])
@pytest.mark.parametrize("chunk_rows", [3, 1000])
def test_without_a_pad_token_ignore_marks_what_is_not_scored(chunk_rows, every_row):
    """An imported GPT-2 pads with eos, a target to predict: pad_id None, the targets
    not scored are IGNORE, and token 0 is scored and smoothed like any other."""
    hidden, weight, target = inputs()
    target[target == PAD] = IGNORE
    target[1, :3] = 0
    smoothed, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, None,
                                                 chunk_rows=chunk_rows, every_row=every_row)
    want_smoothed, want_nll = plain_float64(hidden, weight, target, 0.1, pad=None)
    assert smoothed.item() == pytest.approx(want_smoothed.item(), rel=1e-6)
    assert nll.item() == pytest.approx(want_nll.item(), rel=1e-6)
    got = torch.autograd.grad(smoothed, (hidden, weight))
    want = torch.autograd.grad(want_smoothed, (hidden, weight))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    logits = (hidden @ weight.T).detach()
    plain = label_smoothed_nll(logits, target, 0.1, None)
    assert [x.item() for x in plain] == pytest.approx([want_smoothed.item(),
                                                        want_nll.item()], rel=1e-6)
    # IGNORE also works beside a pad token (ours), each position left out once
    mixed = target.clone()
    mixed[3, 2:] = PAD
    assert label_smoothed_nll(logits, mixed, 0.1, PAD)[1].item() == pytest.approx(
        plain_float64(hidden, weight, mixed, 0.1)[1].item(), rel=1e-6)


@pytest.mark.parametrize("every_row", [False, True])
def test_padding_rows_get_no_gradient_and_change_nothing(every_row):
    hidden, weight, target = inputs()
    smoothed, _ = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD,
                                               every_row=every_row)
    grad_hidden, grad_weight = torch.autograd.grad(smoothed, (hidden, weight))
    assert torch.all(grad_hidden[target == PAD] == 0)
    assert torch.all(grad_hidden[target != PAD] != 0)
    changed = hidden.detach().clone().requires_grad_()
    with torch.no_grad():
        changed[target == PAD] = 1e3
    again, _ = projected_label_smoothed_nll(changed, weight, target, 0.1, PAD,
                                            every_row=every_row)
    assert again.item() == smoothed.item()
    # padding's hidden states reach the weight's gradient in no way either
    assert torch.equal(torch.autograd.grad(again, weight)[0], grad_weight)


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_loss_compiles_into_one_graph_and_computes_the_same(dynamic):
    """Under torch.compile the loss projects every row (no shape that depends on the
    data), so the step's graph can hold it: one graph for each batch shape, fed
    different padding, equal to the eager loss in float64."""
    torch._dynamo.reset()
    _, weight, _ = inputs()
    compiled = torch.compile(
        lambda h, t: projected_label_smoothed_nll(h, weight, t, 0.1, PAD, chunk_rows=5),
        fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for batch, length in [(4, 6), (3, 9), (4, 6)]:
        hidden, _, target = inputs(batch, length)
        target[-1, 2:] = PAD
        got = compiled(hidden, target)
        want = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD)
        for g, w in zip(got, want):
            assert g.item() == pytest.approx(w.item(), rel=1e-6)
        got_grads = torch.autograd.grad(got[0], (hidden, weight))
        want_grads = torch.autograd.grad(want[0], (hidden, weight))
        for g, w in zip(got_grads, want_grads):   # the weight's is summed in float32
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6 * w.abs().max().item())


def test_float32_agrees_with_the_plain_loss_on_logits():
    hidden, weight, target = inputs(dtype=torch.float32)
    smoothed, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD)
    plain = label_smoothed_nll(hidden @ weight.T, target, 0.1, PAD)
    assert smoothed.item() == pytest.approx(plain[0].item(), rel=1e-5)
    assert nll.item() == pytest.approx(plain[1].item(), rel=1e-5)


def test_bfloat16_autocast_projects_in_bfloat16_and_stays_close():
    hidden, weight, target = inputs(batch=8, length=16, dim=32, vocab=101, dtype=torch.float32)
    want, _ = plain_float64(hidden.double(), weight.double(), target, 0.1)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        smoothed, _ = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD)
    got_grads = torch.autograd.grad(smoothed, (hidden, weight))
    assert smoothed.dtype == torch.float32
    assert smoothed.item() == pytest.approx(want.item(), rel=2e-2)
    for g, w, param in zip(got_grads, want_grads, (hidden, weight)):
        assert g.dtype == param.dtype == torch.float32     # master weights' gradient
        assert torch.linalg.norm(g.double() - w) < 2e-2 * torch.linalg.norm(w)
        # ... and not what float32 gives: the products did run in bfloat16
    float32_loss, _ = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD)
    assert smoothed.item() != float32_loss.item()


def test_without_gradients_only_the_sums_are_computed():
    hidden, weight, target = inputs()
    with torch.no_grad():
        smoothed, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD)
    assert not smoothed.requires_grad
    want_smoothed, want_nll = plain_float64(hidden, weight, target, 0.1)
    assert smoothed.item() == pytest.approx(want_smoothed.item(), rel=1e-6)
    smoothed, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD)
    assert smoothed.requires_grad and not nll.requires_grad


def plain_with_bias_float64(hidden, weight, bias, target, epsilon):
    """The definition with an output bias: tokens at NEVER_OUTPUT and pad take no share."""
    log_p = torch.log_softmax(hidden @ weight.T + bias, dim=-1)          # (B, T, V)
    support = (bias > NEVER_OUTPUT).double()
    support[PAD] = 0.0
    q = (epsilon / (support.sum() - 1) * support).expand_as(log_p).clone()
    q.scatter_(-1, target.unsqueeze(-1), 1.0 - epsilon)
    keep = (target != PAD).unsqueeze(-1)
    smoothed = -(q * log_p * keep).sum()
    nll = -(log_p.gather(-1, target.unsqueeze(-1)) * keep).sum()
    return smoothed, nll


def biased_inputs():
    """inputs() with a bias that never lets out pad, token 1 (bos) and token 5."""
    hidden, weight, target = inputs()
    bias = torch.randn(weight.shape[0], dtype=torch.float64)
    bias[[PAD, 1, 5]] = NEVER_OUTPUT
    target[target == 1], target[target == 5] = 2, 3
    return hidden, weight, bias.requires_grad_(), target


@pytest.mark.parametrize("every_row", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 1000])
def test_an_output_bias_is_added_and_its_never_tokens_take_no_smoothing(chunk_rows, every_row):
    hidden, weight, bias, target = biased_inputs()
    smoothed, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD,
                                                 chunk_rows=chunk_rows, every_row=every_row,
                                                 bias=bias)
    want_smoothed, want_nll = plain_with_bias_float64(hidden, weight, bias, target, 0.1)
    assert smoothed.item() == pytest.approx(want_smoothed.item(), rel=1e-6)
    assert nll.item() == pytest.approx(want_nll.item(), rel=1e-6)
    got = torch.autograd.grad(0.37 * smoothed, (hidden, weight, bias))
    want = torch.autograd.grad(0.37 * want_smoothed, (hidden, weight, bias))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    assert torch.all(got[2][[PAD, 1, 5]] == 0)     # the never tokens stay never


def test_a_loss_with_a_bias_compiles_into_one_graph():
    torch._dynamo.reset()
    hidden, weight, bias, target = biased_inputs()
    compiled = torch.compile(
        lambda h, t: projected_label_smoothed_nll(h, weight, t, 0.1, PAD, bias=bias),
        fullgraph=True, backend="aot_eager")
    got, want = compiled(hidden, target), projected_label_smoothed_nll(
        hidden, weight, target, 0.1, PAD, bias=bias)
    for g, w in zip(got, want):
        assert g.item() == pytest.approx(w.item(), rel=1e-6)
