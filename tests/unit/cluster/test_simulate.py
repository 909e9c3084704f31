"""The async-RL simulator: closed-form cases, the lag bound, determinism, calibration and the CLI."""

import itertools
import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.experiments.simulate import SimConfig, calibrate, simulate
from cluster.job import dump_job, validate_job
from tests.fixtures import BENCH_ASYNC, learner_rows

ROOT = Path(__file__).resolve().parents[3]

# Every response exactly `response_len_mean` tokens, so each phase has a closed form.
FIXED = SimConfig(
    generators=2,
    learners=2,
    max_lag=0,
    samples_per_prompt=4,
    prompts_per_request=4,
    prompts_per_step=8,
    steps=12,
    response_len_mean=100.0,
    response_len_cv=0.0,
    max_response_len=1000,
    prompt_len=50.0,
    gen_tokens_per_s=1000.0,
    gen_decode_step_s=0.01,
    gen_call_overhead_s=0.5,
    learner_tokens_per_s=2000.0,
    learner_overhead_s=1.0,
    sync_fixed_s=0.3,
    weight_bytes=1e9,
    sync_bytes_per_s=1e9,
)


def _phases(c: SimConfig) -> tuple[float, float, float]:
    """Seconds to generate one step's groups (all calls in parallel), train them, publish the weights."""
    n = c.response_len_mean
    call_tokens = c.prompts_per_request * c.samples_per_prompt * n
    call_s = c.gen_call_overhead_s + n * c.gen_decode_step_s + call_tokens / c.gen_tokens_per_s
    rounds = math.ceil(c.prompts_per_step / (c.prompts_per_request * c.generators))
    train_s = c.learner_overhead_s + c.prompts_per_step * c.samples_per_prompt * (c.prompt_len + n) / (
        c.learner_tokens_per_s * c.learners
    )
    return rounds * call_s, train_s, c.sync_fixed_s + c.weight_bytes / c.sync_bytes_per_s


def test_synchronous_step_is_generate_then_train_then_sync():
    gen_s, train_s, sync_s = _phases(FIXED)
    result = simulate(FIXED)
    assert result.step_s == pytest.approx([gen_s + train_s + sync_s] * FIXED.steps)
    assert result.logged_step_s == pytest.approx([train_s + sync_s] * FIXED.steps)  # the driver's time/step_s
    assert result.lag_counts == (FIXED.steps * FIXED.prompts_per_step * FIXED.samples_per_prompt,)
    assert result.generator_utilisation == pytest.approx(gen_s / (gen_s + train_s + sync_s))
    assert result.learner_utilisation == pytest.approx(train_s / (gen_s + train_s + sync_s))


def test_sequential_calls_when_one_generator_serves_a_step():
    config = replace(FIXED, generators=1)  # two calls per step, one after the other
    gen_s, train_s, sync_s = _phases(config)
    assert simulate(config).step_s_mean == pytest.approx(gen_s + train_s + sync_s)


def _overlap_config(gen_s: float, train_s: float, sync_s: float, max_lag: int) -> SimConfig:
    """One generator and one call per step, no overheads: generation and training take exactly these times."""
    samples, n, prompt = 16, 100, 25
    return SimConfig(
        generators=1,
        learners=1,
        max_lag=max_lag,
        samples_per_prompt=4,
        prompts_per_request=4,
        prompts_per_step=4,
        steps=30,
        response_len_mean=n,
        response_len_cv=0.0,
        max_response_len=n,
        prompt_len=prompt,
        gen_tokens_per_s=samples * n / gen_s,
        gen_decode_step_s=0.0,
        gen_call_overhead_s=0.0,
        learner_tokens_per_s=samples * (n + prompt) / train_s,
        learner_overhead_s=0.0,
        sync_fixed_s=sync_s,
        weight_bytes=0.0,
    )


