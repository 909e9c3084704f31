import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import diagnostics as d
from algorithms.batch import PolicyBatch


def test_ess_reference_vector():
    log_w = torch.log(torch.tensor([1.0, 1.0, 1.0, 9.0]))
    assert d.ess_ratio(log_w).item() == pytest.approx(0.4285714, abs=1e-6)


def test_ess_uniform_is_one_and_dominant_is_one_over_b():
    assert d.ess_ratio(torch.full((8,), 3.0)).item() == pytest.approx(1.0)
    log_w = torch.tensor([0.0] * 7 + [1000.0])
    assert d.ess_ratio(log_w).item() == pytest.approx(1 / 8, rel=1e-6)


def test_ess_finite_for_huge_log_weights():
    log_w = torch.tensor([1000.0, -1000.0, 999.0, 0.0])
    value = d.ess_ratio(log_w).item()
    assert math.isfinite(value)
    # Two surviving weights e^1000 and e^999 dominate: ESS = (1+e^-1)^2 / (1+e^-2).
    expected = (1 + math.exp(-1)) ** 2 / (1 + math.exp(-2)) / 4
    assert value == pytest.approx(expected, rel=1e-5)


def test_ess_empty_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        d.ess_ratio(torch.zeros(0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1000, 1000), min_size=1, max_size=64))
def test_ess_ratio_stays_in_range(values):
    log_w = torch.tensor(values, dtype=torch.float32)
    ratio = d.ess_ratio(log_w).item()
    assert 1 / len(values) - 1e-6 <= ratio <= 1.0


def test_clipped_ess_caps_weights():
    log_w = torch.log(torch.tensor([1.0, 1.0, 1.0, 9.0]))
    # Capped at 2: w = [1,1,1,2] -> ESS = 25 / 7 / 4.
    assert d.ess_ratio_clipped(log_w, cap=2.0).item() == pytest.approx(25 / 7 / 4, rel=1e-6)


def test_sequence_log_weights_respect_mask():
    log_ratio = torch.tensor([[0.1, 0.2, 5.0], [1.0, -1.0, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    assert torch.allclose(d.sequence_log_weights(log_ratio, mask), torch.tensor([0.3, 0.5]))


def test_geometric_vs_sequence_reference_vector():
    log_ratio = torch.full((1, 100), math.log(1.01))
    mask = torch.ones(1, 100, dtype=torch.bool)
    log_w = d.sequence_log_weights(log_ratio, mask)
    assert math.exp(log_w.item()) == pytest.approx(2.7048, abs=1e-4)
    assert math.exp(log_w.item() / 100) == pytest.approx(1.01, rel=1e-6)


def test_kl_estimators_by_hand():
    l = torch.tensor([[0.5, -0.5, 2.0]])
    mask = torch.tensor([[True, True, False]])
    assert d.kl_k1(l, mask).item() == pytest.approx(0.0)
    k3 = ((math.exp(0.5) - 0.5 - 1) + (math.exp(-0.5) + 0.5 - 1)) / 2
    assert d.kl_k3(l, mask).item() == pytest.approx(k3, rel=1e-6)
    assert d.kl_k3(torch.zeros(2, 3), torch.ones(2, 3)).item() == 0.0


def test_chi2_and_second_moment_by_hand():
    l = torch.log(torch.tensor([[2.0, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert d.chi2_token(l, mask).item() == pytest.approx((4 + 0.25) / 2 - 1, rel=1e-6)
    assert d.second_moment(l, mask).item() == pytest.approx(math.log(2) ** 2, rel=1e-6)
    assert d.chi2_seq(torch.log(torch.tensor([1.0, 3.0]))).item() == pytest.approx((1 + 9) / 2 - 1, rel=1e-6)


def _batch(log_ratio, mask):
    behaviour = torch.full_like(log_ratio, -2.0)
    return PolicyBatch(behaviour + log_ratio, behaviour, torch.ones(log_ratio.shape[0]), mask)


def test_health_metrics_equal_the_masked_estimators():
    gen = torch.Generator().manual_seed(3)
    l = torch.randn(4, 9, generator=gen)
    mask = torch.rand(4, 9, generator=gen) < 0.7
    mask[0] = False  # an empty sequence is left out of the ESS
    metrics = d.health_metrics(_batch(l, mask))
    assert metrics["stability/kl_k1"].item() == pytest.approx(d.kl_k1(l, mask).item(), rel=1e-5)
    assert metrics["stability/kl_k3"].item() == pytest.approx(d.kl_k3(l, mask).item(), rel=1e-5)
    assert metrics["stability/chi2_token"].item() == pytest.approx(d.chi2_token(l, mask).item(), rel=1e-5)
    assert metrics["stability/m2"].item() == pytest.approx(d.second_moment(l, mask).item(), rel=1e-5)
    log_w = d.sequence_log_weights(l, mask)[1:]
    assert metrics["stability/ess_ratio"].item() == pytest.approx(d.ess_ratio(log_w).item(), rel=1e-5)


def test_health_metrics_finite_for_extreme_ratios_and_garbage_padding():
    l = torch.tensor([[1000.0, -1000.0], [0.0, 3.0]])
    batch = _batch(l, torch.ones(2, 2, dtype=torch.bool))
    padded = PolicyBatch(
        batch.logprobs,
        torch.tensor([[-2.0, -2.0], [-2.0, -math.inf]]),
        batch.advantages,
        torch.tensor([[True, True], [True, False]]),
    )
    for b in (batch, padded):
        metrics = d.health_metrics(b)
        assert set(metrics) >= {"stability/kl_k3", "stability/ess_ratio", "stability/m2", "stability/chi2_seq"}
        assert all(torch.isfinite(v).all() for v in metrics.values())


def test_health_metrics_of_all_masked_batch_have_no_nan_and_no_ess():
    metrics = d.health_metrics(_batch(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool)))
    assert "stability/ess_ratio" not in metrics
    assert all(torch.isfinite(v) for v in metrics.values())


def test_lag_stats_histogram():
    stats = d.lag_stats(torch.tensor([0, 2, 2, 1]), max_lag=4)
    assert stats["lag_hist"].tolist() == [1, 1, 2, 0, 0]
    assert stats["lag_max"].item() == 2 and stats["lag_mean"].item() == pytest.approx(1.25)
    with pytest.raises(ValueError, match="negative lag"):
        d.lag_stats(torch.tensor([0, -1]))
