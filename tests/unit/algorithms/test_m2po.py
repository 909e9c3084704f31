import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms.batch import PolicyBatch
from algorithms.config import M2POConfig
from algorithms.m2po import M2PO, adaptive_clip_tau, m2po_token_mask

REFERENCE_M2 = [0.01, 0.02, 0.03, 0.05, 0.5, 1.2]


def _trust_region_log_ratio(values):
    """Positive advantages with r > 1 put every token in the trust region."""
    return torch.tensor([[math.sqrt(v) for v in values]])


def test_paper_masking_reference_vector():
    log_ratio = _trust_region_log_ratio(REFERENCE_M2)
    keep = m2po_token_mask(log_ratio, torch.ones(1), torch.ones_like(log_ratio, dtype=torch.bool), tau=0.04)
    assert keep.tolist() == [[True, True, True, True, False, False]]
    kept = log_ratio[keep] ** 2
    assert kept.mean().item() == pytest.approx(0.0275, rel=1e-5)


def test_tokens_outside_the_trust_region_are_never_masked():
    # A > 0 with r < 1 and A < 0 with r > 1: clipping cannot bind, whatever the log-ratio.
    log_ratio = torch.tensor([[-5.0, 5.0, 0.1]])
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    keep = m2po_token_mask(log_ratio, advantages, torch.ones(1, 3, dtype=torch.bool), tau=0.0)
    assert keep.tolist() == [[True, True, False]]


def test_ties_mask_only_as_many_as_needed():
    log_ratio = _trust_region_log_ratio([0.01, 0.07, 0.07])
    keep = m2po_token_mask(log_ratio, torch.ones(1), torch.ones(1, 3, dtype=torch.bool), tau=0.04)
    assert keep.sum().item() == 2 and keep[0, 0]


def _greedy_algorithm_1(m2, region, tau):
    keep = [True] * len(m2)
    live = [i for i in range(len(m2)) if region[i]]
    while live and sum(m2[i] for i in live) / len(live) > tau:
        j = max(live, key=lambda i: m2[i])
        keep[j] = False
        live.remove(j)
    return keep


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-3, 3), st.sampled_from([-1.0, 0.0, 1.0])), min_size=1, max_size=40),
    st.floats(0.0, 0.5),
)
def test_sorted_prefix_equals_greedy_algorithm_1(tokens, tau):
    log_ratio = torch.tensor([[l for l, _ in tokens]])
    advantages = torch.tensor([[a for _, a in tokens]])
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    keep = m2po_token_mask(log_ratio, advantages, mask, tau)
    fp32 = log_ratio[0].tolist()  # judge the region on the values the function sees
    m2 = [float(torch.tensor(l) ** 2) for l in fp32]
    region = [(a > 0 and l > 0) or (a < 0 and l < 0) for l, (_, a) in zip(fp32, tokens)]
    expected = _greedy_algorithm_1(m2, region, tau)
    # Ties may be broken differently; the count and the kept mean must agree.
    assert keep.sum().item() == sum(expected)
    kept_region = [m2[i] for i in range(len(tokens)) if region[i] and keep[0, i]]
    if kept_region:
        assert sum(kept_region) / len(kept_region) <= tau + 1e-6


def test_adaptive_clip_reference_vector():
    values = torch.tensor(REFERENCE_M2)
    tau_c = adaptive_clip_tau(values, 0.04)
    assert tau_c == pytest.approx(0.2236068, abs=1e-6)
    assert values.clamp(max=tau_c**2).mean().item() == pytest.approx(0.035, rel=1e-5)
    assert math.exp(-tau_c) == pytest.approx(0.79963, abs=1e-5)
    assert math.exp(tau_c) == pytest.approx(1.25058, abs=1e-5)


def test_adaptive_clip_is_off_within_budget():
    assert adaptive_clip_tau(torch.tensor([0.01, 0.02]), 0.04) is None


def test_m2po_mask_mode_keeps_masked_tokens_in_the_denominator():
    log_ratio = _trust_region_log_ratio(REFERENCE_M2)
    batch = PolicyBatch(log_ratio.clone(), torch.zeros_like(log_ratio), torch.ones(1), torch.ones(1, 6))
    out = M2PO().token_weights(batch)
    assert out.mask.all()
    assert out.weights[0, 4:].eq(0).all()
    assert torch.allclose(out.weights[0, :4], torch.exp(log_ratio[0, :4]))
    assert out.metrics["stability/m2_after"].item() == pytest.approx(0.0275, rel=1e-5)
    assert out.metrics["stability/mask_frac"].item() == pytest.approx(2 / 6)