@pytest.mark.parametrize("gen_s,train_s", [(10.0, 10.0), (10.0, 4.0), (3.0, 10.0)])
@pytest.mark.parametrize("max_lag", [1, 2])
def test_lag_overlaps_generation_with_training(gen_s, train_s, max_lag):
    result = simulate(_overlap_config(gen_s, train_s, 0.0, max_lag))
    assert result.step_s_mean == pytest.approx(max(gen_s, train_s))
    assert result.speedup_vs_sync() == pytest.approx((gen_s + train_s) / max(gen_s, train_s))
    assert result.lag_mean > 0


@pytest.mark.parametrize("max_lag", [0, 1])
def test_a_generator_loads_each_new_version_once_before_its_next_call(max_lag):
    load_s = 0.7
    generation_bound = _overlap_config(10.0, 4.0, 0.0, max_lag)
    plain = simulate(generation_bound).step_s_median  # median: a lagged run's second call still samples version 0
    assert simulate(replace(generation_bound, gen_weight_load_s=load_s)).step_s_median == pytest.approx(plain + load_s)
    learner_bound = _overlap_config(3.0, 10.0, 0.0, 1)  # the load hides behind training
    assert simulate(replace(learner_bound, gen_weight_load_s=load_s)).step_s_median == pytest.approx(10.0)


@pytest.mark.parametrize("gen_s,train_s,sync_s", [(10.0, 10.0, 1.0), (10.0, 5.0, 1.0), (10.0, 9.5, 1.0)])
def test_the_driver_blocks_while_publishing(gen_s, train_s, sync_s):
    """Nothing is issued during a publish, so a step is the longer of generating and training-plus-publishing."""
    result = simulate(_overlap_config(gen_s, train_s, sync_s, 1))
    assert result.step_s_mean == pytest.approx(max(gen_s, train_s + sync_s))
    assert result.step_s_mean == pytest.approx(result.ideal_step_s)


def test_random_lengths_still_gain_but_never_beat_perfect_overlap():
    config = replace(SimConfig(), steps=40, max_lag=1)
    result = simulate(config)
    sync = simulate(replace(config, max_lag=0))
    assert 1.0 < sync.step_s_mean / result.step_s_mean <= sync.step_s_mean / result.ideal_step_s + 1e-9
    assert result.step_s_mean >= result.ideal_step_s - 1e-9


def test_the_end_of_step_wait_for_generators_costs_time_when_generation_bound():
    """The old driver read every generator's throughput after a step, which waited for their current calls."""
    config = replace(SimConfig(), steps=40, max_lag=2)
    waiting = simulate(replace(config, step_end_barrier=True))
    free = simulate(config)
    assert waiting.step_s_mean > free.step_s_mean * 1.01
    assert waiting.generator_utilisation < free.generator_utilisation
    assert free.step_s_mean == pytest.approx(free.ideal_step_s, rel=0.02)


@pytest.mark.parametrize("policy", ["wait", "drop"])
@pytest.mark.parametrize("max_lag", [0, 1, 2, 3])
def test_lag_never_exceeds_max_lag(policy, max_lag):
    config = SimConfig(
        generators=3,
        learners=1,
        max_lag=max_lag,
        stale_policy=policy,
        samples_per_prompt=4,
        prompts_per_request=2,
        prompts_per_step=6,
        steps=25,
        response_len_mean=300.0,
        response_len_cv=1.0,
        max_response_len=2000,
        seed=3,
    )
    result = simulate(config)
    assert len(result.lag_counts) <= max_lag + 1
    assert sum(result.lag_counts) == config.steps * config.prompts_per_step * config.samples_per_prompt
    if max_lag:
        assert result.lag_mean > 0


