"""The discrete-event model behind `stableasync simulate`: the asynchronous loop on simulated time, apart
from the calibration and printing around it so that the model can be read (and tested) on its own.

It drives the driver's own schedule (`cluster/run/schedule.py`) on simulated time instead of Ray: the
same turn (issue generation to every idle generator while the buffer admits, start a learner step when
a batch is ready, then handle the earliest completion), the same admission, stale drops and versions,
and a blocking weight publish after each step (which, for a collective publish, first waits for every
generator's current call). Costs are per-token rates and fixed overheads; responses are drawn from a
seeded length distribution. Standard library only (and the buffer and schedule), so it runs anywhere in
about a second. The model and its assumptions: docs/simulator.md.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from actors.buffer import FixedLag, Ledger, RolloutBuffer, ScoredGroup
from algorithms.config import CheckedConfig, config_field
from cluster.run.schedule import Call, Schedule, SchedulerStuck


@dataclass(frozen=True)
class SimConfig(CheckedConfig):
    """One asynchronous setting and its costs. Defaults: an illustrative ~1.5B model on H100-class GPUs,
    not a measurement; `--calibrate` derives the costs from a real run instead."""

    generators: int = config_field("G: generator GPUs, one engine each (generator.num_generators)", 4, gt=0)
    learners: int = config_field(
        "L: learner GPUs (learner.num_ranks); a step's tokens are split evenly over them", 2, gt=0
    )
    max_lag: int = config_field(
        "async.max_lag: learner version minus rollout version allowed at train time; 0 is synchronous", 1, ge=0
    )
    stale_policy: Literal["wait", "drop"] = config_field(
        "async.stale_policy: throttle generation (wait) or drop stale groups", "wait"
    )
    fixed_lag: int | None = config_field(
        "async.fixed_lag: every group trains exactly this many versions stale (needs max_lag at least as large)",
        None,
        ge=0,
    )
    samples_per_prompt: int = config_field("responses per prompt group (generator.samples_per_prompt)", 8, gt=0)
    prompts_per_request: int = config_field(
        "prompt groups one generate call samples (generator.prompts_per_request)", 16, gt=0
    )
    prompts_per_step: int = config_field(
        "prompt groups one learner step trains on (learner.prompts_per_step)", 64, gt=0
    )
    steps: int = config_field("learner steps to simulate", 200, gt=0)
    response_len_mean: float = config_field("mean response length, tokens (before the cap)", 1024.0, gt=0)
    response_len_cv: float = config_field(
        "coefficient of variation of the log-normal response length; 0: every response is the mean", 0.6, ge=0
    )
    max_response_len: int = config_field("cap on a response, tokens (generator.max_new_tokens)", 4096, gt=0)
    prompt_len: float = config_field("prompt tokens per sample; costs the learner only", 256.0, ge=0)
    gen_tokens_per_s: float = config_field(
        "generation throughput of one generator GPU, generated tokens per second", 6000.0, gt=0
    )
    gen_decode_step_s: float = config_field(
        "seconds per decode step of a call's longest response (the straggler tail)", 0.006, ge=0
    )
    gen_call_overhead_s: float = config_field(
        "fixed seconds per generate call (scheduling, prefill, transfer)", 0.5, ge=0
    )
    gen_weight_load_s: float = config_field(
        "seconds a generator spends loading each new weight version into its engine, before its next call "
        "(object-store sync; a collective publish includes the load in sync_s instead)",
        0.0,
        ge=0,
    )
    learner_tokens_per_s: float = config_field(
        "training throughput of one learner GPU, prompt + response tokens per second", 12000.0, gt=0
    )
    learner_overhead_s: float = config_field(
        "fixed seconds per learner step (optimizer step, collectives, dispatch)", 1.0, ge=0
    )
    sync_fixed_s: float = config_field("fixed seconds per weight publish", 0.5, ge=0)
    weight_bytes: float = config_field(
        "bytes of weights published per step (1.5B parameters in bf16: 3.1e9)", 3.1e9, ge=0
    )
    sync_bytes_per_s: float = config_field("weight publish bandwidth, bytes per second", 10e9, gt=0)
    sync_waits_for_generation: bool = config_field(
        "a collective publish (weight_sync nccl/gloo) starts only when every generator has finished its current call",
        False,
    )
    step_end_barrier: bool = config_field(
        "the driver waits for every generator's current call at the end of each step "
        "(what it did before generate results carried their own timing)",
        False,
    )
    seed: int = config_field("seed of the response lengths", 0)

    def problems(self) -> list[str]:
        found = super().problems()
        if self.stale_policy not in ("wait", "drop"):
            found.append(f"stale_policy must be 'wait' or 'drop', got {self.stale_policy!r}")
        if self.learners > 0 and self.prompts_per_step % self.learners:
            found.append(f"prompts_per_step ({self.prompts_per_step}) must divide evenly over {self.learners} learners")
        if self.fixed_lag is not None and (self.fixed_lag > self.max_lag or self.stale_policy != "wait"):
            found.append(f"fixed_lag ({self.fixed_lag}) needs max_lag at least as large and stale_policy 'wait'")
        return found

    @property
    def sync_s(self) -> float:
        """Seconds one weight publish blocks the driver."""
        return self.sync_fixed_s + self.weight_bytes / self.sync_bytes_per_s


CONFIG_FIELDS = tuple(f.name for f in fields(SimConfig))  # the CLI's flags that override a setting


@dataclass(frozen=True)
class SimResult:
    """What one simulated run predicts. `step_s` is wall-clock per learner step (the cadence that sets
    training time); `logged_step_s` is what the driver logs as `time/step_s` (learner start to publish end)."""

    config: SimConfig
    step_s: tuple[float, ...]  # time between consecutive step ends; the first is from t = 0 (pipeline fill)
    logged_step_s: tuple[float, ...]
    generator_utilisation: float  # busy generator-seconds / (G x run time)
    learner_utilisation: float  # seconds the learner trains / run time (weight publish not counted)
    lag_counts: tuple[int, ...]  # trained responses per lag 0, 1, ..., as the driver's `async/lag`
    dropped_groups: int
    gen_call_s_mean: float
    gen_s_per_group: float  # generator-seconds per prompt group, over all calls
    learner_s_mean: float
    run_s: float

    @property
    def steady_step_s(self) -> tuple[float, ...]:
        """Step times without the first step's pipeline fill (calibration drops it from measurements too)."""
        return self.step_s[1:] if len(self.step_s) > 1 else self.step_s

    @property
    def step_s_mean(self) -> float:
        return statistics.fmean(self.steady_step_s)

    @property
    def step_s_median(self) -> float:
        return statistics.median(self.steady_step_s)

    @property
    def logged_step_s_mean(self) -> float:
        return statistics.fmean(self.logged_step_s)

    @property
    def lag_mean(self) -> float:
        total = sum(self.lag_counts)
        return sum(lag * count for lag, count in enumerate(self.lag_counts)) / total if total else math.nan

    @property
    def ideal_step_s(self) -> float:
        """Perfect overlap: every generator always busy, or the learner training and publishing back to back."""
        c = self.config
        return max(c.prompts_per_step * self.gen_s_per_group / c.generators, self.learner_s_mean + c.sync_s)

    def speedup_vs_sync(self) -> float:
        """How many times faster per step than the same setting run synchronously (max_lag 0)."""
        return simulate(synchronous(self.config)).step_s_mean / self.step_s_mean