def test_m2po_adaptive_clip_mode_clips_at_solved_bounds():
    log_ratio = _trust_region_log_ratio(REFERENCE_M2)
    batch = PolicyBatch(log_ratio.clone(), torch.zeros_like(log_ratio), torch.ones(1), torch.ones(1, 6))
    out = M2PO(M2POConfig(mode="adaptive_clip")).token_weights(batch)
    # A > 0: tokens with r > exp(0.2236) lose gradient, i.e. the last two.
    assert (out.weights[0] > 0).tolist() == [True, True, True, True, False, False]
    assert out.metrics["stability/clip_high"].item() == pytest.approx(1.25058, abs=1e-5)
    assert out.metrics["stability/m2_after"].item() == pytest.approx(0.035, rel=1e-5)


def _full_sort_keep_count(m2_region: torch.Tensor, tau: float) -> int:
    values, _ = torch.sort(m2_region.double())
    running = torch.cumsum(values, 0) / torch.arange(1, values.numel() + 1, dtype=torch.float64)
    return int((running <= tau).sum())


@pytest.mark.parametrize("tail_share, tail_std", [(0.01, 2.0), (0.3, 1.0), (0.9, 3.0)])
def test_top_k_search_matches_full_sort_on_large_batches(tail_share, tail_std):
    # A heavy tail: most tokens near on-policy, a share far off; 0.9 forces the top-k to grow.
    gen = torch.Generator().manual_seed(7)
    log_ratio = torch.randn(32, 512, generator=gen) * 0.05
    tail = torch.rand(32, 512, generator=gen) < tail_share
    log_ratio[tail] = torch.randn(int(tail.sum()), generator=gen) * tail_std
    advantages = torch.randn(32, generator=gen)
    mask = torch.rand(32, 512, generator=gen) < 0.9
    keep = m2po_token_mask(log_ratio, advantages, mask, tau=0.04)
    region = mask & (((advantages[:, None] > 0) & (log_ratio > 0)) | ((advantages[:, None] < 0) & (log_ratio < 0)))
    n_keep = _full_sort_keep_count(log_ratio[region] ** 2, 0.04)
    assert int((keep & region).sum()) == n_keep
    assert torch.equal(keep & ~region, mask & ~region)
    assert (log_ratio[keep & region] ** 2).mean() <= 0.04 + 1e-6


def _adaptive_tau_by_scan(values: torch.Tensor, tau: float):
    n = values.numel()
    if values.double().mean() <= tau:
        return None
    best = None
    for v in sorted(values.double().tolist()):
        if sum(min(x, v) for x in values.double().tolist()) <= tau * n:
            best = v
    return 0.0 if best is None else math.sqrt(best)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(1e-6, 5.0), min_size=1, max_size=300), st.floats(0.0, 0.3))
def test_adaptive_clip_tau_matches_a_plain_scan(values, tau):
    tensor = torch.tensor(values, dtype=torch.float32)
    expected = _adaptive_tau_by_scan(tensor, tau)
    got = adaptive_clip_tau(tensor, tau)
    assert (got is None) == (expected is None)
    if got is not None:
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_tiny_values_keep_their_weight_in_the_budget():
    # total - removed would round 1 + 2e-35 - 1 to 0 and stop after one removal; the budget is exact.
    keep = m2po_token_mask(torch.tensor([[1.0, 4.5e-18]]), torch.ones(1), torch.ones(1, 2, dtype=torch.bool), tau=0.0)
    assert keep.tolist() == [[False, False]]


def _sorted_region_values(batch):
    a = batch.advantages[:, None]
    region = batch.mask & (((a > 0) & (batch.log_ratio > 0)) | ((a < 0) & (batch.log_ratio < 0)))
    return torch.sort((batch.log_ratio[region] ** 2).double(), descending=True).values  # fp32 squares