@pytest.mark.parametrize("lag", [0, 2, 5])
def test_a_fixed_lag_trains_every_step_from_k_on_exactly_k_stale(lag):
    config = SimConfig(
        generators=2, learners=1, max_lag=lag, fixed_lag=lag, samples_per_prompt=4, prompts_per_request=2,
        prompts_per_step=6, steps=20, response_len_mean=300.0, response_len_cv=1.0, seed=3,
    )  # fmt: skip
    responses_per_step = config.prompts_per_step * config.samples_per_prompt
    expected = [responses_per_step] * lag + [responses_per_step * (config.steps - lag)]
    assert list(simulate(config).lag_counts) == expected  # step t < K at lag t, the rest at K
    with pytest.raises(ValueError, match="fixed_lag"):
        replace(config, max_lag=lag - 1 if lag else 0, fixed_lag=lag + 1)


def test_same_seed_same_prediction_other_seed_other_lengths():
    config = replace(SimConfig(), steps=15)
    assert simulate(config) == simulate(config)
    assert simulate(replace(config, seed=1)).step_s != simulate(config).step_s


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"max_lag": 0},
        {"generators": 1},
        {"generators": 16, "max_lag": 3},
        {"learner_tokens_per_s": 500.0},
        {"stale_policy": "drop", "max_lag": 2},
        {"response_len_cv": 2.0},
    ],
)
def test_utilisation_is_a_fraction(changes):
    result = simulate(replace(SimConfig(), steps=15, **changes))
    assert 0.0 < result.generator_utilisation <= 1.0
    assert 0.0 < result.learner_utilisation <= 1.0


def test_bad_setting_names_the_field():
    with pytest.raises(ValueError, match="generators must be > 0"):
        SimConfig(generators=0)
    with pytest.raises(ValueError, match="divide evenly"):
        SimConfig(learners=3, prompts_per_step=8)
    # every problem at once; 0 learners used to raise ZeroDivisionError from the divisibility check
    with pytest.raises(ValueError, match=r"^learners must be > 0, got 0; max_lag must be >= 0, got -1$"):
        SimConfig(learners=0, max_lag=-1)


def test_no_torch_ray_or_numpy():
    code = "import sys, cluster.experiments.simulate; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    loaded = {name.split(".")[0] for name in out.stdout.split()}
    assert not loaded & {"torch", "ray", "numpy", "vllm", "deepspeed"}


# ---- calibration ---------------------------------------------------------------------------------


