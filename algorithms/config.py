"""Typed stabilizer configs with the reference defaults (formulas and sources: docs/stabilizers.md).

Standard library only: the job schema in `cluster/` builds its pydantic models from these
dataclasses, so a job can be validated without importing torch. Each field's `doc` metadata is the
text the job schema shows for it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal, TypeVar

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]
KLEstimator = Literal["k1", "k2", "k3", "low_var", "k3+", "low_var+"]  # algorithms/regularizers.py KL_TERMS

# Log-ratios are clamped to this bound before exp, as verl's rollout correction does; exp(20) ~ 4.9e8
# stays finite in fp32 while any weight beyond it is already capped or masked by every stabilizer.
LOG_RATIO_BOUND = 20.0


T = TypeVar("T")


def config_field(text: str, default: T, **bounds: float) -> T:
    """A field with the text the job schema shows for it and the bounds (gt, ge, lt, le) its value must keep."""
    return field(default=default, metadata={"doc": text, "bounds": bounds})


_BOUND_TESTS = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}


class CheckedConfig:
    """Refuses, on construction, values outside their fields' bounds or pairs in `ORDERED` out of order.

    A bad value would otherwise surface steps into a run (a log of 0, a bound walk that never ends).
    Every problem is reported at once, each naming its field; the job schema reports them under the
    section's path.
    """

    ORDERED: ClassVar[tuple[tuple[str, str], ...]] = ()  # (a, b): a must not exceed b

    def __post_init__(self) -> None:
        found = self.problems()
        if found:
            raise ValueError("; ".join(found))

    def problems(self) -> list[str]:
        """What is wrong with these values; a subclass adds its checks across fields."""
        found = []
        for item in fields(self):  # type: ignore[arg-type]
            value = getattr(self, item.name)
            if value is None:  # an optional field left unset
                continue
            for rule, bound in item.metadata.get("bounds", {}).items():
                test, symbol = _BOUND_TESTS[rule]
                if not test(value, bound):
                    found.append(f"{item.name} must be {symbol} {bound}, got {value}")
        for first, second in self.ORDERED:
            if not getattr(self, first) <= getattr(self, second):
                found.append(f"{first} ({getattr(self, first)}) must not exceed {second} ({getattr(self, second)})")
        return found


@dataclass(frozen=True)
class NoneConfig(CheckedConfig):
    """On-policy REINFORCE/GRPO: behaviour log-probs are ignored (the synchronous baseline)."""


@dataclass(frozen=True)
class PPOClipConfig(CheckedConfig):
    """Token PPO clipped surrogate against the behaviour policy, with dual clip for A < 0."""

    eps_low: float = config_field("lower clip: ratios below 1 - eps_low get no gradient when A < 0", 0.2, ge=0)
    eps_high: float = config_field("upper clip: ratios above 1 + eps_high get no gradient when A > 0", 0.2, ge=0)
    dual_clip_c: float = config_field("dual clip for A < 0: ratios above c get no gradient (verl 3.0)", 3.0, gt=0)


@dataclass(frozen=True)
class TISConfig(CheckedConfig):
    """Truncated importance sampling: detached weight min(ratio, cap)."""

    cap: float = config_field("truncation cap C on the importance weight (verl/slime default 2.0)", 2.0, gt=0)


@dataclass(frozen=True)
class MISConfig(CheckedConfig):
    """Masked importance sampling: weight = ratio inside [low, high], else the unit is masked out."""

    ORDERED = (("low", "high"),)

    low: float = config_field("lower bound on the ratio statistic; below it the unit is masked", 0.5, gt=0)
    high: float = config_field("upper bound on the ratio statistic; above it the unit is masked", 2.0, gt=0)


@dataclass(frozen=True)
class MISGeoConfig(CheckedConfig):
    """Geometric-mean sequence masking: bounds must hug 1 (per-token drift compounds)."""

    ORDERED = (("low", "high"),)

    low: float = config_field("lower bound on exp(mean_t log-ratio)", 0.999, gt=0)
    high: float = config_field("upper bound on exp(mean_t log-ratio)", 1.001, gt=0)


@dataclass(frozen=True)
class IcePopConfig(CheckedConfig):
    """IcePop: token weight = ratio inside [low, high], else 0; the token stays in the denominator."""

    ORDERED = (("low", "high"),)

    low: float = config_field("alpha: lower ratio bound (verl/OpenRLHF default 0.5)", 0.5, gt=0)
    high: float = config_field("beta: upper ratio bound (verl/OpenRLHF default 5.0)", 5.0, gt=0)


@dataclass(frozen=True)
class OPSMConfig(CheckedConfig):
    """DeepSeek-V3.2 off-policy sequence masking of negative-advantage sequences."""

    delta: float = config_field("mask when A < 0 and mean_t log(mu / pi) exceeds delta (slime 1e-4)", 1e-4, ge=0)


@dataclass(frozen=True)
class TOPRConfig(CheckedConfig):
    """Tapered off-policy REINFORCE: no IS weight for A >= 0, truncated sequence weight for A < 0."""

    cap: float = config_field("truncation of the sequence IS weight of A < 0 samples (the paper's [0, 1])", 1.0, gt=0)


@dataclass(frozen=True)
class M2POConfig(CheckedConfig):
    """Second-moment trust region (M2PO)."""

    tau: float = config_field("second-moment budget: mean (log r)^2 over trust-region tokens", 0.04, ge=0)
    mode: Literal["mask", "adaptive_clip"] = config_field(
        "mask: the paper's Algorithm 1; adaptive_clip: the released code's clip range", "mask"
    )


@dataclass(frozen=True)
class GSPOConfig(CheckedConfig):
    """Group sequence policy optimisation: clipped geometric-mean sequence ratio."""

    eps_low: float = config_field("lower clip on the geometric sequence ratio", 3e-4, ge=0)
    eps_high: float = config_field("upper clip on the geometric sequence ratio", 4e-4, ge=0)


@dataclass(frozen=True)
class CISPOConfig(CheckedConfig):
    """CISPO: detached clipped token weight, so clipped tokens still get gradient."""

    eps_low: float = config_field("weight floor is max(0, 1 - eps_low); 10 means no floor", 10.0, ge=0)
    eps_high: float = config_field("weight ceiling 1 + eps_high", 0.2, ge=0)


@dataclass(frozen=True)
class BAPOConfig(CheckedConfig):
    """BAPO: PPO clip with bounds adapted each step until positive tokens hold a target share."""

    ORDERED = (("clip_low_min", "clip_low_max"), ("clip_high_min", "clip_high_max"))

    positive_share: float = config_field(
        "rho_0: target share of the positive-advantage tokens in the total loss contribution", 0.5, ge=0, le=1
    )
    clip_low_min: float = config_field("a-: lowest lower ratio bound", 0.6, gt=0)
    clip_low_max: float = config_field("b-: highest lower ratio bound", 0.9)
    clip_high_min: float = config_field("a+: lowest upper ratio bound", 1.2, gt=0)
    clip_high_max: float = config_field("b+: highest upper ratio bound", 3.0)
    step: float = config_field("increment of each bound per adaptation move", 0.05, gt=0)
    dual_clip_c: float = config_field("dual clip for A < 0", 3.0, gt=0)


@dataclass(frozen=True)
class VCPOConfig(CheckedConfig):
    """VCPO: seq-TIS base loss, ESS-scaled learning rate and the off-policy optimal baseline."""

    cap: float = config_field("sequence TIS cap C of the base loss (official scripts: 8)", 8.0, gt=0)
    rho_on: float = config_field("on-policy reference ESS ratio; LR shrinks when ESS ratio is below it", 1.0, gt=0)
    lr_rule: Literal["sqrt", "linear"] = config_field("LR factor sqrt(s) or s, s = min(1, ess/rho_on)", "sqrt")
    ess_from_clipped: bool = config_field("compute the ESS from capped weights (official default: no)", False)
    use_baseline: bool = config_field("replace the group mean with the off-policy optimal baseline", True)
    baseline_is_weight: Literal["once", "twice"] = config_field(
        "once: W = w^2 |grad log pi|^2 (paper); twice: also min(w, C)^2 (official code)", "once"
    )
    normalize_by_length: bool = config_field("divide the baseline weight by T_i^2", False)
    norm_by_std: bool = config_field("divide advantages by the group reward std (official scripts: yes)", True)
    opob_impl: Literal["auto", "bookkeeping", "ghost", "per_sample_loop"] = config_field(
        "how the learner gets per-sample gradient norms: bookkeeping (one backward; the update is formed from "
        "the per-sample gradients it keeps, which grow with rows x parameters), ghost (a norms-only backward, "
        "then the loss backward: memory of one backward), auto (bookkeeping for each micro-batch whose kept "
        "gradients fit bookkeeping_budget_mb, else ghost) or per_sample_loop (one backward per sample, the "
        "reference)",
        "auto",
    )
    bookkeeping_budget_mb: float | Literal["auto"] = config_field(
        "opob_impl auto: the most memory (MiB) a micro-batch's kept per-sample gradients may take for "
        "book-keeping; auto: half of what the rank's device has for a step once the model and optimizer are "
        "placed, and no more than what each micro-batch's own tokens leave (the run's log gives the figures)",
        "auto",
    )

    def problems(self) -> list[str]:
        found = super().problems()
        budget = self.bookkeeping_budget_mb
        if budget != "auto" and not (isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0):
            found.append(f"bookkeeping_budget_mb must be auto or a number of MiB > 0, got {budget!r}")
        return found


STABILIZER_CONFIGS: dict[str, type] = {
    "none": NoneConfig,
    "ppo_clip": PPOClipConfig,
    "tis_token": TISConfig,
    "tis_seq": TISConfig,
    "mis_token": MISConfig,
    "mis_seq": MISConfig,
    "mis_geo": MISGeoConfig,
    "icepop": IcePopConfig,
    "opsm": OPSMConfig,
    "topr": TOPRConfig,
    "m2po": M2POConfig,
    "gspo": GSPOConfig,
    "cispo": CISPOConfig,
    "bapo": BAPOConfig,
    "vcpo": VCPOConfig,
}
"""Config class per stabilizer name; `algorithms.registry` checks that it covers every stabilizer."""