@dataclass(frozen=True)
class _Request:
    """A simulated prompt group: its id and the length of each response it will get, in tokens."""

    group_id: int
    lengths: tuple[int, ...]
    problem_id: str = ""


@dataclass(eq=False)
class _Call:
    """One simulated generate call in flight (its own handle in the schedule)."""

    index: int
    requests: list[_Request]
    version: int
    start_s: float
    end_s: float
    order: int


@dataclass
class _Step:
    start_s: float
    end_s: float


class _Simulation:
    """The driver's loop (`cluster/run/loop.py`) on a simulated clock, through the same schedule: `now` is
    the driver's time, which moves forward to the next completion and while the driver blocks (weight
    publish, end-of-step wait)."""

    def __init__(self, config: SimConfig) -> None:
        self.c = config
        self.rng = random.Random(config.seed)
        fixed = None if config.fixed_lag is None else FixedLag(config.fixed_lag, config.prompts_per_step, config.steps)
        buffer = RolloutBuffer(config.max_lag, config.prompts_per_step, config.stale_policy, Ledger(), fixed_lag=fixed)
        self.schedule: Schedule[_Request, _Call] = Schedule(
            buffer, config.prompts_per_request, self._new_request, self._send
        )
        for index in range(config.generators):
            self.schedule.join(index, 0)
        self.now = 0.0
        self.loaded_version = [0] * config.generators  # what each engine holds; a newer version loads first
        self.finished_calls: list[_Call] = []
        self.learner: _Step | None = None
        self.learner_busy_s: list[float] = []
        self.step_ends: list[float] = []
        self.logged: list[float] = []
        self.lag_counts = [0] * (config.max_lag + 1)  # grows if a lag ever exceeded the bound (tests: it never does)
        self.orders = 0
        sigma2 = math.log1p(config.response_len_cv**2)
        self.len_sigma = math.sqrt(sigma2)
        self.len_mu = math.log(config.response_len_mean) - sigma2 / 2

    def run(self) -> SimResult:
        while self.schedule.version < self.c.steps:
            self.schedule.issue()
            self._start_learner_step()
            self._handle_next()
        return self._result()

    def _response_len(self) -> int:
        c = self.c
        raw = c.response_len_mean if c.response_len_cv == 0 else self.rng.lognormvariate(self.len_mu, self.len_sigma)
        return min(c.max_response_len, max(1, round(raw)))

    def _new_request(self, group_id: int, generator_index: int) -> _Request:
        return _Request(group_id, tuple(self._response_len() for _ in range(self.c.samples_per_prompt)))

    def _send(self, call: Call[_Request]) -> _Call:
        """The engine loads newer weights first, then samples: overhead, the longest response's decode steps,
        and every token at the engine's throughput."""
        c = self.c
        lengths = [n for request in call.requests for n in request.lengths]
        load_s = c.gen_weight_load_s if self.loaded_version[call.index] < call.weights_version else 0.0
        self.loaded_version[call.index] = call.weights_version
        call_s = c.gen_call_overhead_s + max(lengths) * c.gen_decode_step_s + sum(lengths) / c.gen_tokens_per_s
        self.orders += 1
        return _Call(call.index, call.requests, call.weights_version, self.now, self.now + load_s + call_s, self.orders)

    def _learner_s(self, groups: list[ScoredGroup]) -> float:
        # a completion here is `_handle_generation`'s stand-in: its length only
        tokens = sum(
            self.c.prompt_len + c["tokens"]  # type: ignore[typeddict-item]
            for g in groups
            for c in g.completions
        )
        return self.c.learner_overhead_s + tokens / (self.c.learner_tokens_per_s * self.c.learners)

    def _start_learner_step(self) -> None:
        groups = self.schedule.take_batch()
        if groups is not None:
            self.learner = _Step(self.now, self.now + self._learner_s(groups))

    def _handle_next(self) -> None:
        """Like `ray.wait` on generate calls then the learner: of those already done, the first in that
        order; otherwise the one that finishes first."""
        candidates: list[tuple[float, int, int, Any]] = [
            (max(call.end_s, self.now), 0, call.order, call) for call in self.schedule.calls
        ]
        if self.learner is not None:
            candidates.append((max(self.learner.end_s, self.now), 1, 0, self.learner))
        if not candidates:
            raise SchedulerStuck("nothing to wait for: the buffer admits no generation and no batch is ready")
        when, _, _, event = min(candidates, key=lambda item: item[:3])
        self.now = when
        if isinstance(event, _Call):
            self._handle_generation(event)
        else:
            self._handle_learner(event)

    def _handle_generation(self, call: _Call) -> None:
        self.schedule.finished(call)
        self.finished_calls.append(call)
        for request in call.requests:
            # stand-ins for scored completions, with only what the simulator reads: the response's length
            completions: list[Any] = [{"tokens": n} for n in request.lengths]
            self.schedule.buffer.add(
                ScoredGroup(request.group_id, "", [], completions, call.version, call.version, call.index)
            )

    def _handle_learner(self, step: _Step) -> None:
        self.learner = None
        self.learner_busy_s.append(step.end_s - step.start_s)
        for lag in self.schedule.step_done():
            self.lag_counts.extend([0] * (lag + 1 - len(self.lag_counts)))
            self.lag_counts[lag] += 1
        in_flight_end = max((call.end_s for call in self.schedule.calls), default=self.now)
        if self.c.sync_waits_for_generation:  # each generator receives after its current call
            self.now = max(self.now, in_flight_end)
        self.now += self.c.sync_s
        self.schedule.published()
        self.logged.append(self.now - step.start_s)
        if self.c.step_end_barrier:
            self.now = max(self.now, in_flight_end)
        self.step_ends.append(self.now)

    def _result(self) -> SimResult:
        run_s = self.now
        calls = self.finished_calls + list(self.schedule.calls)
        gen_busy_s = sum(max(0.0, min(call.end_s, run_s) - call.start_s) for call in calls)
        previous = [0.0, *self.step_ends[:-1]]
        return SimResult(
            config=self.c,
            step_s=tuple(end - start for start, end in zip(previous, self.step_ends)),
            logged_step_s=tuple(self.logged),
            # min(): summing busy intervals can round a fully busy run to just above 1
            generator_utilisation=min(1.0, gen_busy_s / (self.c.generators * run_s)),
            learner_utilisation=min(1.0, sum(self.learner_busy_s) / run_s),
            lag_counts=tuple(self.lag_counts),
            dropped_groups=self.schedule.buffer.ledger.counts().get("dropped", 0),
            gen_call_s_mean=statistics.fmean(call.end_s - call.start_s for call in calls),
            gen_s_per_group=(
                sum(call.end_s - call.start_s for call in calls) / sum(len(call.requests) for call in calls)
            ),
            learner_s_mean=statistics.fmean(self.learner_busy_s),
            run_s=run_s,
        )


def synchronous(config: SimConfig) -> SimConfig:
    """The on-policy baseline of a setting: max_lag 0 under `wait` (under `drop` generators would run ahead)."""
    return replace(config, max_lag=0, stale_policy="wait", fixed_lag=None)


def simulate(config: SimConfig) -> SimResult:
    """Run the model once; the same config (seed included) always gives the same result."""
    return _Simulation(config).run()