def _write_run(
    run_dir: Path,
    max_lag: int,
    gen_s: float,
    train_s: float,
    sync_s: float,
    overhead_s: float,
    steps: int = 12,
    load_s: float | None = None,
) -> tuple[float, float]:
    """A finished run as the driver writes it: one generator making 4 groups x 2 responses of 40 tokens per
    step, prompts of 60 tokens. Returns the mean `time/step_s` and step period it 'measured'; both carry
    `overhead_s` the model does not know about, and alternate +-3% noise. `load_s`: the generator's weight
    load before each call, logged as `perf/weight_load_s` (None: a run from before that metric)."""
    prompts, samples, response, prompt = 4, 2, 40.0, 60.0
    job = validate_job(
        {
            "task": {"name": "arithmetic"},
            "seed": 7,
            "generator": {"num_generators": 1, "samples_per_prompt": samples, "prompts_per_request": prompts},
            "learner": {"num_ranks": 1, "prompts_per_step": prompts, "steps": steps},
            "async": {"max_lag": max_lag},
        }
    )
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text(dump_job(job))
    tokens = prompts * samples * response
    busy_gen_s = gen_s + (load_s or 0.0)
    period = (busy_gen_s + train_s + sync_s if max_lag == 0 else max(busy_gen_s, train_s + sync_s)) + overhead_s
    rows = [  # warm-up rows (train/step <= 0) are SFT steps and must be ignored
        {"train/step": -1, "time/wall_s": 1.0, "time/learner_step_s": 50.0, "perf/learner_tokens_per_s": 1.0},
        {"train/step": 0, "time/wall_s": 2.0, "time/learner_step_s": 50.0, "perf/learner_tokens_per_s": 1.0},
    ]
    wall_s, logged, gaps = 10.0, [], []
    for step in range(1, steps + 1):
        noise = 1.03 if step % 2 else 0.97
        learner_s = train_s * noise
        gap = period * noise
        wall_s += gap
        gaps.append(gap)
        logged.append(learner_s + sync_s + overhead_s / 2)
        rows.append(
            {
                "train/step": step,
                "time/wall_s": round(wall_s, 3),
                "time/step_s": logged[-1],
                "time/learner_step_s": learner_s,
                "perf/learner_tokens_per_s": prompts * samples * (prompt + response) / learner_s,
                "perf/weight_sync_s": sync_s,
                "perf/gen_tokens_per_s": "nan" if step == steps else tokens / gen_s,
                "rollout/response_len": response,
                "async/lag_mean": float(max_lag > 0 and step > 1),
                "async/lag": [1, 0],
                "stability/ess_ratio": "nan",
                **({} if load_s is None else {"perf/weight_load_s": load_s}),
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return sum(logged) / steps, sum(gaps[1:]) / (steps - 1)


@pytest.mark.parametrize("max_lag,gen_s,train_s", [(0, 4.0, 2.0), (1, 4.0, 2.0), (1, 2.0, 4.0)])
def test_calibration_reproduces_a_runs_step_time(tmp_path, max_lag, gen_s, train_s):
    logged_s, period_s = _write_run(tmp_path / "run", max_lag, gen_s, train_s, sync_s=0.5, overhead_s=0.3)
    config, measured = calibrate(tmp_path / "run")
    assert (config.generators, config.max_lag, config.prompts_per_step, config.seed) == (1, max_lag, 4, 7)
    assert measured.logged_step_s == pytest.approx(logged_s) and measured.step_s == pytest.approx(period_s, rel=1e-3)
    result = simulate(config)
    assert result.logged_step_s_mean == pytest.approx(logged_s, rel=0.2)
    assert result.step_s_mean == pytest.approx(period_s, rel=0.2)


def test_calibration_leaves_out_evaluation_rows(tmp_path):
    """An evaluation's own row (its step's number, written when it ends, after later steps) is not a step:
    the measured steps, step time and period are those of the step rows alone."""
    _write_run(tmp_path / "run", 1, 4.0, 2.0, sync_s=0.5, overhead_s=0.3)
    _, before = calibrate(tmp_path / "run")
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for evaluated in (5, 2):  # each written after the row of the step that follows it
        at = next(i for i, row in enumerate(rows) if row["train/step"] == evaluated + 1) + 1
        rows.insert(at, {"train/step": evaluated, "time/wall_s": rows[at - 1]["time/wall_s"] + 0.1, "eval/solved": 0.5})
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, after = calibrate(tmp_path / "run")
    assert after == before and after.steps == sum(row["train/step"] > 0 for row in rows) - 2


def test_the_documented_calibrate_commands_on_a_recorded_run_with_evaluation_rows(capsys):
    """docs/simulator.md's `--calibrate RUN_DIR` and `--calibrate RUN_DIR --generators 8`, on a real run whose
    evaluations have their own rows: the measured steps and period are those of the learner's rows."""
    run = BENCH_ASYNC / "lag1"
    steps = learner_rows(run)
    gaps = [after["time/wall_s"] - before["time/wall_s"] for before, after in itertools.pairwise(steps)]
    logged = sum(row["time/step_s"] for row in steps) / len(steps)
    assert main(["simulate", "--calibrate", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"calibrated from {run} ({len(steps)} RL steps)" in out
    assert re.search(rf"step period \(time/wall_s\)\s+\d+\.\d{{3}}\s+{sum(gaps) / len(gaps):.3f}\s", out), out
    assert re.search(rf"time/step_s \(as the driver logs\)\s+\d+\.\d{{3}}\s+{logged:.3f}\s", out), out
    assert main(["simulate", "--calibrate", str(run), "--generators", "8"]) == 0
    out = capsys.readouterr().out
    assert "what if generators=8:" in out and "setting: 8 generator GPU(s), 1 learner GPU(s), max_lag 1" in out


@pytest.mark.parametrize("max_lag", [0, 1])
def test_calibration_counts_the_generators_weight_load(tmp_path, max_lag):
    _, period_s = _write_run(tmp_path / "run", max_lag, 4.0, 2.0, sync_s=0.5, overhead_s=0.0, load_s=0.8)
    config, measured = calibrate(tmp_path / "run")
    assert measured.weight_load_s == config.gen_weight_load_s == pytest.approx(0.8)
    assert simulate(config).step_s_mean == pytest.approx(period_s, rel=0.05)
    _write_run(tmp_path / "old", max_lag, 4.0, 2.0, sync_s=0.5, overhead_s=0.0)  # logged before the metric
    assert calibrate(tmp_path / "old")[0].gen_weight_load_s == 0.0


def test_calibrate_prints_predicted_measured_and_error(tmp_path, capsys):
    _write_run(tmp_path / "run", 1, 4.0, 2.0, sync_s=0.5, overhead_s=0.3)
    assert main(["simulate", "--calibrate", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "time/step_s" in out and "step period" in out and "predicted" in out and "%" in out


def _cli_error(args, capsys) -> str:
    assert main(["simulate", *args]) == 2
    return capsys.readouterr().err


def test_cli_names_the_missing_or_bad_file(tmp_path, capsys):
    assert str(tmp_path / "nope") in _cli_error(["--calibrate", str(tmp_path / "nope")], capsys)
    run = tmp_path / "run"
    run.mkdir()
    assert "job.yaml" in _cli_error(["--calibrate", str(run)], capsys)
    _write_run(tmp_path / "good", 1, 4.0, 2.0, sync_s=0.5, overhead_s=0.3)
    (run / "job.yaml").write_text((tmp_path / "good" / "job.yaml").read_text())
    assert "metrics.jsonl" in _cli_error(["--calibrate", str(run)], capsys)
    (run / "metrics.jsonl").write_text('{"train/step": 1}\n{"train/step": 2, oops\n')
    assert "metrics.jsonl:2" in _cli_error(["--calibrate", str(run)], capsys)
    (run / "metrics.jsonl").write_text('{"train/step": 0, "time/step_s": 1.0}\n')
    assert "no RL steps" in _cli_error(["--calibrate", str(run)], capsys)
    (run / "metrics.jsonl").write_text('{"train/step": 1, "time/step_s": 1.0}\n')
    assert "time/learner_step_s" in _cli_error(["--calibrate", str(run)], capsys)
    (run / "job.yaml").write_text("- not\n- a job\n")
    assert "job.yaml" in _cli_error(["--calibrate", str(run)], capsys)


def test_cli_rejects_bad_settings(capsys):
    assert "generators must be > 0" in _cli_error(["--generators", "0"], capsys)
    assert "not both" in _cli_error(["--paper", "--calibrate", "x"], capsys)


def test_cli_prints_a_prediction_and_the_paper_comparison(capsys):
    assert main(["simulate", "--steps", "10", "--max-lag", "2"]) == 0
    out = capsys.readouterr().out
    assert "max_lag 2" in out and "speedup" in out and "utilisation" in out
    assert main(["simulate", "--paper", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "paper's figure: 2.5x" in out and "our model's prediction" in out


def test_speedup_is_against_the_synchronous_wait_baseline():
    """Under `drop` even max_lag 0 lets generators run ahead; the baseline is always on-policy `wait`."""
    config = replace(SimConfig(), steps=15, stale_policy="drop", max_lag=1)
    result = simulate(config)
    baseline = simulate(replace(config, max_lag=0, stale_policy="wait"))
    assert simulate(replace(config, max_lag=0)).step_s_mean != pytest.approx(baseline.step_s_mean)
    assert result.speedup_vs_sync() == pytest.approx(baseline.step_s_mean / result.step_s_mean)
