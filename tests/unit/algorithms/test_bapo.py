"""BAPO's vectorised bound search against the step-by-step walk it replaces."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms.bapo import adapt_bounds, bound_grid
from algorithms.config import BAPOConfig


def _share(log_ratio, advantages, mask, low, high, dual_c):
    r = torch.exp(log_ratio)
    clipped = ((advantages > 0) & (r > high)) | ((advantages < 0) & ((r < low) | (r > dual_c)))
    active = ~clipped & mask
    contribution = torch.where(active, torch.exp(log_ratio) * advantages.abs(), torch.zeros_like(log_ratio))
    pos, total = contribution[advantages > 0].sum().item(), contribution.sum().item()
    return pos / total if total > 0 else 1.0


def _walk(log_ratio, advantages, mask, config):
    lows = bound_grid(config.clip_low_min, config.clip_low_max, config.step)
    highs = bound_grid(config.clip_high_min, config.clip_high_max, config.step)
    path = [(low, highs[0]) for low in lows] + [(lows[-1], high) for high in highs[1:]]
    for low, high in path:
        share = _share(log_ratio, advantages, mask, low, high, config.dual_clip_c)
        if share >= config.positive_share:
            return low, high, share
    return path[-1][0], path[-1][1], share


def test_bound_grid_ends_at_the_cap():
    assert bound_grid(0.6, 0.9, 0.05) == pytest.approx([0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9])
    assert bound_grid(1.2, 1.3, 0.25) == [1.2, 1.3]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-2.0, 2.0), st.floats(-3.0, 3.0), st.booleans()), min_size=1, max_size=60),
    st.floats(0.05, 0.95),
)
def test_vectorised_search_equals_the_walk(tokens, target):
    log_ratio = torch.tensor([[t[0] for t in tokens]])
    advantages = torch.tensor([[t[1] for t in tokens]])
    mask = torch.tensor([[t[2] for t in tokens]])
    config = BAPOConfig(positive_share=target)
    low, high, share = adapt_bounds(log_ratio, advantages, mask, config)
    expected_low, expected_high, expected_share = _walk(log_ratio, advantages, mask, config)
    assert (low, high) == (pytest.approx(expected_low), pytest.approx(expected_high))
    assert share.item() == pytest.approx(expected_share, rel=1e-5, abs=1e-6)


def _stale_batch(seed, seq_advantages=True):
    from algorithms.batch import PolicyBatch

    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(16, 256, generator=gen) * 0.2
    mask = torch.rand(16, 256, generator=gen) < 0.9
    advantages = torch.randn((16,) if seq_advantages else (16, 256), generator=gen)
    return PolicyBatch(log_ratio.clone(), torch.zeros_like(log_ratio), advantages, mask)


@pytest.mark.parametrize("seed, seq_advantages", [(0, True), (1, False)])
def test_large_batch_search_equals_the_walk(seed, seq_advantages):
    batch = _stale_batch(seed, seq_advantages)
    for target in (0.2, 0.45, 0.5, 0.55, 0.8):
        config = BAPOConfig(positive_share=target)
        low, high, share = adapt_bounds(batch.log_ratio, batch.advantages, batch.mask, config)
        expected_low, expected_high, expected_share = _walk(batch.log_ratio, batch.token_advantages, batch.mask, config)
        assert (low, high) == (pytest.approx(expected_low), pytest.approx(expected_high))
        assert share.item() == pytest.approx(expected_share, rel=1e-5)


@pytest.mark.parametrize("seed, seq_advantages", [(2, True), (3, False)])
def test_weights_are_the_clipped_surrogate_at_the_chosen_bounds(seed, seq_advantages):
    # Targets below, inside and above the walk's range: it stops at the start, mid-way, or runs to the end.
    from algorithms import registry
    from algorithms.clipping import clipped_surrogate_weights

    batch = _stale_batch(seed, seq_advantages)
    for target in (0.05, 0.45, 0.5, 0.55, 0.95):
        out = registry.build("bapo", positive_share=target).token_weights(batch)
        low, high = out.metrics["stability/clip_low"].item(), out.metrics["stability/clip_high"].item()
        reference = clipped_surrogate_weights(batch, low, high, 3.0)
        assert torch.equal(out.weights, reference.weights)
        assert out.metrics["stability/clip_frac"].item() == pytest.approx(
            reference.metrics["stability/clip_frac"].item()
        )


def test_indices_above_finds_every_entry_above():
    from algorithms.batch import indices_above

    gen = torch.Generator().manual_seed(4)
    values = torch.rand(64, 300, generator=gen) ** 20
    values[5, 9], values[13, 9] = math.nan, 0.9  # the same column of the [8, 2400] view
    for shaped in (values, values[:, :299]):  # a size the column view divides, and one it does not
        flat = shaped.reshape(-1)
        found = torch.sort(indices_above(shaped, 0.5)).values
        assert torch.equal(found, (flat > 0.5).nonzero().squeeze(1))


def test_one_instance_gives_every_step_the_result_a_fresh_one_gives(monkeypatch):
    # A BAPO instance tries the widest-bounds pass first only when its last walk ran to the end; the
    # steps below move between ending at the start, mid-way and at the end, so both orders run.
    from algorithms import bapo, registry
    from algorithms.batch import PolicyBatch

    base = _stale_batch(2)
    shifts = {"start": 0.3, "mid": 0.0, "end": -0.3}
    widest_passes = []
    real_widest = bapo._widest
    monkeypatch.setattr(bapo, "_widest", lambda *args: widest_passes.append(1) or real_widest(*args))
    reused = registry.build("bapo")
    sequence = ["end", "mid", "end", "end", "mid", "mid", "start", "end", "start"]
    for where in sequence:
        batch = PolicyBatch(base.logprobs, base.behaviour_logprobs, base.advantages + shifts[where], base.mask)
        fresh_batch = PolicyBatch(batch.logprobs, batch.behaviour_logprobs, batch.advantages, batch.mask)
        fresh = registry.build("bapo").token_weights(fresh_batch)
        ran_to_end = fresh.metrics["stability/positive_share"].item() < 0.5
        assert ran_to_end == (where == "end")
        out = reused.token_weights(batch)
        assert torch.equal(out.weights, fresh.weights), where
        assert out.metrics.keys() == fresh.metrics.keys()
        for name, value in fresh.metrics.items():
            assert torch.equal(torch.as_tensor(out.metrics[name]), torch.as_tensor(value)), (where, name)
    # one widest pass per fresh instance, plus the reused one's after each walk that ran to the end
    # (and on its first step): it skipped that pass on the other steps
    after_end = 1 + sum(1 for before in sequence[:-1] if before == "end")
    assert len(widest_passes) == len(sequence) + after_end
