import math

import pytest
import torch

from transduce.train.loss import label_smoothed_nll
from transduce.train.schedule import noam_lr


def test_noam_formula_warmup_peak_and_decay():
    d, warmup = 512, 4000
    assert noam_lr(1, d, warmup) == pytest.approx(d ** -0.5 * warmup ** -1.5)
    assert noam_lr(warmup, d, warmup) == pytest.approx((d * warmup) ** -0.5)
    assert noam_lr(4 * warmup, d, warmup) == pytest.approx(0.5 * noam_lr(warmup, d, warmup))
    assert noam_lr(100, d, warmup, scale=2.0) == pytest.approx(2 * noam_lr(100, d, warmup))
    rates = [noam_lr(s, d, warmup) for s in range(1, 10000, 50)]
    assert max(rates) == pytest.approx(noam_lr(warmup, d, warmup), rel=1e-2)


def reference_loss(logits, target, epsilon, pad_id):
    """-sum_v q(v) log p(v) with q = 1 - eps on the reference, eps / (V - 2) on every
    other non-pad token, 0 on pad; pad targets skipped. In float64, loop by loop."""
    vocab = logits.shape[-1]
    total = 0.0
    nll_total = 0.0
    for b in range(target.shape[0]):
        for t in range(target.shape[1]):
            y = int(target[b, t])
            if y == pad_id:
                continue
            log_p = torch.log_softmax(logits[b, t].double(), dim=0)
            q = torch.full((vocab,), epsilon / (vocab - 2), dtype=torch.float64)
            q[y], q[pad_id] = 1 - epsilon, 0.0
            total += -(q * log_p).sum().item()
            nll_total += -log_p[y].item()
    return total, nll_total


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_matches_the_distribution_it_describes(epsilon):
    logits = torch.randn(3, 5, 11)
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = 0
    target[2, 1:] = 0
    loss, nll = label_smoothed_nll(logits, target, epsilon, pad_id=0)
    expected, expected_nll = reference_loss(logits, target, epsilon, 0)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert nll.item() == pytest.approx(expected_nll, rel=1e-5)


def test_loss_ignores_whatever_sits_at_padding():
    logits = torch.randn(2, 4, 9)
    target = torch.tensor([[3, 4, 0, 0], [5, 0, 0, 0]])
    changed = logits.clone()
    changed[0, 2:] = 100.0 * torch.randn(2, 9)
    assert torch.equal(label_smoothed_nll(logits, target, 0.1, 0)[0],
                       label_smoothed_nll(changed, target, 0.1, 0)[0])


def test_uniform_logits_give_log_vocab():
    logits = torch.zeros(1, 2, 50)
    _, nll = label_smoothed_nll(logits, torch.tensor([[7, 8]]), 0.1, 0)
    assert nll.item() == pytest.approx(2 * math.log(50), rel=1e-6)
