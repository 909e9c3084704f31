"""Hand-computed cases per stabilizer, and the weight form checked against each literal objective."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from algorithms import registry
from algorithms.aggregation import policy_gradient_loss
from algorithms.batch import PolicyBatch
from algorithms.config import STABILIZER_CONFIGS

LOG = math.log


def _batch(ratios, advantages=1.0, mask=None, requires_grad=False):
    """One-or-more sequences whose token ratios pi/mu are given (behaviour log-probs = log 0.5)."""
    log_ratio = torch.log(torch.tensor(ratios, dtype=torch.float32))
    if log_ratio.dim() == 1:
        log_ratio = log_ratio.unsqueeze(0)
    behaviour = torch.full_like(log_ratio, LOG(0.5))
    logprobs = (behaviour + log_ratio).requires_grad_(requires_grad)
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    if adv.dim() == 0:
        adv = adv.expand(log_ratio.shape[0]).clone()
    mask = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else torch.tensor(mask).bool()
    return PolicyBatch(logprobs, behaviour, adv, mask)


def _weights(name, batch, **config):
    return registry.build(name, **config).token_weights(batch)


def test_every_issue_stabilizer_is_registered():
    expected = {
        "none",
        "ppo_clip",
        "tis_token",
        "tis_seq",
        "mis_token",
        "mis_seq",
        "mis_geo",
        "icepop",
        "opsm",
        "topr",
        "m2po",
        "gspo",
        "cispo",
        "bapo",
        "vcpo",
    }
    assert set(registry.STABILIZERS) == expected


def test_every_stabilizer_has_a_row_in_the_docs():
    docs = (Path(__file__).resolve().parents[3] / "docs" / "stabilizers.md").read_text()
    assert [name for name in registry.STABILIZERS if f"| `{name}`" not in docs] == []


def test_unknown_name_and_unknown_config_key_are_clear_errors():
    with pytest.raises(KeyError, match="registered: bapo"):
        registry.get("tis")
    with pytest.raises(TypeError, match="cap_value"):
        registry.build("tis_seq", cap_value=3)


def _past(bound_rule: str, bound: float) -> float:
    return {"gt": bound, "ge": bound - 0.5, "lt": bound, "le": bound + 0.5}[bound_rule]


@pytest.mark.parametrize("name", sorted(STABILIZER_CONFIGS))
def test_config_values_past_their_bounds_or_out_of_order_are_refused_by_name(name):
    config_cls = STABILIZER_CONFIGS[name]
    for field in dataclasses.fields(config_cls):
        for rule, bound in field.metadata.get("bounds", {}).items():
            with pytest.raises(ValueError, match=f"^{field.name} must be"):
                registry.build(name, **{field.name: _past(rule, bound)})
    for first, second in config_cls.ORDERED:
        low, high = getattr(config_cls(), first), getattr(config_cls(), second)
        with pytest.raises(ValueError, match=f"{first} .* must not exceed {second}"):
            registry.build(name, **{first: high + 1.0, second: high + 0.5})
        registry.build(name, **{first: low, second: low})  # equal is in order
    ordered = {name for pair in config_cls.ORDERED for name in pair}
    unchecked = [
        field.name
        for field in dataclasses.fields(config_cls)
        if field.type == "float" and not field.metadata.get("bounds") and field.name not in ordered
    ]
    assert not unchecked, f"float fields with neither bounds nor an order: {unchecked}"


def test_reference_defaults():
    assert registry.build("tis_seq").config.cap == 2.0
    assert registry.build("vcpo").config.cap == 8.0 and registry.build("vcpo").config.rho_on == 1.0
    assert registry.build("m2po").config.tau == 0.04
    icepop = registry.build("icepop").config
    assert (icepop.low, icepop.high) == (0.5, 5.0)
    gspo = registry.build("gspo").config
    assert (gspo.eps_low, gspo.eps_high) == (3e-4, 4e-4)


def test_none_ignores_behaviour():
    out = _weights("none", _batch([0.1, 10.0], mask=[[1, 0]]))
    assert out.weights.tolist() == [[1.0, 0.0]]


def test_tis_token_caps_each_token():
    out = _weights("tis_token", _batch([0.5, 1.0, 3.0]))
    assert torch.allclose(out.weights, torch.tensor([[0.5, 1.0, 2.0]]))
    assert out.metrics["stability/clip_frac"].item() == pytest.approx(1 / 3)


def test_tis_seq_caps_the_product():
    out = _weights("tis_seq", _batch([[1.5, 1.2], [0.5, 1.2]]))
    assert torch.allclose(out.weights, torch.tensor([[1.8, 1.8], [0.6, 0.6]]), rtol=1e-5)
    capped = _weights("tis_seq", _batch([[3.0, 1.0]]))
    assert torch.allclose(capped.weights, torch.tensor([[2.0, 2.0]]))


def test_mis_token_drops_tokens_from_the_denominator():
    out = _weights("mis_token", _batch([0.4, 1.0, 2.5]))
    assert out.mask.tolist() == [[False, True, False]]
    assert torch.allclose(out.weights, torch.tensor([[0.0, 1.0, 0.0]]))


def test_mis_seq_drops_whole_sequences_and_weights_the_rest():
    out = _weights("mis_seq", _batch([[3.0, 1.0], [1.5, 1.0]]))
    assert out.mask.tolist() == [[False, False], [True, True]]
    assert torch.allclose(out.weights[1], torch.tensor([1.5, 1.5]))
    assert out.metrics["stability/seq_mask_frac"].item() == pytest.approx(0.5)


def test_mis_geo_uses_the_geometric_mean():
    # 100 tokens at 1.01 would be 2.7 as a product but 1.01 as a geometric mean: outside [0.999, 1.001].
    drifting = _weights("mis_geo", _batch([[1.01] * 100, [1.0] * 100]))
    assert drifting.mask[0].any().item() is False and drifting.mask[1].all()
    assert _weights("mis_geo", _batch([[1.01] * 100]), low=0.5, high=2.0).mask.all()


def test_icepop_zeroes_out_of_band_tokens_but_keeps_them_counted():
    out = _weights("icepop", _batch([0.4, 1.0, 6.0]))
    assert out.mask.all()
    assert torch.allclose(out.weights, torch.tensor([[0.0, 1.0, 0.0]]))


def test_opsm_masks_only_stale_negative_sequences():
    stale = [0.5, 0.5]  # mean log(mu/pi) = log 2 > delta
    out = _weights("opsm", _batch([stale, stale, [1.0, 1.0]], advantages=[-1.0, 1.0, -1.0]))
    assert out.weights.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert out.mask.all()


def test_topr_truncates_only_negative_sequences():
    # products: 3 (A > 0: weight 1, no IS), 0.5 (A < 0: 0.5), 3 (A < 0: capped at 1), 0.25 (A = 0: weight 1)
    batch = _batch(
        [[1.5, 2.0], [0.5, 1.0], [3.0, 1.0], [0.5, 0.5]],
        advantages=[1.0, -1.0, -1.0, 0.0],
        mask=[[1, 1], [1, 1], [1, 1], [1, 0]],
    )
    out = _weights("topr", batch)
    assert torch.allclose(out.weights, torch.tensor([[1.0, 1.0], [0.5, 0.5], [1.0, 1.0], [1.0, 0.0]]))
    assert out.mask.equal(batch.mask)
    assert out.metrics["stability/clip_frac"].item() == pytest.approx(2 / 7)  # the capped sequence's 2 tokens
    assert out.metrics["stability/is_weight_mean"].item() == pytest.approx((2 + 1 + 2 + 1) / 7)
    # per-token advantages: the sign of the sequence's token mean decides
    per_token = _batch([[0.5, 1.0]], advantages=[[1.0, -3.0]])
    assert torch.allclose(_weights("topr", per_token, cap=2.0).weights, torch.tensor([[0.5, 0.5]]))


def test_cispo_clips_but_keeps_gradient():
    out = _weights("cispo", _batch([0.5, 1.0, 3.0]))
    assert torch.allclose(out.weights, torch.tensor([[0.5, 1.0, 1.2]]))


def test_vcpo_base_loss_is_seq_tis_with_cap_8():
    out = _weights("vcpo", _batch([[3.0, 4.0], [1.5, 1.0]]))
    assert torch.allclose(out.weights, torch.tensor([[8.0, 8.0], [1.5, 1.5]]))
    log_w = torch.log(torch.tensor([1.0, 1.0, 1.0, 9.0]))
    clipped = registry.build("vcpo", cap=2.0).global_metrics(log_w)["stability/ess_ratio_clipped"]
    assert clipped.item() == pytest.approx(25 / 7 / 4, rel=1e-6)


def test_bapo_widens_bounds_until_positive_share_is_met():
    # Negative tokens with r in [0.6, 0.9) dominate at the narrowest bounds; raising c_low clips them.
    # share at c_low 0.6: 1 / (1 + 0.7 + 0.8 + 0.86) = 0.30; at 0.75: 1 / 2.66; at 0.85: 1 / 1.86 >= 0.5.
    batch = _batch([[1.0, 0.7, 0.8, 0.86]], advantages=[[1.0, -1.0, -1.0, -1.0]])
    out = _weights("bapo", batch)
    assert out.metrics["stability/positive_share"].item() == pytest.approx(1 / 1.86, rel=1e-5)
    assert out.metrics["stability/clip_low"].item() == pytest.approx(0.85)
    assert out.metrics["stability/clip_high"].item() == pytest.approx(1.2)
    assert torch.allclose(out.weights, torch.tensor([[1.0, 0.0, 0.0, 0.86]]))


def test_bapo_stops_at_the_widest_bounds():
    batch = _batch([[1.0, 1.0, 1.0]], advantages=[[1.0, -5.0, -5.0]])
    out = _weights("bapo", batch)
    assert out.metrics["stability/clip_low"].item() == pytest.approx(0.9)
    assert out.metrics["stability/clip_high"].item() == pytest.approx(3.0)


# ---- the weight form gives exactly the gradient of each published objective ----


def _ratio(batch):
    return torch.exp(batch.logprobs - batch.behaviour_logprobs)


def _literal_ppo(batch, low, high, dual_c=None):
    r, a = _ratio(batch), batch.token_advantages
    surrogate = torch.min(r * a, r.clamp(low, high) * a)
    if dual_c is not None:
        surrogate = torch.where(a < 0, torch.max(surrogate, dual_c * a), surrogate)
    return -(surrogate * batch.mask).sum() / batch.mask.sum()


def _literal_gspo(batch, low, high):
    s = torch.exp(((batch.logprobs - batch.behaviour_logprobs) * batch.mask).sum(1) / batch.mask.sum(1))
    a = batch.seq_advantages
    return -torch.min(s * a, s.clamp(low, high) * a).mean()


def _literal_m2po_mask(batch, keep):
    return -((_ratio(batch) * batch.token_advantages) * keep).sum() / batch.mask.sum()


def _grad(loss, batch):
    (grad,) = torch.autograd.grad(loss, batch.logprobs)
    return grad


RATIOS = [[0.5, 0.95, 1.1, 1.5, 4.0], [0.7, 1.0, 1.3, 0.85, 2.0]]
ADVANTAGES = [[1.0, -1.0, 1.0, -1.0, -1.0], [-0.5, 0.5, 1.0, 1.0, -2.0]]


SEQ_ADVANTAGES = [-0.2, 0.5]


@pytest.mark.parametrize(
    "name, config, mode, advantages, literal",
    [
        ("ppo_clip", {}, "token-mean", ADVANTAGES, lambda b: _literal_ppo(b, 0.8, 1.2, 3.0)),
        ("ppo_clip", {"eps_high": 0.28}, "token-mean", ADVANTAGES, lambda b: _literal_ppo(b, 0.8, 1.28, 3.0)),
        # geometric ratios are 1.257 and 1.091: the first sequence is clipped (A > 0), the second is not
        (
            "gspo",
            {"eps_low": 0.05, "eps_high": 0.1},
            "seq-mean-token-mean",
            [0.3, 0.5],
            lambda b: _literal_gspo(b, 0.95, 1.1),
        ),
        (
            "gspo",
            {"eps_low": 0.5, "eps_high": 0.5},
            "seq-mean-token-mean",
            SEQ_ADVANTAGES,
            lambda b: _literal_gspo(b, 0.5, 1.5),
        ),
        ("m2po", {"mode": "adaptive_clip", "tau": 0.02}, "token-mean", ADVANTAGES, None),
    ],
)
def test_weight_form_matches_literal_objective_gradient(name, config, mode, advantages, literal):
    batch = _batch(RATIOS, advantages=advantages, requires_grad=True)
    out = registry.build(name, **config).token_weights(batch)
    ours = _grad(policy_gradient_loss(batch.logprobs, out.weights, batch.token_advantages, out.mask, mode), batch)
    assert ((out.weights == 0).any() and (out.weights > 0).any()) or (name == "gspo" and config["eps_low"] == 0.5)
    if literal is None:  # adaptive clip: PPO with the bounds the stabilizer reports
        low, high = out.metrics["stability/clip_low"].item(), out.metrics["stability/clip_high"].item()
        assert high < 1e4, "the test data must exceed the M2 budget"
        literal = lambda b: _literal_ppo(b, low, high)  # noqa: E731
    assert torch.allclose(ours, _grad(literal(batch), batch), atol=1e-6)


def test_gspo_sequence_weight_scaling_by_seq_len():
    batch = _batch([[1.01, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], advantages=[1.0, -1.0], requires_grad=True)
    out = registry.build("gspo").token_weights(batch)
    ours = _grad(
        policy_gradient_loss(batch.logprobs, out.weights, batch.token_advantages, out.mask, "seq-mean-token-mean"),
        batch,
    )
    assert torch.allclose(ours, _grad(_literal_gspo(batch, 1 - 3e-4, 1 + 4e-4), batch), atol=1e-7)


def test_m2po_mask_matches_paper_objective_gradient():
    batch = _batch(RATIOS, advantages=ADVANTAGES, requires_grad=True)
    out = registry.build("m2po").token_weights(batch)
    keep = out.weights > 0
    assert (~keep).any(), "the test data must exceed the M2 budget"
    ours = _grad(
        policy_gradient_loss(batch.logprobs, out.weights, batch.token_advantages, out.mask, "token-mean"), batch
    )
    assert torch.allclose(ours, _grad(_literal_m2po_mask(batch, keep), batch), atol=1e-6)


def test_cispo_matches_its_detached_objective():
    batch = _batch(RATIOS, advantages=ADVANTAGES, requires_grad=True)
    out = registry.build("cispo").token_weights(batch)
    ours = _grad(
        policy_gradient_loss(batch.logprobs, out.weights, batch.token_advantages, out.mask, "token-mean"), batch
    )
    weight = _ratio(batch).detach().clamp(0.0, 1.2)
    literal = -(weight * batch.token_advantages * batch.logprobs).sum() / batch.mask.sum()
    assert torch.allclose(ours, _grad(literal, batch), atol=1e-6)


def test_clip_active_follows_the_ppo_rule():
    from algorithms.clipping import clip_active

    r = torch.tensor([0.5, 0.9, 1.1, 1.5, 4.0] * 3)
    a = torch.tensor([1.0] * 5 + [-1.0] * 5 + [0.0] * 5)
    expected = ~(((a > 0) & (r > 1.2)) | ((a < 0) & ((r < 0.8) | (r > 3.0))))
    assert torch.equal(clip_active(torch.log(r), a, 0.8, 1.2, 3.0), expected.float())
    no_dual = ~(((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8)))
    assert torch.equal(clip_active(torch.log(r), a, 0.8, 1.2, None), no_dual.float())


# ---- the float-arithmetic implementations against the plain boolean formulas ----


def _parity_batch(seed, seq_advantages):
    """Random log-ratios (a few at +-1000), ragged masks with an empty row, -inf behaviour on padding."""
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 40
    logprobs = -torch.rand(b, t, generator=gen) * 3
    log_ratio = torch.randn(b, t, generator=gen) * 0.6
    log_ratio[0, :3] = torch.tensor([1000.0, -1000.0, 0.0])
    mask = torch.rand(b, t, generator=gen) < 0.8
    mask[1] = False
    behaviour = torch.where(mask, logprobs - log_ratio, torch.full_like(logprobs, -math.inf))
    advantages = torch.randn((b,) if seq_advantages else (b, t), generator=gen)
    advantages[2] = 0.0
    return PolicyBatch(logprobs, behaviour, advantages, mask)


def _reference(name, batch, config):
    """Each rule written with boolean masks and torch.where, as the formulas read."""
    m, mf = batch.mask, batch.mask.float()
    l = torch.where(m, batch.logprobs - batch.behaviour_logprobs, torch.zeros(()))
    n = mf.sum().clamp(min=1)
    s = l.sum(1)
    lengths = mf.sum(1)
    nonempty = lengths > 0
    metrics = {}

    def weight_metrics(w, clipped=None):
        metrics.update({"stability/is_weight_mean": w.sum() / n, "stability/is_weight_max": w.max()})
        if clipped is not None:
            metrics["stability/clip_frac"] = (clipped & m).sum() / n

    def seq_fraction(flags):
        return (flags & nonempty).sum() / nonempty.sum().clamp(min=1)

    if name == "tis_token":
        w = torch.exp(l.clamp(max=LOG(config.cap))) * mf
        weight_metrics(w, l > LOG(config.cap))
        return w, m, metrics
    if name in ("tis_seq", "vcpo"):
        w = torch.exp(s.clamp(max=LOG(config.cap)))[:, None] * mf
        weight_metrics(w, (s > LOG(config.cap))[:, None].expand_as(m))
        return w, m, metrics
    if name in ("mis_token", "mis_seq", "mis_geo", "icepop"):
        stat = {"mis_token": l, "icepop": l, "mis_seq": s[:, None], "mis_geo": (s / lengths.clamp(min=1))[:, None]}[
            name
        ]
        keep = ((stat >= LOG(config.low)) & (stat <= LOG(config.high))).expand_as(m) & m
        w = torch.exp(stat.clamp(max=LOG(config.high))) * keep
        weight_metrics(w)
        metrics["stability/mask_frac"] = 1 - keep.sum() / n
        if name == "icepop":
            return w, m, metrics
        metrics["stability/seq_mask_frac"] = seq_fraction((m & ~keep).any(1))
        return w, keep, metrics
    if name == "opsm":
        drop = (batch.seq_advantages < 0) & (-s / lengths.clamp(min=1) > config.delta)
        w = mf * ~drop[:, None]
        metrics = {"stability/mask_frac": (mf - w).sum() / n, "stability/seq_mask_frac": seq_fraction(drop)}
        return w, m, metrics
    if name == "cispo":
        low, high = max(0.0, 1 - config.eps_low), 1 + config.eps_high
        w = torch.exp(l.clamp(max=LOG(high))).clamp(min=low) * mf
        weight_metrics(w, (l > LOG(high)) | (l < (LOG(low) if low > 0 else -math.inf)))
        return w, m, metrics
    if name == "ppo_clip":
        a = batch.token_advantages
        r = torch.exp(l.clamp(max=20.0))
        clipped = ((a > 0) & (l > LOG(1 + config.eps_high))) | (
            (a < 0) & ((l < LOG(1 - config.eps_low)) | (l > LOG(config.dual_clip_c)))
        )
        w = torch.where(clipped | ~m, torch.zeros(()), r)
        return w, m, {"stability/clip_frac": (clipped & m).sum() / n}
    raise KeyError(name)


PARITY_CASES = [
    ("tis_token", {}),
    ("tis_token", {"cap": 0.8}),
    ("tis_seq", {}),
    ("vcpo", {}),
    ("mis_token", {}),
    ("mis_token", {"low": 1.1, "high": 3.0}),
    ("mis_seq", {"low": 0.2, "high": 5.0}),
    ("mis_geo", {"low": 0.8, "high": 1.2}),
    ("icepop", {}),
    ("icepop", {"low": 1.1, "high": 2.0}),
    ("opsm", {}),
    ("cispo", {}),
    ("cispo", {"eps_low": 0.5}),
    ("ppo_clip", {}),
    ("ppo_clip", {"dual_clip_c": 0.9}),
]


@pytest.mark.parametrize("name, config", PARITY_CASES)
@pytest.mark.parametrize("seed, seq_advantages", [(0, True), (1, False), (2, True)])
def test_float_arithmetic_matches_the_boolean_formulas(name, config, seed, seq_advantages):
    batch = _parity_batch(seed, seq_advantages)
    stabilizer = registry.build(name, **config)
    out = stabilizer.token_weights(batch)
    weights, mask, metrics = _reference(name, batch, stabilizer.config)
    torch.testing.assert_close(out.weights, weights, rtol=2e-7, atol=0.0)  # a cap may differ by its last bit
    assert torch.equal(out.mask.bool(), mask.bool())
    assert set(out.metrics) == set(metrics)
    for key, value in metrics.items():
        assert float(out.metrics[key]) == pytest.approx(float(value), rel=1e-6, abs=1e-7), key


# ---- shared batch helpers ----


def test_batch_ratio_is_the_capped_exp_on_loss_tokens_and_zero_on_padding():
    batch = _parity_batch(3, True)
    expected = torch.where(batch.mask, torch.exp(batch.log_ratio.clamp(max=20.0)), torch.zeros(()))
    assert torch.equal(batch.ratio, expected)
    assert torch.isfinite(batch.ratio).all() and torch.equal(batch.mask_float, batch.mask.float())


def test_zero_outside_selects_bit_for_bit_like_where():
    from algorithms.batch import zero_outside

    values = torch.tensor([[1.5, -0.0, math.nan, math.inf], [-math.inf, math.nan, -2.0, 3.0]])
    mask = torch.tensor([[True, True, False, False], [False, True, True, False]])
    for dtype in (torch.float32, torch.float64):
        got = zero_outside(values.to(dtype), mask)
        expected = torch.where(mask, values.to(dtype), torch.zeros((), dtype=dtype))
        assert got.dtype == dtype
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(expected, nan=7.0))
        assert torch.equal(torch.signbit(got[~got.isnan()]), torch.signbit(expected[~expected.isnan()]))


def test_float_indicator_helpers():
    from algorithms.batch import count_above, outside_band, zero_where_set

    values = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0])
    assert count_above(values, 0.5).item() == 2.0
    assert outside_band(values, -1.0, 1.0).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    flags = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    ratio = torch.tensor([4.0, 2.0, 1e30, 0.5, 0.0, 7.0])
    kept = zero_where_set(ratio, flags)
    assert kept.data_ptr() == flags.data_ptr()  # written over the flags, no new tensor
    assert torch.equal(kept, torch.tensor([0.0, 2.0, 1e30, 0.0, 0.0, 7.0]))


def test_stabilizers_see_per_token_behaviour_log_probs_only_so_mixed_version_sequences_are_exact():
    """A response whose tokens were sampled by several policy versions (weights updated mid-response) has the
    behaviour probability prod_t mu_{v(t)}(y_t): the product of each version's segment. The generator records
    each token's log-prob under the weights that sampled it, and a stabilizer sees only those per-token values
    (PolicyBatch carries no version), so a sequence-level correction is the product of the segments' ratios."""
    assert "version" not in {f.name for f in dataclasses.fields(PolicyBatch)}
    torch.manual_seed(0)
    learner = torch.log_softmax(torch.randn(6, 5), -1)[:, 0].unsqueeze(0)  # log pi of 6 sampled tokens
    by_v0 = torch.log_softmax(torch.randn(6, 5), -1)[:, 0]  # the token's log-prob under version 0
    by_v1 = torch.log_softmax(torch.randn(6, 5), -1)[:, 0]  # and under version 1
    mixed = torch.cat([by_v0[:4], by_v1[4:]]).unsqueeze(0)  # version 0 sampled tokens 0-3, version 1 tokens 4-5
    batch = PolicyBatch(learner, mixed, torch.ones(1), torch.ones(1, 6, dtype=torch.bool))
    segments = [(learner[0, :4] - by_v0[:4]).sum(), (learner[0, 4:] - by_v1[4:]).sum()]
    sequence_ratio = math.exp(sum(float(s) for s in segments))  # product of the two versions' ratios
    tis = _weights("tis_seq", batch, cap=1e6).weights
    assert torch.allclose(tis, torch.full((1, 6), sequence_ratio), rtol=1e-5)
    geometric = math.exp(sum(float(s) for s in segments) / 6)
    gspo = _weights("gspo", batch, eps_low=10.0, eps_high=10.0).weights  # clip far away: the ratio itself
    assert torch.allclose(gspo, torch.full((1, 6), geometric), rtol=1e-5)
    kept = _weights("mis_seq", batch, low=sequence_ratio / 2, high=sequence_ratio * 2)
    assert bool(kept.mask.all()) and torch.allclose(kept.weights, torch.full((1, 6), sequence_ratio), rtol=1e-5)
    dropped = _weights("mis_seq", batch, low=sequence_ratio * 1.01, high=sequence_ratio * 2)
    assert not bool(dropped.mask.bool().any())


def test_a_stabilizer_is_built_from_its_validated_config_as_it_is():
    config = STABILIZER_CONFIGS["m2po"](tau=0.07)
    built = registry.from_config("m2po", config)
    assert built.config is config and registry.from_config("m2po", None).config == STABILIZER_CONFIGS["m2po"]()
    with pytest.raises(TypeError, match="stabilizer 'vcpo' takes"):
        registry.from_config("vcpo", config)
