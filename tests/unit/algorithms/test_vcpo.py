import math

import pytest
import torch

from algorithms.config import VCPOConfig
from algorithms.vcpo import VCPO, ess_lr_scale, opob_baseline


def test_ess_lr_scale_reference_vectors():
    assert ess_lr_scale(0.4285714) == pytest.approx(0.6546537, abs=1e-6)
    assert ess_lr_scale(0.30, rho_on=0.55) == pytest.approx(0.7385489, abs=1e-6)
    assert ess_lr_scale(0.80, rho_on=0.55) == 1.0
    assert ess_lr_scale(0.25, rule="linear") == pytest.approx(0.25)


def test_ess_lr_scale_never_increases_and_rejects_unknown_rule():
    assert ess_lr_scale(1.0, rho_on=0.1) == 1.0
    assert ess_lr_scale(float("nan")) == 0.0
    with pytest.raises(ValueError, match="unknown ESS LR rule"):
        ess_lr_scale(0.5, rule="cubic")


def test_opob_reference_vector():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    weights = torch.tensor([1.0, 1.0, 4.0, 9.0])
    baseline = opob_baseline(rewards, weights, torch.zeros(4, dtype=torch.long))
    assert torch.allclose(baseline, torch.full((4,), 10 / 15))


def test_opob_per_group_and_zero_weight_fallback():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    weights = torch.tensor([3.0, 1.0, 0.0, 0.0, 2.0, 2.0])
    groups = torch.tensor([7, 7, 3, 3, 5, 5])
    baseline = opob_baseline(rewards, weights, groups)
    # group 7: (3*1)/4; group 3: weights sum to 0 -> plain mean 0.5; group 5: 0.5.
    assert torch.allclose(baseline, torch.tensor([0.75, 0.75, 0.5, 0.5, 0.5, 0.5]))


def _reference_inputs():
    w = torch.tensor([1.0, 0.5, 2.0, 1.0])
    score_norm = torch.tensor([1.0, 2.0, 1.0, 3.0])
    return torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.log(w), score_norm**2, torch.zeros(4, dtype=torch.long)


def test_vcpo_baseline_published_formula_counts_is_weight_once():
    rewards, log_w, grad_sq, groups = _reference_inputs()
    b = VCPO().baseline(rewards, log_w, grad_sq, groups, torch.full((4,), 10.0))
    assert torch.allclose(b, torch.full((4,), 10 / 15))


def test_vcpo_baseline_official_code_counts_is_weight_twice():
    rewards, log_w, grad_sq, groups = _reference_inputs()
    b = VCPO(VCPOConfig(baseline_is_weight="twice")).baseline(rewards, log_w, grad_sq, groups, torch.ones(4))
    # W = min(w,8)^2 w^2 |s|^2 = [1, 0.25, 16, 9]
    assert torch.allclose(b, torch.full((4,), 10 / 26.25))


def test_vcpo_baseline_length_normalisation():
    rewards, log_w, grad_sq, groups = _reference_inputs()
    lengths = torch.tensor([1.0, 1.0, 2.0, 3.0])
    b = VCPO(VCPOConfig(normalize_by_length=True)).baseline(rewards, log_w, grad_sq, groups, lengths)
    # W = [1, 1, 4/4, 9/9] -> (1 + 1) / 4
    assert torch.allclose(b, torch.full((4,), 0.5))


def test_vcpo_baseline_finite_for_extreme_log_weights():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    log_w = torch.tensor([1000.0, -1000.0, 999.0, 0.0])
    b = VCPO().baseline(rewards, log_w, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4))
    assert torch.isfinite(b).all()
    assert b[0].item() == pytest.approx(1.0)  # the two huge-weight samples both have reward 1


def test_vcpo_baseline_requires_grad_norms():
    rewards, log_w, _, groups = _reference_inputs()
    assert VCPO().needs_grad_norms
    with pytest.raises(ValueError, match="gradient norms"):
        VCPO().baseline(rewards, log_w, None, groups, torch.ones(4))


def test_vcpo_advantages_divide_by_population_std():
    rewards, log_w, grad_sq, groups = _reference_inputs()
    adv = VCPO().advantages(rewards, log_w, grad_sq, groups, torch.ones(4))
    sigma = rewards.std(unbiased=False)
    assert torch.allclose(adv, (rewards - 10 / 15) / sigma)
    flat = VCPO().advantages(torch.ones(4), log_w, grad_sq, groups, torch.ones(4))
    assert torch.equal(flat, torch.zeros(4))


def test_vcpo_without_baseline_uses_group_mean():
    rewards, log_w, _, groups = _reference_inputs()
    vcpo = VCPO(VCPOConfig(use_baseline=False, norm_by_std=False))
    assert not vcpo.needs_grad_norms
    assert torch.allclose(vcpo.advantages(rewards, log_w, None, groups, torch.ones(4)), rewards - 0.5)


def test_vcpo_lr_scale_from_global_log_weights():
    log_w = torch.log(torch.tensor([1.0, 1.0, 1.0, 9.0]))
    assert VCPO().lr_scale(log_w) == pytest.approx(0.6546537, abs=1e-6)
    assert VCPO(VCPOConfig(rho_on=0.3)).lr_scale(log_w) == 1.0
    clipped = VCPO(VCPOConfig(cap=2.0, ess_from_clipped=True)).lr_scale(log_w)
    assert clipped == pytest.approx(math.sqrt(25 / 7 / 4), abs=1e-6)
