"""Stability alerts: ESS collapse, entropy collapse, gradient-norm spikes and groups without learning signal,
from each RL step's metrics.

Pure Python (no W&B, torch or ray) so each rule is tested on hand-made sequences; `MetricSink` raises
what `StabilityAlerts.check` returns. A rule alerts once when its condition starts, not on every
step while it lasts, and again only after it has cleared and come back: an alert is news, and a
collapse that lasts a thousand steps must not bury the other alerts.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

ESS_KEY = "stability/ess_ratio"
ENTROPY_KEY = "stability/entropy"
GRAD_NORM_KEY = "optim/grad_norm"
ZERO_STD_KEY = "rollout/zero_std_share"


class AlertThresholds(Protocol):
    """What the rules read: `logging.alerts` of the job file (`cluster.job.AlertsSection`) fits."""

    @property
    def ess_ratio_below(self) -> float | None: ...

    @property
    def ess_collapse_steps(self) -> int: ...

    @property
    def entropy_below(self) -> float | None: ...

    @property
    def entropy_collapse_steps(self) -> int: ...

    @property
    def grad_norm_above(self) -> float | None: ...

    @property
    def grad_norm_spike_factor(self) -> float | None: ...

    @property
    def grad_norm_window_steps(self) -> int: ...

    @property
    def zero_std_share_above(self) -> float | None: ...

    @property
    def zero_std_steps(self) -> int: ...


@dataclass(frozen=True)
class Alert:
    """One alert to raise: a short title (W&B wants under 64 characters) and the text saying why."""

    title: str
    text: str


class ThresholdStreak:
    """A metric below a threshold (or NaN) for N steps in a row: fires on the step the streak reaches N, once.
    `high`: above the threshold instead (a NaN then breaks the streak)."""

    def __init__(
        self, key: str, bound: float | None, steps: int, title: str, setting: str, advice: str, high: bool = False
    ) -> None:
        self.key, self.bound, self.steps, self.high = key, bound, steps, high
        self.title, self.setting, self.advice = title, setting, advice
        self.streak = 0

    def check(self, step: int, value: float) -> list[Alert]:
        if self.bound is None:
            return []
        if self.high:
            out = math.isfinite(value) and value > self.bound
        else:
            out = not math.isfinite(value) or value < self.bound
        self.streak = self.streak + 1 if out else 0
        if self.streak != self.steps:
            return []
        side = f"above {self.bound:g}" if self.high else f"below {self.bound:g} (or NaN)"
        return [
            Alert(
                self.title,
                f"step {step}: {self.key} = {value:.3g}, {side} for "
                f"{self.steps} step(s) in a row (logging.alerts.{self.setting}); {self.advice}",
            )
        ]


class StabilityAlerts:
    """The ESS-collapse, entropy-collapse, no-signal and gradient-norm-spike rules, with the state they keep
    between steps."""

    def __init__(self, thresholds: AlertThresholds) -> None:
        self.thresholds = thresholds
        self.streaks = [
            ThresholdStreak(
                ESS_KEY,
                thresholds.ess_ratio_below,
                thresholds.ess_collapse_steps,
                "ESS collapse",
                "ess_ratio_below",
                "the rollouts are too off-policy for the stabilizer: lower async.max_lag or the learning rate",
            ),
            ThresholdStreak(
                ENTROPY_KEY,
                thresholds.entropy_below,
                thresholds.entropy_collapse_steps,
                "entropy collapse",
                "entropy_below",
                "the policy has stopped exploring, so rewards will stop improving: lower "
                "the learning rate, raise generator.temperature, or use a clip-higher stabilizer",
            ),
            ThresholdStreak(
                ZERO_STD_KEY,
                thresholds.zero_std_share_above,
                thresholds.zero_std_steps,
                "no learning signal",
                "zero_std_share_above",
                "most prompt groups score every response the same, so they have no advantage and the steps learn "
                "little: the problems are too easy or too hard for the policy (change the data or the warm-up), "
                "raise generator.samples_per_prompt, or set algorithm.drop_uniform_groups",
                high=True,
            ),
        ]
        self.spiking = False  # whether the previous step with a grad norm was a spike
        self.recent_grad_norms: deque[float] = deque(maxlen=thresholds.grad_norm_window_steps)

    def check(self, step: int, metrics: Mapping[str, Any]) -> list[Alert]:
        """The alerts this step starts. A step without a metric leaves that rule's state unchanged."""
        alerts = []
        for streak in self.streaks:
            value = _number(metrics.get(streak.key))
            if value is not None:
                alerts += streak.check(step, value)
        grad_norm = _number(metrics.get(GRAD_NORM_KEY))
        if grad_norm is not None:
            alerts += self._check_grad_norm(step, grad_norm)
        return alerts

    def _check_grad_norm(self, step: int, grad_norm: float) -> list[Alert]:
        above, factor = self.thresholds.grad_norm_above, self.thresholds.grad_norm_spike_factor
        if above is None and factor is None:
            return []
        reason = self._spike_reason(grad_norm, above, factor)
        if math.isfinite(grad_norm):
            self.recent_grad_norms.append(grad_norm)  # spikes too: a lasting new level becomes the baseline
        started = reason is not None and not self.spiking
        self.spiking = reason is not None
        if not started:
            return []
        return [Alert("gradient-norm spike", f"step {step}: {GRAD_NORM_KEY} = {grad_norm:.4g}, {reason}")]

    def _spike_reason(self, grad_norm: float, above: float | None, factor: float | None) -> str | None:
        """Why this grad norm is a spike, or None. The relative rule needs a full window of earlier
        steps and a positive median (GRPO steps with all-equal rewards have zero gradient)."""
        if not math.isfinite(grad_norm):
            return "not finite"
        if above is not None and grad_norm > above:
            return f"above logging.alerts.grad_norm_above = {above:g}"
        window = self.recent_grad_norms
        if factor is None or len(window) < (window.maxlen or 0):
            return None
        median = statistics.median(window)
        if median > 0 and grad_norm > factor * median:
            return (
                f"{grad_norm / median:.1f} times the median {median:.4g} of the previous {len(window)} steps "
                f"(logging.alerts.grad_norm_spike_factor = {factor:g})"
            )
        return None


def _number(value: Any) -> float | None:
    """A metric value as a float; None for anything that is not a number (lists are histograms)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
