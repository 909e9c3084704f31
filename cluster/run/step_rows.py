"""What the loop counts between step rows and how it reports it: the responses scored, the generators' calls,
the versions and lags of the trained tokens. Plain records and functions (they start no actor and call no Ray
API), tested without a cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.buffer import ScoredGroup
from actors.generator import GeneratedGroup
from algorithms.diagnostics import lag_stats
from cluster.job import AlgorithmSection, ScoringSection
from cluster.run.rewards import REWARD_METRICS
from tasks.environment import EpisodeStats
from tasks.records import ScoredCompletion


@dataclass
class ScoredSinceStep:
    """The responses scored since the last step row, trained or not: that row reports them, then they start over."""

    rewards: list[float] = field(default_factory=list)  # as trained on: the verifier's, plus any overlong penalty
    overlong_penalties: list[float] = field(default_factory=list)
    truncated: int = 0  # responses the generator cut off at max_new_tokens
    score_errors: int = 0  # responses whose verifier failed (raised, hung, returned no finite number)
    uniform_groups_dropped: int = 0  # by algorithm.drop_uniform_groups
    components: dict[str, list[float]] = field(default_factory=dict)  # scoring.rewards: each kind's scores
    episodes: EpisodeStats = field(default_factory=EpisodeStats)  # tool episodes (environment.tools)

    def record(
        self, completions: list[ScoredCompletion], penalties: list[float], components: dict[str, list[float]]
    ) -> None:
        """One scored group's responses: their rewards as trained on (overlong `penalties` included), failures,
        truncations, each reward component's scores and tool episodes."""
        self.score_errors += sum(c["score_error"] is not None for c in completions)
        self.rewards += [c["reward"] for c in completions]
        self.overlong_penalties += penalties
        for name, scores in components.items():
            self.components.setdefault(name, []).extend(scores)
        self.truncated += sum(c["finish_reason"] == "length" for c in completions)
        self.episodes.add(completions)

    def record_group_kept(self, kept: bool) -> None:
        """Whether the rollout buffer kept the group (algorithm.drop_uniform_groups drops uniform ones)."""
        self.uniform_groups_dropped += not kept

    def metrics(
        self, algorithm: AlgorithmSection, scoring: ScoringSection | None = None, tool_episodes: bool = False
    ) -> dict[str, float]:
        """`rollout/*` keys of the step row; those of options the job leaves off are not logged (`tool_episodes`:
        the job has `environment.tools`), nor a mean with nothing to average since the last row (no NaN)."""

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else math.nan

        scored = len(self.rewards)
        row = {
            "rollout/truncated_share": self.truncated / scored if scored else math.nan,
            "rollout/score_errors": self.score_errors if scored else math.nan,
        }
        if algorithm.drop_uniform_groups:
            row["rollout/scored_reward_mean"] = mean(self.rewards)
            row["rollout/uniform_groups_dropped"] = self.uniform_groups_dropped
        if algorithm.overlong_buffer_tokens:
            row["rollout/overlong_penalty_mean"] = mean(self.overlong_penalties)
        for section in (scoring.rewards if scoring else None) or []:  # none: nothing scored since, or all failed
            row[REWARD_METRICS[section.name]] = mean(self.components.get(section.name, []))
        row |= self.episodes.metrics() if tool_episodes else {}
        return {key: value for key, value in row.items() if not math.isnan(value)}


@dataclass
class GenerationTotals:
    """What the generators reported with their calls, over the run and since the last step row."""

    tokens: int = 0  # over every generate call of this run
    generate_s: float = 0.0  # seconds with a call running, summed over generators
    weight_loads: int = 0  # generators' own weight loads
    weight_load_s: float = 0.0
    busy_s_since_step: float = 0.0  # seconds with a call or a weight load running, reported since the last step row

    def add(self, groups: list[GeneratedGroup]) -> None:
        """A call's groups carry the call's own timing in the first one."""
        if not groups:
            return
        self.generate_s += groups[0].generate_s
        self.weight_loads += groups[0].weight_loads
        self.weight_load_s += groups[0].weight_load_s
        self.busy_s_since_step += groups[0].busy_s
        self.tokens += sum(len(c["completion_ids"]) for g in groups for c in g.completions)

    def metrics(self, generators: int) -> dict[str, float]:
        """The generators' keys of the step row, for `generators` running now."""
        return {
            "perf/weight_load_s": self.weight_load_s / self.weight_loads if self.weight_loads else math.nan,
            # one generator's mean rate over all calls so far, times the generators running now
            "perf/gen_tokens_per_s": self.tokens / self.generate_s * generators if self.generate_s else math.nan,
            "time/generator_busy_s": self.busy_s_since_step,
        }


def version_mix(groups: list[ScoredGroup], learner_version: int) -> dict[str, float | list[int]]:
    """`async/token_lag` (trained tokens per lag: learner version minus the version that sampled the token)
    and `async/mixed_version_share` (responses sampled by more than one version: weights changed mid-way)."""
    counts: list[int] = []
    mixed = responses = 0
    for group in groups:
        for completion in group.completions:
            spans = completion["version_spans"]
            responses += 1
            mixed += len({span[0] for span in spans}) > 1
            for version, start, end in spans:
                lag = learner_version - version
                counts.extend([0] * (lag + 1 - len(counts)))
                counts[lag] += end - start
    return {"async/token_lag": counts, "async/mixed_version_share": mixed / responses if responses else math.nan}


def lag_metrics(lags: list[int], max_lag: int) -> dict[str, Any]:
    """`async/lag_*` of the step row: the trained groups' lags (learner version minus sampling version)."""
    stats = lag_stats(torch.tensor(lags), max_lag)
    return {
        "async/lag_mean": float(stats["lag_mean"]),
        "async/lag_max": float(stats["lag_max"]),
        "async/lag": [int(c) for c in stats["lag_hist"].tolist()],
    }
