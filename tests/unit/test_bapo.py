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
