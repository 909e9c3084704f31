"""The fused CPU scans (algorithms/native.py) against the torch path they stand in for.

Both paths must make the same decisions: M2PO's masked or clipped tokens and BAPO's bounds, on any
batch. Their sums are added in different orders, so fp64 metrics may differ in the last digits.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import native, registry
from algorithms.batch import PolicyBatch
from algorithms.m2po import m2po_token_mask


def test_the_scans_are_built_where_install_sh_ran():
    # ./install.sh builds the op; without it M2PO and BAPO fall back to the slower torch path.
    assert native.module() is not None, "the fused CPU scans did not build: see the warning logged above"


def test_turned_off_by_the_environment(monkeypatch):
    native.module.cache_clear()
    monkeypatch.setenv("STABLEASYNC_NATIVE", "0")
    try:
        assert native.module() is None
        assert not native.usable((torch.zeros(2, 3),), torch.zeros(2))
    finally:
        native.module.cache_clear()


def test_only_fp32_contiguous_cpu_tensors_with_row_advantages_take_the_scans():
    tokens, rows = torch.zeros(4, 6), torch.zeros(4)
    assert native.usable((tokens,), rows)
    assert not native.usable((tokens,), torch.zeros(4, 6))  # per-token advantages
    assert not native.usable((tokens.double(),), rows)
    assert not native.usable((torch.zeros(6, 4).t(),), rows)  # not contiguous
    assert not native.usable((tokens,), rows.double())
    assert not native.usable((tokens,), torch.zeros(5))  # one advantage too many: the torch path raises
    assert not native.usable((tokens, torch.zeros(4, 7)), rows)
    with native.turned_off():
        assert not native.usable((tokens,), rows)
    assert native.usable((tokens,), rows)


def _batch(seed: int, rows: int, tokens: int, tail_share: float, tail_std: float, extremes: bool) -> PolicyBatch:
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(rows, tokens, generator=gen) * 0.05
    tail = torch.rand(rows, tokens, generator=gen) < tail_share
    log_ratio[tail] = torch.randn(int(tail.sum()), generator=gen) * tail_std
    if extremes:
        log_ratio[0, :3] = torch.tensor([1000.0, -1000.0, 0.0])
    advantages = torch.randn(rows, generator=gen)
    advantages[rows // 2] = 0.0  # a row that adds nothing to either side
    mask = torch.rand(rows, tokens, generator=gen) < 0.85
    logprobs = -torch.rand(rows, tokens, generator=gen) * 3
    return PolicyBatch(logprobs, logprobs - log_ratio, advantages, mask)


def _both_paths(stabilizer_name: str, batch: PolicyBatch, **options):
    fused = registry.build(stabilizer_name, **options).token_weights(batch)
    fresh = PolicyBatch(batch.logprobs, batch.behaviour_logprobs, batch.advantages, batch.mask)
    with native.turned_off():
        reference = registry.build(stabilizer_name, **options).token_weights(fresh)
    return fused, reference


def _assert_same(fused, reference):
    assert torch.equal(fused.weights, reference.weights)
    assert fused.metrics.keys() == reference.metrics.keys()
    for name, value in reference.metrics.items():
        assert float(fused.metrics[name]) == pytest.approx(float(value), rel=1e-6, abs=1e-12), name


# Shapes whose rows are not a whole number of 16-token blocks or 8 lanes; tails from a few far tokens
# to most of them (the M2PO search must then widen past its first candidates).
CASES = [
    (0, 64, 2048, 0.02, 1.5, False),
    (1, 7, 37, 0.3, 1.0, True),
    (2, 16, 1000, 0.9, 3.0, True),
    (3, 3, 5, 0.5, 2.0, False),
]


@pytest.mark.parametrize("seed, rows, tokens, tail_share, tail_std, extremes", CASES)
@pytest.mark.parametrize("options", [{}, {"mode": "adaptive_clip"}, {"tau": 0.0}, {"tau": 2.0}])
def test_m2po_takes_the_same_decisions_on_both_paths(seed, rows, tokens, tail_share, tail_std, extremes, options):
    batch = _batch(seed, rows, tokens, tail_share, tail_std, extremes)
    assert native.usable((batch.log_ratio,), batch.advantages)
    _assert_same(*_both_paths("m2po", batch, **options))


@pytest.mark.parametrize("seed, rows, tokens, tail_share, tail_std, extremes", CASES)
@pytest.mark.parametrize("positive_share", [0.05, 0.3, 0.455, 0.5, 0.55, 0.95])
def test_bapo_takes_the_same_decisions_on_both_paths(
    seed, rows, tokens, tail_share, tail_std, extremes, positive_share
):
    batch = _batch(seed, rows, tokens, tail_share, tail_std, extremes)
    fused, reference = _both_paths("bapo", batch, positive_share=positive_share)
    for bound in ("stability/clip_low", "stability/clip_high"):
        assert float(fused.metrics[bound]) == float(reference.metrics[bound])
    _assert_same(fused, reference)


def test_bapo_with_a_dual_clip_inside_the_walk_takes_the_same_decisions():
    # c below b-: a negative mover above c never counts, the case with its own bucket
    batch = _batch(5, 8, 300, 0.4, 1.0, True)
    options = {"positive_share": 0.5, "dual_clip_c": 0.8, "clip_low_max": 0.9}
    _assert_same(*_both_paths("bapo", batch, **options))


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.floats(-4.0, 4.0, width=32), min_size=1, max_size=90),
    st.lists(st.sampled_from([-1.5, -0.2, 0.0, 0.7, 2.0]), min_size=6, max_size=6),
    st.sampled_from([0.0, 0.01, 0.04, 0.3]),
)
def test_m2po_masks_the_same_tokens_on_both_paths(rows, values, row_advantages, tau):
    tokens = max(1, len(values) // rows)
    log_ratio = torch.tensor((values * rows)[: rows * tokens]).view(rows, tokens)
    advantages = torch.tensor(row_advantages[:rows])
    mask = torch.ones(rows, tokens, dtype=torch.bool)
    keep = m2po_token_mask(log_ratio, advantages, mask, tau)
    with native.turned_off():
        assert torch.equal(keep, m2po_token_mask(log_ratio, advantages, mask, tau))


def test_an_all_padding_batch_gives_the_same_zero_weights():
    batch = _batch(6, 4, 40, 0.3, 2.0, False)
    empty = PolicyBatch(batch.logprobs, batch.behaviour_logprobs, batch.advantages, torch.zeros_like(batch.mask))
    for name, options in (("m2po", {}), ("m2po", {"mode": "adaptive_clip"}), ("bapo", {"positive_share": 0.455})):
        fused, reference = _both_paths(name, empty, **options)
        _assert_same(fused, reference)
        assert not fused.weights.any() and math.isfinite(
            float(fused.metrics["stability/m2" if name == "m2po" else "stability/positive_share"])
        )


def test_bapo_tokens_exactly_on_the_bounds_fall_in_the_same_buckets():
    # Log-ratios sit on the walk's fp32 log bounds, where < and <= part ways: the highs in the rows with
    # A > 0, the lows and the dual clip in the rows with A < 0 (padded with masked zeros).
    from algorithms.bapo import bound_grids
    from algorithms.config import BAPOConfig

    grids = bound_grids(BAPOConfig())
    negative_row = torch.cat([grids.log_lows, torch.tensor([math.log(3.0)], dtype=torch.float32)])
    width = max(grids.log_highs.numel(), negative_row.numel())
    log_ratio = torch.zeros(4, width)
    mask = torch.zeros(4, width, dtype=torch.bool)
    for row, values in enumerate([grids.log_highs, negative_row, grids.log_highs, negative_row]):
        log_ratio[row, : values.numel()], mask[row, : values.numel()] = values, True
    advantages = torch.tensor([1.0, -1.0, 0.5, -2.0])
    logprobs = torch.zeros_like(log_ratio)
    batch = PolicyBatch(logprobs, logprobs - log_ratio, advantages, mask)
    assert torch.equal(batch.log_ratio, log_ratio)  # the bounds survive the subtraction exactly
    lows_reached = set()
    for positive_share in [k / 40 for k in range(1, 40)]:
        fused, reference = _both_paths("bapo", batch, positive_share=positive_share)
        for bound in ("stability/clip_low", "stability/clip_high"):
            assert float(fused.metrics[bound]) == float(reference.metrics[bound])
        _assert_same(fused, reference)
        lows_reached.add(round(float(reference.metrics["stability/clip_low"]), 4))
    # the walk stopped inside the lows too, where a negative token on the bound is not clipped
    assert len(lows_reached - {0.6, 0.9}) >= 2
