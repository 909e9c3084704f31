"""`stableasync simulate`: a discrete-event model of the asynchronous loop, to size a cluster before renting it.

It drives the driver's own schedule (`cluster/run/schedule.py`) on simulated time instead of Ray: the
same turn (issue generation to every idle generator while the buffer admits, start a learner step when
a batch is ready, then handle the earliest completion), the same admission, stale drops and versions,
and a blocking weight publish after each step (which, for a collective publish, first waits for every
generator's current call). Costs are per-token rates and fixed overheads; responses are drawn from a
seeded length distribution. Standard library only (and the buffer and schedule), so it runs anywhere in
about a second.

The model, its assumptions and the commands: docs/simulator.md.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from actors.buffer import Ledger, RolloutBuffer, ScoredGroup
from algorithms.config import CheckedConfig, config_field
from algorithms.errors import StableAsyncError
from cluster.run.schedule import Call, Schedule, SchedulerStuck
from cluster.telemetry.run_files import STEP_KEY, WALL_KEY, metric_number, read_jsonl_rows, read_run_job, step_rows


@dataclass(frozen=True)
class SimConfig(CheckedConfig):
    """One asynchronous setting and its costs. Defaults: an illustrative ~1.5B model on H100-class GPUs,
    not a measurement; `--calibrate` derives the costs from a real run instead."""

    generators: int = config_field("G: generator GPUs, one engine each (generator.num_generators)", 4, gt=0)
    learners: int = config_field(
        "L: learner GPUs (learner.num_ranks); a step's tokens are split evenly over them",
        2, gt=0,
    )
    max_lag: int = config_field(
        "async.max_lag: learner version minus rollout version allowed at train time; 0 is synchronous",
        1, ge=0,
    )
    stale_policy: Literal["wait", "drop"] = config_field(
        "async.stale_policy: throttle generation (wait) or drop stale groups",
        "wait",
    )
    samples_per_prompt: int = config_field("responses per prompt group (generator.samples_per_prompt)", 8, gt=0)
    prompts_per_request: int = config_field(
        "prompt groups one generate call samples (generator.prompts_per_request)",
        16, gt=0,
    )
    prompts_per_step: int = config_field(
        "prompt groups one learner step trains on (learner.prompts_per_step)",
        64, gt=0,
    )
    steps: int = config_field("learner steps to simulate", 200, gt=0)
    response_len_mean: float = config_field("mean response length, tokens (before the cap)", 1024.0, gt=0)
    response_len_cv: float = config_field(
        "coefficient of variation of the log-normal response length; 0: every response is the mean",
        0.6, ge=0,
    )
    max_response_len: int = config_field("cap on a response, tokens (generator.max_new_tokens)", 4096, gt=0)
    prompt_len: float = config_field("prompt tokens per sample; costs the learner only", 256.0, ge=0)
    gen_tokens_per_s: float = config_field(
        "generation throughput of one generator GPU, generated tokens per second",
        6000.0, gt=0,
    )
    gen_decode_step_s: float = config_field(
        "seconds per decode step of a call's longest response (the straggler tail)",
        0.006, ge=0,
    )
    gen_call_overhead_s: float = config_field(
        "fixed seconds per generate call (scheduling, prefill, transfer)",
        0.5, ge=0,
    )
    gen_weight_load_s: float = config_field(
        "seconds a generator spends loading each new weight version into its engine, before its next call "
        "(object-store sync; a collective publish includes the load in sync_s instead)",
        0.0, ge=0,
    )
    learner_tokens_per_s: float = config_field(
        "training throughput of one learner GPU, prompt + response tokens per second",
        12000.0, gt=0,
    )
    learner_overhead_s: float = config_field(
        "fixed seconds per learner step (optimizer step, collectives, dispatch)",
        1.0, ge=0,
    )
    sync_fixed_s: float = config_field("fixed seconds per weight publish", 0.5, ge=0)
    weight_bytes: float = config_field(
        "bytes of weights published per step (1.5B parameters in bf16: 3.1e9)",
        3.1e9, ge=0,
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
            found.append(f"prompts_per_step ({self.prompts_per_step}) must divide evenly over "
                         f"{self.learners} learners")
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
        buffer = RolloutBuffer(config.max_lag, config.prompts_per_step, config.stale_policy, Ledger())
        self.schedule: Schedule[_Request, _Call] = Schedule(buffer, config.prompts_per_request, self._new_request,
                                                            self._send)
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
        sigma2 = math.log1p(config.response_len_cv ** 2)
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
        return _Call(call.index, call.requests, call.weights_version, self.now, self.now + load_s + call_s,
                     self.orders)

    def _learner_s(self, groups: list[ScoredGroup]) -> float:
        # a completion here is `_handle_generation`'s stand-in: its length only
        tokens = sum(self.c.prompt_len + c["tokens"]  # type: ignore[typeddict-item]
                     for g in groups for c in g.completions)
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
            self.schedule.buffer.add(ScoredGroup(request.group_id, "", [], completions, call.version, call.version,
                                                 call.index))

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
        previous = [0.0] + self.step_ends[:-1]
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
            gen_s_per_group=(sum(call.end_s - call.start_s for call in calls)
                             / sum(len(call.requests) for call in calls)),
            learner_s_mean=statistics.fmean(self.learner_busy_s),
            run_s=run_s,
        )


def synchronous(config: SimConfig) -> SimConfig:
    """The on-policy baseline of a setting: max_lag 0 under `wait` (under `drop` generators would run ahead)."""
    return replace(config, max_lag=0, stale_policy="wait")


def simulate(config: SimConfig) -> SimResult:
    """Run the model once; the same config (seed included) always gives the same result."""
    return _Simulation(config).run()


# ---- the VCPO paper's setting --------------------------------------------------------------------

PAPER_SPEEDUP = 2.5  # VCPO arXiv v1 abstract and Fig. 1: wall-clock to the synchronous run's best accuracy
PAPER_SYNC_STEPS, PAPER_SYNC_GPU_H = 300, 420.2  # README table, AIME-2025 multi-turn, synchronous k=0
PAPER_ASYNC_STEPS, PAPER_ASYNC_GPU_H = 220, 168.9  # same table, VCPO at k=2


def paper_config() -> SimConfig:
    """The VCPO multi-turn tool-use run (Qwen2.5-7B, k=2, 128 prompts x 16 responses, responses up to 12,288
    tokens, 2 rollout + 2 training GPUs). Shapes are the paper's scripts; every cost is our assumption
    for a 7B model on H100s (docs/simulator.md says why each)."""
    return SimConfig(
        generators=2, learners=2, max_lag=2, samples_per_prompt=16, prompts_per_request=64, prompts_per_step=128,
        steps=60, response_len_mean=4000.0, response_len_cv=0.9, max_response_len=12288, prompt_len=1024.0,
        gen_tokens_per_s=2500.0, gen_decode_step_s=0.012, gen_call_overhead_s=10.0,
        learner_tokens_per_s=4000.0, learner_overhead_s=30.0,
        sync_fixed_s=5.0, weight_bytes=15.2e9, sync_bytes_per_s=5e9, sync_waits_for_generation=True,
    )


# ---- calibration from a finished run ---------------------------------------------------------------


class CalibrationError(StableAsyncError, ValueError):
    """A run directory cannot be read for calibration; the message names the file."""


@dataclass(frozen=True)
class Measured:
    """What a real run measured, in the quantities the model predicts."""

    steps: int
    logged_step_s: float  # mean `time/step_s` over RL steps
    step_s: float | None  # mean time between consecutive RL rows (`time/wall_s`), when the run logged it
    lag_mean: float | None
    learner_step_s: float
    weight_sync_s: float
    gen_tokens_per_s: float  # per generator GPU
    learner_tokens_per_s: float  # per learner GPU
    response_len: float
    weight_load_s: float = 0.0  # one generator weight load (`perf/weight_load_s`; runs before it logged 0)


def _finite(rows: list[dict[str, Any]], key: str, path: Path) -> list[float]:
    values = [v for v in (metric_number(row.get(key)) for row in rows) if math.isfinite(v)]
    if not values:
        raise CalibrationError(f"{path}: no finite '{key}' in any RL step (train/step > 0)")
    return values


def calibrate(run_dir: Path) -> tuple[SimConfig, Measured]:
    """The model's costs derived from a finished run's own measurements, and what it measured.

    Time per step is never an input, so the comparison tests the model rather than echoing a figure.
    """
    job = read_run_job(run_dir / "job.yaml", CalibrationError, defaulted=["generator", "learner", "async"])
    metrics = run_dir / "metrics.jsonl"
    rows = step_rows(read_jsonl_rows(metrics, CalibrationError))
    if not rows:
        raise CalibrationError(f"{metrics}: no RL steps (rows with train/step > 0)")
    g, learner, async_ = job["generator"], job["learner"], job["async"]
    try:
        shape = SimConfig(
            generators=int(g["num_generators"]), learners=int(learner["num_ranks"]), max_lag=int(async_["max_lag"]),
            stale_policy=async_["stale_policy"], samples_per_prompt=int(g["samples_per_prompt"]),
            prompts_per_request=int(g["prompts_per_request"]), prompts_per_step=int(learner["prompts_per_step"]),
            max_response_len=int(g["max_new_tokens"]), seed=int(job.get("seed", 0)),
        )
    except (TypeError, ValueError) as error:
        raise CalibrationError(f"{run_dir / 'job.yaml'}: {error}") from None

    learner_step_s = statistics.fmean(_finite(rows, "time/learner_step_s", metrics))
    _finite(rows, "perf/learner_tokens_per_s", metrics)
    # tokens one rank trained per step, each row's own rate x time (a mean of rates would weight short steps up)
    per_row = [metric_number(r.get("perf/learner_tokens_per_s")) * metric_number(r.get("time/learner_step_s"))
               for r in rows]
    rank_tokens = statistics.fmean(t for t in per_row if math.isfinite(t))
    response_len = statistics.fmean(_finite(rows, "rollout/response_len", metrics))
    samples = shape.prompts_per_step * shape.samples_per_prompt
    # the logged rate is cumulative since the generators started (the last covers the whole run), times the
    # number of generators then (`async/num_generators` where the run logged it: elastic jobs vary it)
    gen_total = _finite(rows, "perf/gen_tokens_per_s", metrics)[-1]
    counts = [v for v in (metric_number(r.get("async/num_generators")) for r in rows) if math.isfinite(v) and v > 0]
    gen_per_gpu = gen_total / (counts[-1] if counts else shape.generators)
    sync_s = statistics.fmean(_finite(rows, "perf/weight_sync_s", metrics))
    lags = [v for v in (metric_number(r.get("async/lag_mean")) for r in rows) if math.isfinite(v)]
    loads = [v for v in (metric_number(r.get("perf/weight_load_s")) for r in rows) if math.isfinite(v)]
    measured = Measured(
        steps=len(rows), logged_step_s=statistics.fmean(_finite(rows, "time/step_s", metrics)),
        step_s=_measured_period(rows), lag_mean=statistics.fmean(lags) if lags else None,
        learner_step_s=learner_step_s, weight_sync_s=sync_s, gen_tokens_per_s=gen_per_gpu,
        learner_tokens_per_s=rank_tokens / learner_step_s, response_len=response_len,
        weight_load_s=loads[-1] if loads else 0.0,  # the logged value is the run's mean so far
    )
    collective = async_["weight_sync"] != "object_store"  # its publish waits for the loads: already in sync_s
    config = replace(
        shape, steps=max(2, min(len(rows), 5000)), response_len_mean=response_len, response_len_cv=0.0,
        prompt_len=max(0.0, rank_tokens * shape.learners / samples - response_len),
        gen_tokens_per_s=measured.gen_tokens_per_s, gen_decode_step_s=0.0, gen_call_overhead_s=0.0,
        learner_tokens_per_s=measured.learner_tokens_per_s, learner_overhead_s=0.0,
        gen_weight_load_s=0.0 if collective else measured.weight_load_s, sync_fixed_s=sync_s, weight_bytes=0.0,
        sync_waits_for_generation=collective,
    )
    return config, measured


def _measured_period(rows: list[dict[str, Any]]) -> float | None:
    """Mean wall-clock between consecutive RL rows (a resume restarts `time/wall_s`: those pairs are skipped)."""
    gaps = []
    for before, after in zip(rows, rows[1:]):
        gap = metric_number(after.get(WALL_KEY)) - metric_number(before.get(WALL_KEY))
        if metric_number(after.get(STEP_KEY)) == metric_number(before.get(STEP_KEY)) + 1 and gap > 0:
            gaps.append(gap)
    return statistics.fmean(gaps) if gaps else None


# ---- printing ------------------------------------------------------------------------------------


def describe(result: SimResult, sync: SimResult | None = None) -> str:
    """The prediction as the CLI prints it; `sync`: the same setting at max_lag 0 (simulated when not given)."""
    c = result.config
    total = sum(result.lag_counts)
    lags = ", ".join(f"{lag}: {count / total:.0%}" for lag, count in enumerate(result.lag_counts))
    lines = [
        f"setting: {c.generators} generator GPU(s), {c.learners} learner GPU(s), "
        f"max_lag {c.max_lag} ({c.stale_policy}), "
        f"{c.prompts_per_step} prompts x {c.samples_per_prompt} responses per step, "
        f"{c.prompts_per_request} prompts per generate call; {c.steps} steps, seed {c.seed}",
        f"costs: generate call {result.gen_call_s_mean:.2f} s (mean), learner step {result.learner_s_mean:.2f} s, "
        f"weight sync {c.sync_s:.2f} s",
        f"step_s (wall-clock per learner step): mean {result.step_s_mean:.2f} s, median {result.step_s_median:.2f} s "
        f"(perfect overlap: {result.ideal_step_s:.2f} s)",
        f"time/step_s as the driver logs it: mean {result.logged_step_s_mean:.2f} s",
        f"utilisation: generators {result.generator_utilisation:.0%}, learner {result.learner_utilisation:.0%}",
        f"lag (share of trained responses): {lags}; mean {result.lag_mean:.2f}"
        + (f"; {result.dropped_groups} groups dropped stale" if result.dropped_groups else ""),
    ]
    if c != synchronous(c):
        sync = sync or simulate(synchronous(c))
        lines.append(f"synchronous (max_lag 0, wait): step_s mean {sync.step_s_mean:.2f} s -> "
                     f"speedup {sync.step_s_mean / result.step_s_mean:.2f}x "
                     f"(perfect overlap: {sync.step_s_mean / result.ideal_step_s:.2f}x)")
    return "\n".join(lines)


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"


def describe_calibration(run_dir: Path, config: SimConfig, measured: Measured, result: SimResult) -> str:
    """Predicted next to measured, with the relative error, and the costs the prediction used."""
    lines = [
        f"calibrated from {run_dir} ({measured.steps} RL steps)",
        f"  generation: {measured.gen_tokens_per_s:.1f} tokens/s per generator (perf/gen_tokens_per_s per generator), "
        f"responses {measured.response_len:.1f} tokens (rollout/response_len)",
        f"  learner: {measured.learner_tokens_per_s:.1f} tokens/s per rank over {measured.learner_step_s:.3f} s "
        f"(time/learner_step_s), prompt {config.prompt_len:.1f} tokens per sample (derived)",
        f"  weight sync: {measured.weight_sync_s:.3f} s (perf/weight_sync_s)"
        + (", waits for in-flight generation (collective)" if config.sync_waits_for_generation
           else f"; each generator then loads it in {config.gen_weight_load_s:.3f} s (perf/weight_load_s)"),
        "",
        f"  {'':34}{'predicted':>10}{'measured':>10}{'error':>9}",
        f"  {'time/step_s (as the driver logs)':34}{result.logged_step_s_mean:>10.3f}{measured.logged_step_s:>10.3f}"
        f"{_error(result.logged_step_s_mean, measured.logged_step_s):>9}",
    ]
    if measured.step_s is not None:
        lines.append(f"  {'step period (time/wall_s)':34}{result.step_s_mean:>10.3f}{measured.step_s:>10.3f}"
                     f"{_error(result.step_s_mean, measured.step_s):>9}")
    else:
        lines.append(f"  {'step period (time/wall_s)':34}{result.step_s_mean:>10.3f}{'-':>10}")
    if measured.lag_mean is not None:
        lines.append(f"  {'async/lag_mean':34}{result.lag_mean:>10.3f}{measured.lag_mean:>10.3f}")
    lines.append(f"  predicted utilisation: generators {result.generator_utilisation:.0%}, "
                 f"learner {result.learner_utilisation:.0%}")
    return "\n".join(lines)


def describe_paper(result: SimResult) -> str:
    """Our model's prediction for the VCPO setting beside the paper's reported figures, each labelled."""
    per_step = (PAPER_SYNC_GPU_H / PAPER_SYNC_STEPS) / (PAPER_ASYNC_GPU_H / PAPER_ASYNC_STEPS)
    step_ratio = PAPER_SYNC_STEPS / PAPER_ASYNC_STEPS
    sync = simulate(synchronous(result.config))
    speedup = sync.step_s_mean / result.step_s_mean
    return "\n".join([
        "VCPO paper setting: multi-turn tool use, Qwen2.5-7B, max_lag (k) 2; shapes from the paper's scripts,",
        "costs assumed by us for H100s (docs/simulator.md)",
        "",
        describe(result, sync),
        "",
        f"paper's figure: {PAPER_SPEEDUP}x less wall-clock to reach the synchronous run's best AIME-2025 accuracy "
        "(arXiv v1, Fig. 1)",
        f"  from the paper's README: {per_step:.2f}x per step ({PAPER_SYNC_GPU_H} GPU-h / {PAPER_SYNC_STEPS} steps "
        f"sync vs {PAPER_ASYNC_GPU_H} GPU-h / {PAPER_ASYNC_STEPS} steps at k=2) x {step_ratio:.2f}x fewer steps",
        f"our model's prediction: {speedup:.2f}x per step",
        f"  x the paper's step ratio {step_ratio:.2f} (not modelled: it comes from learning, not scheduling) "
        f"= {speedup * step_ratio:.2f}x wall-clock",
    ])


def run_cli(calibrate_dir: str | None, paper: bool, overrides: dict[str, Any]) -> int:
    """`stableasync simulate`: print a prediction; exit 2 on a bad setting or run directory."""
    try:
        if calibrate_dir is not None:
            run_dir = Path(calibrate_dir)
            if not run_dir.is_dir():
                raise CalibrationError(f"{run_dir}: not a directory (give a finished run directory)")
            config, measured = calibrate(run_dir)
            print(describe_calibration(run_dir, config, measured, simulate(config)))
            if overrides:
                print(f"\nwhat if {', '.join(f'{k}={v}' for k, v in overrides.items())}:")
                print(describe(simulate(replace(config, **overrides))))
            return 0
        base = paper_config() if paper else SimConfig()
        result = simulate(replace(base, **overrides))
        print(describe_paper(result) if paper else describe(result))
        return 0
    except ValueError as error:  # CalibrationError included
        print(f"stableasync simulate: {error}", file=sys.stderr)
        return 2

