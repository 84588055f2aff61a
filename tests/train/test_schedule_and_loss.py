import math

import pytest
import torch

from transduce.config import ConfigError, TrainConfig
from transduce.train.ema import WeightAverage
from transduce.train.loss import label_smoothed_nll
from transduce.train.schedule import budget_lr, budget_progress, learning_rate, noam_lr


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


def test_budget_schedule_warms_up_then_decays_to_zero_at_the_budget():
    peak, warmup = 2e-3, 0.1
    assert budget_lr(0.0, peak, warmup) == 0.0
    assert budget_lr(0.05, peak, warmup) == pytest.approx(peak / 2)
    assert budget_lr(0.1, peak, warmup) == pytest.approx(peak)
    assert budget_lr(0.55, peak, warmup) == pytest.approx(peak / 2)
    assert budget_lr(1.0, peak, warmup) == 0.0 and budget_lr(1.3, peak, warmup) == 0.0
    rates = [budget_lr(p / 100, peak, warmup) for p in range(101)]
    assert max(rates) == pytest.approx(peak)


def test_budget_progress_counts_steps_and_minutes_whichever_is_further():
    steps = TrainConfig(max_steps=200, schedule="budget")
    minutes = TrainConfig(max_minutes=10, schedule="budget")
    both = TrainConfig(max_steps=200, max_minutes=10, schedule="budget")
    assert budget_progress(steps, 50, 9999.0) == 0.25
    assert budget_progress(minutes, 50, 150.0) == 0.25
    assert budget_progress(both, 100, 150.0) == 0.5 and budget_progress(both, 10, 300.0) == 0.5


def test_learning_rate_follows_the_chosen_schedule():
    noam = TrainConfig(warmup_steps=100, lr_scale=2.0, schedule_offset=7)
    assert learning_rate(noam, 256, 10, 0.0) == noam_lr(18, 256, 100, 2.0)
    budget = TrainConfig(warmup_steps=100, lr_scale=2.0, max_steps=1000, schedule="budget",
                         warmup_fraction=0.1)
    peak = 2.0 * (256 * 100) ** -0.5   # the same peak as the Noam rate with this warmup
    assert learning_rate(budget, 256, 100, 0.0) == pytest.approx(peak)
    assert learning_rate(budget, 256, 550, 0.0) == pytest.approx(peak / 2)
    with pytest.raises(ConfigError, match="schedule='budget'"):
        TrainConfig(schedule="budget")


def test_weight_average_equals_its_recurrence_in_float64():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    ema = WeightAverage(model, decay=0.9)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n in range(30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        d = min(0.9, (1 + n) / (10 + n))
        for name, p in model.named_parameters():
            expected[name] = d * expected[name] + (1 - d) * p.detach()
        ema.update(model)
    averaged = ema.averaged_model(model)
    for name, p in averaged.named_parameters():
        torch.testing.assert_close(p.double(), expected[name], rtol=1e-6, atol=1e-6)