# The last case: 95% of tokens at |log r| >= 1, with a gap down to the rest: no value above tau fits
# the budget, so the cap is the largest value within tau and every value above tau is clipped.
@pytest.mark.parametrize(
    "seed, tail_share, tail_std, tail_floor",
    [(0, 0.02, 1.5, 0.0), (1, 0.02, 1.5, 0.0), (2, 0.3, 1.0, 0.0), (3, 0.9, 3.0, 0.0), (4, 0.95, 1.0, 1.0)],
)
def test_adaptive_clip_on_large_batches_matches_a_full_sort(seed, tail_share, tail_std, tail_floor):
    # Large enough for the column search, which may have to widen before the cap is found.
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(32, 1024, generator=gen) * 0.05
    tail = torch.rand(32, 1024, generator=gen) < tail_share
    far = torch.randn(int(tail.sum()), generator=gen) * tail_std
    log_ratio[tail] = far + torch.sign(far) * tail_floor
    mask = torch.rand(32, 1024, generator=gen) < 0.9
    batch = PolicyBatch(log_ratio.clone(), torch.zeros_like(log_ratio), torch.randn(32, generator=gen), mask)
    out = M2PO(M2POConfig(mode="adaptive_clip")).token_weights(batch)
    values = _sorted_region_values(batch)
    n, budget = values.numel(), 0.04 * values.numel()
    n_above = int((values > 0.04).sum())
    capped = [float(values.clamp(max=v).sum()) for v in values[: n_above + 1]]  # + the largest within tau
    tau_c = math.sqrt(float(values[next(j for j, c in enumerate(capped) if c <= budget)]))
    assert out.metrics["stability/clip_high"].item() == pytest.approx(math.exp(tau_c), rel=1e-6)
    assert out.metrics["stability/m2_after"].item() == pytest.approx(
        float(values.clamp(max=tau_c**2).sum()) / n, rel=1e-5
    )
    # the clip, applied to the tokens the search found, is the clipped surrogate over the whole batch
    from algorithms.clipping import clipped_surrogate_weights

    dense = clipped_surrogate_weights(batch, math.exp(-tau_c), math.exp(tau_c), None)
    assert torch.equal(out.weights, dense.weights)
    assert out.metrics["stability/clip_frac"].item() == pytest.approx(dense.metrics["stability/clip_frac"].item())


def test_largest_entries_hold_every_entry_above_their_floor():
    from algorithms.batch import largest_entries

    gen = torch.Generator().manual_seed(5)
    values = torch.rand(64, 512, generator=gen) ** 8
    values[3, 7] = math.nan
    flat = values.reshape(-1)
    for columns in (8, 64, 4096):
        top, index, floor = largest_entries(values, 0.2, columns)
        expected = torch.sort(flat[flat > max(0.2, floor)], descending=True).values
        assert torch.equal(top, expected) and torch.equal(flat[index], top)
        assert (floor > 0.2) == (top.numel() < int((flat > 0.2).sum()))
    assert largest_entries(values, 0.2, 4096)[2] == -math.inf  # every column taken: all entries


def test_the_python_walk_and_the_tensor_walk_agree():
    from algorithms.m2po import walk_floats, walk_tensors

    gen = torch.Generator().manual_seed(6)
    top = torch.sort(torch.rand(300, generator=gen) * 3 + 0.04, descending=True).values
    total, n = float(top.double().sum()) + 40.0, 2000
    rules = [lambda j, v, others: others - 0.04 * (n - 1 - j), lambda j, v, others: others + (j + 1) * v - 0.04 * n]
    for rule in rules:
        first, margins, others = walk_floats(rule, top.tolist(), total)
        first_t, margins_t, others_t = walk_tensors(rule, top, total - torch.cumsum(top, 0, dtype=torch.float64))
        assert first is not None and (first, others) == (first_t, others_t)
        assert margins == margins_t[: first + 1].tolist()


def test_the_cheap_total_is_within_its_stated_error_of_the_fp64_sum():
    from algorithms.m2po import sum_of

    gen = torch.Generator().manual_seed(8)
    scales = torch.tensor([1e-30, 1.0, 1e20, 0.0]).repeat(4096).view(32, 512)  # tiny, huge and zero side by side
    for values in (
        torch.rand(64, 2048, generator=gen),
        torch.randn(64, 2048, generator=gen).exp() ** 6,
        torch.rand(32, 512, generator=gen) * scales,
    ):
        total = sum_of(values)
        exact = float(values.sum(dtype=torch.float64))
        assert abs(total.value - exact) <= total.error <= 2e-6 * exact
    small = torch.rand(15, generator=gen)  # too few for columns: the fp64 sum itself
    assert sum_of(small).value == float(small.sum(dtype=torch.float64)) and sum_of(small).error == 0.0


def test_a_budget_too_close_for_the_cheap_total_is_decided_on_the_fp64_sum():
    """16,384 trust-region values just under tau and one far above it, placed so that their fp64 sum
    exceeds the budget tau * n by 1e-7 while the cheap fp32-column total lies within its error of it.
    Algorithm 1 must mask the one large value; the adaptive clip must cap at the largest value within tau."""
    from algorithms.m2po import sum_of

    tau, shape = 0.04, (64, 256)
    log_ratio = torch.full(shape, math.sqrt(tau * 0.998), dtype=torch.float32)
    log_ratio[5, 17] = 1.16218101978302
    squares = log_ratio * log_ratio
    budget, total = tau * squares.numel(), sum_of(squares)
    assert 0 < float(squares.sum(dtype=torch.float64)) - budget < 1e-6 and abs(total.value - budget) <= total.error
    keep = m2po_token_mask(log_ratio, torch.ones(shape[0]), torch.ones(shape, dtype=torch.bool), tau)
    assert (~keep).nonzero().tolist() == [[5, 17]]
    assert adaptive_clip_tau(squares, tau) == math.sqrt(float(squares[0, 0]))
