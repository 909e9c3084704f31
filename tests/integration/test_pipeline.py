"""Whole jobs on a local Ray cluster: vLLM generator, 2 DeepSpeed learner ranks, weight sync, ledger.

The lag bound is checked from the version tags the generator put on every trained group.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from cluster.cli import main as cli_main  # noqa: E402
from cluster.job import validate_job  # noqa: E402
from cluster.telemetry.run_files import is_evaluation_row, metric_number  # noqa: E402


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    import os

    os.environ["STABLEASYNC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    ray.init(
        address="local",
        num_cpus=3,
        include_dashboard=False,
        namespace="stableasync-tests",
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        runtime_env={"env_vars": __import__("cluster.run.ray_cluster", fromlist=["actor_env"]).actor_env()},
    )
    yield
    ray.shutdown()


def _job(tmp_path: Path, max_lag: int, steps: int = 4, **overrides) -> dict:
    job = {
        "name": f"lag{max_lag}",
        "model": {"path": "tiny", "sft_warmup": {"steps": 2, "prompts_per_step": 8}},
        "task": {"name": "arithmetic"},
        "generator": {
            "num_generators": 1,
            "samples_per_prompt": 4,
            "prompts_per_request": 2,
            "max_new_tokens": 8,
            "max_model_len": 96,
        },
        "learner": {"num_ranks": 2, "zero_stage": 2, "steps": steps, "prompts_per_step": 2, "learning_rate": 1e-3},
        "algorithm": {"stabilizer": {"name": "tis_seq"}},
        "async": {"max_lag": max_lag},
        "logging": {"run_dir": str(tmp_path / "runs"), "wandb": {"mode": "offline"}, "progress_bar": False},
    }
    for section, values in overrides.items():
        job[section] = {**job.get(section, {}), **values}
    return job


def _trained(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "trained"]


def _run(tmp_path, **kwargs):
    from cluster.run.driver import train

    return train(validate_job(_job(tmp_path, **kwargs)))


def run_job_in(tmp_path, **kwargs):
    """`_run` through `run_job`, which resumes a run whose learners crashed."""
    from cluster.run.driver import run_job

    return run_job(validate_job(_job(tmp_path, **kwargs)))


def test_synchronous_job_trains_only_lag_zero(local_ray, tmp_path):
    held_out = tmp_path / "held_out.jsonl"  # a named evaluation set in another task's format (eval.sets)
    held_out.write_text("".join(json.dumps({"prompt": f"What is {a} + 2?", "answer": a + 2}) + "\n" for a in range(3)))
    result = _run(
        tmp_path,
        max_lag=0,
        eval={
            "every_steps": 2,
            "num_problems": 5,
            "before_training": True,
            "sets": {"held": {"path": str(held_out), "task": "dataset"}},
        },
    )
    trained = _trained(result.run_dir)
    assert len(trained) == 4 * 2  # steps x prompts_per_step, each group exactly once
    assert {r["lag"] for r in trained} == {0}
    assert len({r["group_id"] for r in trained}) == len(trained)
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_steps = [m for m in metrics if m["train/step"] > 0 and not is_evaluation_row(m)]
    assert [m["train/step"] for m in rl_steps] == [1, 2, 3, 4]
    for key in ("stability/ess_ratio", "stability/lr_scale", "optim/grad_norm", "stability/kl_k3", "async/lag"):
        assert key in rl_steps[-1], key
    # the policy's next-token entropy: positive, at most log(vocabulary) of the tiny model (512 tokens)
    assert all(0.0 < m["stability/entropy"] <= math.log(512) for m in rl_steps)
    assert list((result.run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "W&B offline run file written"
    # every publish is loaded by the generator before its next call; the driver counts what it reports
    summary = json.loads((result.run_dir / "summary.json").read_text())
    # steps 1 and 3's, reported by the training calls after them; the evaluations' calls take those of steps 0, 2
    # and 4 (each evaluation runs on the weights just published)
    assert summary["weight_loads"] >= 2 and summary["weight_load_s"] > 0
    assert 0 < rl_steps[-1]["perf/weight_load_s"] <= summary["weight_load_s"]  # the mean of one load so far
    # synchronous: each step's own call (and the load before it) is reported in that step's row
    busy = [m["time/generator_busy_s"] for m in rl_steps]
    # a generator's busy, sampling and load timers each read the clock on their own, microseconds apart
    assert min(busy) > 0 and sum(busy) == pytest.approx(summary["generate_s"] + summary["weight_load_s"], abs=0.01)
    _assert_the_trained_model_is_saved(result, summary)
    _assert_rollout_samples_are_rank_zeros_groups(result.run_dir, trained)
    # evaluated before training and at steps 2 and 4, on the weights just published: 5 greedy answers, scored.
    # The loop does not wait: each evaluation is its own row, written after its step's row; the last one before
    # the run ends.
    order = [(m["train/step"], is_evaluation_row(m)) for m in metrics if m["train/step"] > 0]
    assert order.index((2, True)) > order.index((2, False)) and order[-1] == (4, True), order
    evaluated = {m["train/step"]: m for m in metrics if is_evaluation_row(m) and "eval/solved" in m}
    assert sorted(evaluated) == [0, 2, 4]  # eval.before_training: the starting policy too
    for step, row in evaluated.items():
        assert row["eval/policy_version"] == step and row["eval/problems"] == 5 and row["eval/score_errors"] == 0
        assert 0.0 <= row["eval/solved"] <= row["eval/reward_mean"] <= 1.0 and row["eval/response_len"] > 0
        assert row["eval/seconds"] > 0
    # the named set: a row of its own at each of those steps, every key under eval/held/
    held = {m["train/step"]: m for m in metrics if "eval/held/solved" in m}
    assert sorted(held) == [0, 2, 4] and all(
        set(m) - {"train/step", "time/wall_s"}
        == {
            f"eval/held/{key}"
            for key in (
                "reward_mean",
                "solved",
                "pass_at_k",
                "maj_at_k",
                "response_len",
                "score_errors",
                "problems",
                "answers",
                "policy_version",
                "seconds",
            )
        }
        for m in held.values()
    )
    assert all(m["eval/held/policy_version"] == step and m["eval/held/problems"] == 3 for step, m in held.items())
    assert all(0.0 <= m["eval/held/solved"] <= m["eval/held/pass_at_k"] <= 1.0 for m in held.values())
    # each evaluation ends before the next step's generation (queued behind it): the loop never waited for one
    assert [m["time/eval_wait_s"] for m in rl_steps] == [0.0] * 4


def _assert_rollout_samples_are_rank_zeros_groups(run_dir: Path, trained: list[dict]) -> None:
    """samples.jsonl at the last step (every 10 steps and at the last): rank 0's one group, its 4 responses,
    on-policy (the learner's log-probs agree with vLLM's up to numerics)."""
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [4] * 4
    (group_id,) = {s["group_id"] for s in samples}
    # the ledger's trained_step is the version the step started from: 3 for the step that made version 4
    assert group_id in {r["group_id"] for r in trained if r["trained_step"] == 3}
    assert all(s["lag"] == 0 and s["question"].startswith("What is") and s["answer"] for s in samples)
    assert all(s["completion_tokens"] > 0 and s["finish_reason"] in ("stop", "length") for s in samples)
    assert all(abs(s["log_ratio_per_token"]) < 0.05 for s in samples), samples


def _assert_the_trained_model_is_saved(result, summary: dict) -> None:
    """RUN_DIR/model: a Hugging Face folder with trained weights that a next job takes as its `model.path`."""
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.job import job_task
    from cluster.run.model_prep import prepare_model

    assert summary["model"] == str(result.run_dir / "model") == str(result.model_dir)
    job = validate_job(yaml.safe_load((result.run_dir / "job.yaml").read_text()))
    task = job_task(job)
    initial = AutoModelForCausalLM.from_pretrained(prepare_model(job, task)).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(result.model_dir).state_dict()
    assert set(trained) == set(initial)
    assert any(not torch.equal(trained[name], initial[name]) for name in initial), "the saved weights are untrained"
    follow_up = job.model_copy(update={"model": job.model.model_copy(update={"path": str(result.model_dir)})})
    assert prepare_model(follow_up, task) == str(result.model_dir)  # resolves, and has its chat template


WANDB_KEY = "sa-test-key-5f0c1d2e3b4a"  # set in the environment, passed to the actors, written to no file


def _assert_no_file_holds(run_dir: Path, secret: str) -> None:
    leaking = [p for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaking == []


@pytest.mark.slow  # 26 s; the default run's killed-generator job checks the same bound and the same secret
def test_lagged_job_stays_within_max_lag(local_ray, tmp_path, monkeypatch):
    """With a W&B key in the environment (passed to the actors), no file of the run contains it."""
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    result = _run(tmp_path, max_lag=2, steps=5)
    _assert_no_file_holds(result.run_dir, WANDB_KEY)
    trained = _trained(result.run_dir)
    lags = [r["lag"] for r in trained]
    assert len(trained) == 5 * 2
    assert max(lags) <= 2
    assert max(lags) >= 1, "the generator ran ahead of the learner (asynchrony happened)"
    counts = result.ledger_counts
    assert counts["trained"] == len(trained) and set(counts) <= {"trained", "dropped"}


def test_a_fixed_lag_job_trains_every_group_exactly_k_versions_stale(local_ray, tmp_path):
    """async.fixed_lag 2: steps 1 and 2 train the initial policy's groups (lags 0 and 1), every later step
    groups sampled exactly 2 versions before; one step's worth sampled per step, none past the run."""
    result = _run(tmp_path, max_lag=2, steps=5, **{"async": {"max_lag": 2, "fixed_lag": 2}})
    trained = _trained(result.run_dir)
    assert sorted((r["trained_step"], r["lag"]) for r in trained) == [(t, min(t, 2)) for t in range(5) for _ in "ab"]
    assert all(r["sampled_versions"] == [r["trained_step"] - r["lag"]] * 2 for r in trained)
    assert result.ledger_counts == {"trained": 10}, "nothing sampled for a step past the run"
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    lags = [r["async/lag"] for r in rows if r["train/step"] > 0 and not is_evaluation_row(r)]
    assert lags == [[8, 0, 0], [0, 8, 0], [0, 0, 8], [0, 0, 8], [0, 0, 8]]  # responses per lag 0, 1, 2


def test_a_streaming_generator_runs_calls_side_by_side_and_takes_weights_while_they_run(local_ray, tmp_path):
    """generator.streaming: one AsyncLLM engine with two generate calls in flight; each publish loads the
    weights beside them (the driver waits for the load, then issues with the new version). Every group ends
    once, none past the lag bound, and later groups were sampled with the learner's newer weights."""
    result = _run(
        tmp_path,
        max_lag=1,
        steps=4,
        logging={"run_name": "streaming"},
        generator={"streaming": True, "requests_in_flight": 2, "prompts_per_request": 1},
    )
    trained = _trained(result.run_dir)
    assert len(trained) == 4 * 2 and max(r["lag"] for r in trained) <= 1
    assert max(r["trained_step"] - r["lag"] for r in trained) >= 2  # sampled with the weights of step 2 or later
    # the ledger names the oldest and newest version that sampled each group; the lag counts from the oldest
    for row in trained:
        oldest, newest = row["sampled_versions"]
        assert row["lag"] == row["trained_step"] - oldest and oldest <= newest <= row["trained_step"], row
    _assert_each_group_ends_once(result.run_dir, steps=4)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["train/step"] > 0 and "async/token_lag" in r]
    assert len(steps) == 4 and all(0 <= r["async/mixed_version_share"] <= 1 for r in steps)
    assert all(sum(r["async/lag"]) == 2 * 4 for r in steps), "each step trains every response of its 2 groups"
    assert all(len(r["async/token_lag"]) <= 2 and sum(r["async/token_lag"]) > 0 for r in steps)  # lags 0 and 1


@pytest.mark.parametrize("streaming", [False, pytest.param(True, marks=pytest.mark.slow)])  # 35 s more
def test_collective_weight_sync_path(local_ray, tmp_path, streaming):
    """The NCCL publisher's code path, over gloo: learner rank 0 broadcasts to the generator, a streaming one
    receiving in its engine-core process beside its calls in flight."""
    generator = {"streaming": True, "requests_in_flight": 2, "prompts_per_request": 1} if streaming else {}
    result = _run(tmp_path, max_lag=1, steps=3, generator=generator, **{"async": {"max_lag": 1, "weight_sync": "gloo"}})
    trained = _trained(result.run_dir)
    assert len(trained) == 3 * 2 and max(r["lag"] for r in trained) <= 1
    # the generator tags samples with the version it received over the broadcast
    assert max(r["trained_step"] - r["lag"] for r in trained) >= 1
    _assert_each_group_ends_once(result.run_dir, steps=3)


# 27 s; the default suite runs ZeRO-3 VCPO on 2 ranks in tests/component/test_learner.py (the per-sample loop's
# update) and test_devices.py, and the W&B key check in test_lagged_job_stays_within_max_lag
@pytest.mark.slow
def test_vcpo_job_with_the_off_policy_baseline(local_ray, tmp_path):
    """VCPO end to end: ghost per-sample gradient norms feed the baseline on 2 ZeRO-3 ranks."""
    result = _run(tmp_path, max_lag=1, steps=3, algorithm={"stabilizer": {"name": "vcpo"}}, learner={"zero_stage": 3})
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if m["train/step"] > 0][-1]
    assert last["opob/fallback_to_loop"] == 0
    assert (
        last["opob/sample_grad_norm_mean"] > 0
        and last["opob/sample_grad_norm_max"] >= last["opob/sample_grad_norm_median"]
    )
    assert 0 < last["stability/lr_scale"] <= 1
    assert len(_trained(result.run_dir)) == 3 * 2


def _kill_after_step(run_dir: Path, actor_name: str, killed: list[int], step: int = 1) -> None:
    """Test thread: SIGKILL an actor's process once the learner has taken `step` steps."""
    import os
    import signal
    import time

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            generator = ray.get_actor(actor_name, namespace="stableasync-tests")
            break
        except ValueError:
            time.sleep(0.2)
    pid = ray.get(generator.process_id.remote())
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and any(
            json.loads(line)["train/step"] >= step for line in metrics.read_text().splitlines()
        ):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.05)


def _assert_each_group_ends_once(run_dir: Path, steps: int, prompts_per_step: int = 2) -> list[dict]:
    from actors.buffer import audit_ledger

    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(rows) == []
    trained_steps = sorted(r["trained_step"] for r in rows if r["event"] == "trained")
    assert trained_steps == sorted(list(range(steps)) * prompts_per_step), "each step trained its groups once"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [m["train/step"] for m in metrics if m["train/step"] > 0 and not is_evaluation_row(m)]
    assert steps_logged == list(range(1, steps + 1))
    return rows


@pytest.mark.parametrize("streaming", [False, pytest.param(True, marks=pytest.mark.slow)])  # 50 s more
def test_killed_generator_is_restarted_and_loses_no_group(local_ray, tmp_path, streaming, monkeypatch):
    """Killed during the run, a generator is restarted once and every group still ends once; a streaming
    one dies with several calls in flight, all of which fail and go out again, for one restart. The run
    stays within max_lag, the generator ran ahead of the learner, and the W&B key in the environment
    (passed to the actors, the restarted one too) is in no file of the run."""
    import threading

    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    job = _job(
        tmp_path,
        max_lag=2,
        steps=5,
        logging={"run_name": "killed-generator"},
        generator={
            "max_restarts": 2,
            "streaming": streaming,
            "requests_in_flight": 2,
            "prompts_per_request": 1 if streaming else 2,
        },
    )
    run_dir = tmp_path / "runs" / "killed-generator"
    killed: list[int] = []
    killer = threading.Thread(
        target=_kill_after_step, args=(run_dir, "killed-generator-generator-0", killed), daemon=True
    )
    killer.start()
    from cluster.run.driver import train

    result = train(validate_job(job))
    killer.join(timeout=5)
    assert killed, "the generator was killed during the run"
    assert json.loads((run_dir / "summary.json").read_text())["generator_restarts"] == 1
    rows = _assert_each_group_ends_once(run_dir, steps=5)
    reissued = [r for r in rows if r["event"] == "reissued"]
    assert all("generator 0" in r["reason"] for r in reissued)
    assert result.ledger_counts["trained"] == 5 * 2
    lags = [r["lag"] for r in _trained(run_dir)]
    assert 1 <= max(lags) <= 2, lags
    _assert_no_file_holds(run_dir, WANDB_KEY)


@pytest.mark.slow  # 36 s; test_killed_generator_is_restarted_and_loses_no_group restarts one in the default run
def test_a_generator_restarted_between_calls_is_noticed_and_gets_the_latest_weights(
    local_ray, tmp_path, monkeypatch, caplog
):
    """With max_lag 0 the generator is idle while the learner steps. SIGKILLed then (during step 2) and
    restarted by Ray, it is noticed from its next result's incarnation: the restart is counted, it has
    the latest weights, nothing is trained off-policy, and every group still ends exactly once."""
    import os
    import signal
    import time

    from ray.exceptions import RayActorError

    from cluster.run import driver

    start_step = driver.AsyncLoop._start_learner_step
    killed: list[int] = []

    def kill_while_idle(self):
        start_step(self)
        if self.version == 1 and self.learner_refs and not self.schedule.calls and not killed:
            generator = self.generators[0]
            killed.append(ray.get(generator.process_id.remote()))
            os.kill(killed[0], signal.SIGKILL)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:  # Ray restarts it with the model's initial weights
                try:
                    if ray.get(generator.process_id.remote(), timeout=30) != killed[0]:
                        return
                except RayActorError:
                    time.sleep(0.5)
            raise AssertionError("Ray did not restart the generator")

    monkeypatch.setattr(driver.AsyncLoop, "_start_learner_step", kill_while_idle)
    job = _job(
        tmp_path,
        max_lag=0,
        steps=4,
        logging={"run_name": "idle-kill"},
        generator={"max_restarts": 1},
        eval={"every_steps": 2, "num_problems": 4},
    )
    result = driver.train(validate_job(job))
    assert killed, "the generator was killed between calls"
    assert "generator 0 was restarted between calls" in caplog.text
    assert json.loads((result.run_dir / "summary.json").read_text())["generator_restarts"] == 1
    rows = _assert_each_group_ends_once(result.run_dir, steps=4)
    assert {r["lag"] for r in rows if r["event"] == "trained"} == {0}, "nothing trained with stale weights"
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {m["train/step"]: m["eval/policy_version"] for m in metrics if "eval/policy_version" in m}
    assert evaluated == {2: 2, 4: 4}, "the restarted generator evaluates the weights of the step, not its initial ones"


@pytest.mark.slow  # 50 s: a run with a generator restart
def test_a_generator_killed_before_an_evaluation_skips_it_with_an_alert_and_the_run_goes_on(
    local_ray, tmp_path, monkeypatch, caplog
):
    """The evaluating generator is SIGKILLed as step 1's evaluation is sent: its call fails, that evaluation
    is skipped with an alert naming the step and the generator, Ray restarts the generator, and the steps
    after it train and evaluate as usual on the weights of their step."""
    import os
    import signal

    from cluster.run import driver

    evaluate = driver.AsyncLoop._start_evaluation
    killed: list[int] = []

    def kill_then_evaluate(self):
        if self.version == 1 and not killed:
            killed.append(ray.get(self.generators[min(self.generators)].process_id.remote()))
            os.kill(killed[0], signal.SIGKILL)
        return evaluate(self)

    monkeypatch.setattr(driver.AsyncLoop, "_start_evaluation", kill_then_evaluate)
    job = _job(
        tmp_path,
        max_lag=0,
        steps=3,
        logging={"run_name": "eval-kill"},
        generator={"max_restarts": 1},
        eval={"every_steps": 1, "num_problems": 4},
    )
    with caplog.at_level("WARNING", logger="stableasync"):
        result = driver.train(validate_job(job))
    assert killed, "the generator was killed at step 1's evaluation"
    skipped = [r.getMessage() for r in caplog.records if "ALERT evaluation skipped" in r.getMessage()]
    assert len(skipped) == 1 and "step 1: generator 0 died during it" in skipped[0], skipped
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {m["train/step"]: m["eval/policy_version"] for m in metrics if "eval/policy_version" in m}
    assert evaluated == {2: 2, 3: 3}
    assert json.loads((result.run_dir / "summary.json").read_text())["generator_restarts"] == 1
    _assert_each_group_ends_once(result.run_dir, steps=3)


def test_an_evaluation_due_while_the_previous_one_runs_waits_for_it(local_ray, tmp_path, tiny_qwen2, caplog):
    """Two evaluations sent back to back to a real generator: the second is sent only once the first is
    scored and logged (one evaluation at a time), the seconds the loop waited come back for the step row's
    time/eval_wait_s, and that first wait logs a warning naming the knobs."""
    from actors.generator import GeneratorSpec
    from cluster.job import evaluation_sets, job_task, section_config
    from cluster.run import generator_actors
    from cluster.run.evaluation import Evaluator
    from cluster.telemetry.metrics import MetricSink
    from tasks.config import TASK_CONFIGS
    from tasks.scoring import ScorePool

    job = validate_job({"task": {"name": "arithmetic"}, "eval": {"every_steps": 1, "num_problems": 32}})
    generator = generator_actors.start_generator(
        GeneratorSpec(model_path=tiny_qwen2, samples_per_prompt=1, max_new_tokens=8, temperature=0.0, max_model_len=96),
        0,
        cpus=1,
    )
    scorer = ScorePool("arithmetic", section_config(job.task, TASK_CONFIGS))
    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=False)
    evaluator = Evaluator(evaluation_sets(job, job_task(job)), job, scorer, sink)
    try:
        ray.get(generator.ready.remote())
        with caplog.at_level("WARNING", logger="stableasync"):
            first_wait_s = evaluator.start({0: generator}, [], step=0)
            second_wait_s = evaluator.start({0: generator}, [], step=0)
            rows_when_the_second_was_sent = (tmp_path / "metrics.jsonl").read_text().splitlines()
            evaluator.wait()
    finally:
        scorer.close()
        sink.close()
        ray.kill(generator)
    assert first_wait_s == 0.0 and second_wait_s > 0
    assert len(rows_when_the_second_was_sent) == 1, "the first evaluation ended before the second was sent"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["train/step"], r["eval/problems"]) for r in rows] == [(0, 32), (0, 32)]
    waits = [r.getMessage() for r in caplog.records if "was still running" in r.getMessage()]
    assert len(waits) == 1 and "eval.every_steps" in waits[0] and "time/eval_wait_s" in waits[0], waits


def test_a_learner_the_cluster_cannot_place_fails_with_the_resources_named(local_ray):
    from cluster.run.learner_group import LearnerGroup
    from learner.rank import LearnerSpec

    with pytest.raises(RuntimeError, match=r"could not be placed within 2 s.*learner.cpus_per_rank"):
        LearnerGroup(LearnerSpec(model_path="unused"), 1, 64.0, 0.0, placement_timeout_s=2)
    assert ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"), "nothing left reserved"


def _dataset_task(tmp_path: Path, rows: list[dict], reward_source: str, stem: str = "rows") -> dict:
    """A dataset task section as a user writes one: STEM.jsonl (problem ids STEM-000001, ...) and a reward
    function `score` in STEM_reward.py."""
    data = tmp_path / f"{stem}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / f"{stem}_reward.py").write_text(reward_source)
    return {"name": "dataset", "path": str(data), "reward": f"{tmp_path}/{stem}_reward.py:score"}


DATASET_REWARD = """
def score(completion, answer, row):
    if row.get("explode"):
        raise ValueError("the user's verifier failed on " + row["prompt"])
    return row["weight"]
"""


def test_learner_ranks_whose_rendezvous_port_was_taken_start_again_at_another(local_ray, tiny_qwen2, caplog):
    """Between the port's choice and rank 0's bind (seconds: the rank's process starts), another process may take
    it; both ranks then start again at a fresh port instead of failing the run. Here the test holds the first."""
    import socket

    from cluster.run.learner_group import LearnerGroup
    from learner.rank import LearnerSpec

    holders: list[socket.socket] = []

    class FirstPortTaken(LearnerGroup):
        def rendezvous_address(self):
            address = super().rendezvous_address()
            if not holders:
                holders.append(socket.socket())
                holders[0].bind(("", address.port))
                holders[0].listen()
            return address

    group = FirstPortTaken(LearnerSpec(model_path=tiny_qwen2), 2, 0.5, 0.0)
    taken_port = holders[0].getsockname()[1]
    try:
        with caplog.at_level("WARNING", logger="stableasync"):
            group.wait_until_ready()
        # both ranks joined one gloo group: its constructor returns only once every rank has
        assert sorted(ray.get([rank.ready.remote() for rank in group.ranks])) == [0, 1]
    finally:
        group.shutdown()
        holders[0].close()
    retries = [r.getMessage() for r in caplog.records if "rendezvous port" in r.getMessage()]
    assert retries == [f"learner ranks' rendezvous port {taken_port} was taken; starting them again at another port"]


def test_a_dataset_job_trains_on_the_users_rows_with_the_users_reward(local_ray, tmp_path):
    """A JSONL file and a reward function in a .py file, as a user brings them. The driver and the spawned
    reward workers load the function; every trained sample's reward is what it returned for its row (the
    row's weight), and a row on which it raises fails only its own samples (reward 0, score errors)."""
    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1, "weight": round(0.1 * n, 1)} for n in range(1, 7)]
    rows[2]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 1?"}]
    rows[3]["explode"] = True
    task = _dataset_task(tmp_path, rows, DATASET_REWARD, stem="mine")
    result = _run(
        tmp_path,
        max_lag=1,
        steps=3,
        task=task,
        learner={"num_ranks": 1},
        eval={"every_steps": 3, "num_problems": 6, "samples_per_problem": 2, "temperature": 1.0},
        logging={"run_name": "dataset"},
    )
    expected = {f"mine-{line:06d}": 0.0 if row.get("explode") else row["weight"] for line, row in enumerate(rows, 1)}
    ledger = [json.loads(line) for line in (result.run_dir / "ledger.jsonl").read_text().splitlines()]
    errors = {r["problem_id"]: r["score_errors"] for r in ledger if r["event"] == "scored"}
    assert set(errors) <= set(expected) and "mine-000004" in errors
    assert {p: n for p, n in errors.items() if n} == {"mine-000004": 4}  # its 4 samples, no other
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in (m for m in metrics if m["train/step"] > 0 and not is_evaluation_row(m)):
        step = row["train/step"] - 1  # the ledger counts the policy version a group was trained on
        trained = [r["problem_id"] for r in ledger if r["event"] == "trained" and r["trained_step"] == step]
        assert row["rollout/reward_mean"] == pytest.approx(sum(expected[p] for p in trained) / len(trained))
    steps = [m for m in metrics if m["train/step"] > 0 and not is_evaluation_row(m)]
    # counted in each row with responses scored since the previous one (no key, never NaN, in a row without)
    counted = [row["rollout/score_errors"] for row in steps if "rollout/score_errors" in row]
    assert counted and all(count >= 0 for count in counted)
    scored_errors = sum(r["score_errors"] for r in ledger if r["event"] == "scored")  # a problem may come twice
    assert sum(counted) <= scored_errors
    dropped = [r for r in ledger if r["event"] == "dropped" and r["problem_id"] == "mine-000004"]
    assert dropped and "4 of 4 responses failed to score (the first: raised ValueError" in dropped[0]["reason"]
    assert not any(r["event"] == "trained" and r["problem_id"] == "mine-000004" for r in ledger)
    final = metrics[-1]  # the last evaluation, of step 3, is the last row
    assert is_evaluation_row(final) and final["eval/policy_version"] == 3
    assert final["eval/problems"] == 6 and final["eval/score_errors"] == 2  # the raising row's two answers
    assert final["eval/reward_mean"] == pytest.approx(sum(expected.values()) / 6)


NEVER_A_NUMBER_REWARD = """
import math

def score(completion, answer, row):
    return [math.nan, None, "1.0", math.inf, 1e30][len(completion) % 5]
"""


def test_a_reward_that_never_returns_a_number_stops_the_run_naming_it(local_ray, tmp_path, caplog):
    """A user's reward returning NaN, None, the text "1.0", inf or 1e30: nothing trains on a stand-in 0. The first
    failure is said once, naming task.reward and the value; after a step's worth of responses without one
    scored, the run stops with an error that says what to fix (it used to end 'successfully' at reward 0)."""
    from cluster.run.faults import RewardsFailed

    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1} for n in range(1, 7)]
    task = _dataset_task(tmp_path, rows, NEVER_A_NUMBER_REWARD, stem="broken")
    with caplog.at_level("WARNING", logger="stableasync"), pytest.raises(RewardsFailed) as stopped:
        _run(tmp_path, max_lag=1, steps=4, task=task, logging={"run_name": "broken"})
    message = str(stopped.value)
    assert "8 responses in a row failed to score" in message and "broken_reward.py:score" in message
    assert "learner.prompts_per_step x generator.samples_per_prompt" in message and "--resume" in message
    said = [r.getMessage() for r in caplog.records if "ALERT reward failed" in r.getMessage()]
    assert len(said) == 1 and "task.reward" in said[0] and "returned" in said[0], said
    ledger = [json.loads(line) for line in (tmp_path / "runs" / "broken" / "ledger.jsonl").read_text().splitlines()]
    assert not any(r["event"] == "trained" for r in ledger)
    assert all("failed to score" in r["reason"] for r in ledger if r["event"] == "dropped" and r["reason"])


SOMETIMES_UNIFORM_REWARD = """
import random

def score(completion, answer, row):
    return row["reward"] if "reward" in row else float(random.random() < 0.5)
"""


def test_uniform_reward_groups_are_dropped_and_replaced_so_every_step_trains_groups_with_signal(local_ray, tmp_path):
    """Half the rows score the same for every response (their groups carry no advantage), the other half score
    each response at random. With algorithm.drop_uniform_groups, the first kind never reaches the learner: each
    is dropped with why, and the steps fill up with the second kind."""
    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1, **({"reward": 1.0} if n % 2 else {})} for n in range(6)]
    task = _dataset_task(tmp_path, rows, SOMETIMES_UNIFORM_REWARD)
    result = _run(
        tmp_path,
        max_lag=1,
        steps=3,
        task=task,
        learner={"num_ranks": 1},
        algorithm={"drop_uniform_groups": True},
        logging={"run_name": "uniform"},
    )
    ledger = [json.loads(line) for line in (result.run_dir / "ledger.jsonl").read_text().splitlines()]
    uniform_rows = {f"rows-{line:06d}" for line, row in enumerate(rows, 1) if "reward" in row}
    trained = [r["problem_id"] for r in ledger if r["event"] == "trained"]
    assert len(trained) == 3 * 2 and not uniform_rows & set(trained)
    dropped = [r for r in ledger if r["event"] == "dropped" and r["reason"].startswith("uniform rewards")]
    assert {r["problem_id"] for r in dropped} >= uniform_rows  # every such row was drawn, none trained
    assert all(
        r["reason"] == "uniform rewards: all 4 responses scored 1, so every advantage is 0 "
        "(algorithm.drop_uniform_groups)"
        for r in dropped
        if r["problem_id"] in uniform_rows
    )
    steps = [
        m
        for m in (json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines())
        if m["train/step"] > 0 and not is_evaluation_row(m)
    ]
    assert len(steps) == 3
    # responses scored since the previous row: none between some rows (the key left out), so not every row has them
    assert all(0 <= m["rollout/scored_reward_mean"] <= 1 for m in steps if "rollout/scored_reward_mean" in m)
    assert 0 < sum(m["rollout/uniform_groups_dropped"] for m in steps) <= len(dropped)


@pytest.mark.slow  # 35 s; tests/unit/actors/test_buffer.py and test_rewards.py cover the penalty and its metric
def test_overlong_shaping_lowers_the_rewards_trained_on_by_length_and_leaves_evaluation_alone(local_ray, tmp_path):
    """Every response scores 1 from the verifier. With the whole response inside the overlong buffer (8 of
    max_new_tokens 8) at penalty 0.5, a response of n tokens is trained on with reward 1 - n / 16: below 1 for
    every response, at least 0.5. Evaluation scores correctness, unshaped: exactly 1."""
    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1, "reward": 1.0} for n in range(4)]
    task = _dataset_task(tmp_path, rows, SOMETIMES_UNIFORM_REWARD)
    result = _run(
        tmp_path,
        max_lag=1,
        steps=3,
        task=task,
        learner={"num_ranks": 1},
        algorithm={"overlong_buffer_tokens": 8, "overlong_penalty": 0.5},
        eval={"every_steps": 3, "num_problems": 4},
        logging={"run_name": "overlong"},
    )
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["train/step"] > 0 and not is_evaluation_row(m)]
    assert len(steps) == 3
    assert all(0.5 <= step["rollout/reward_mean"] <= 1 - 1 / 16 for step in steps), steps
    # responses scored since the previous row: none between some rows (the key left out), so not every row has them
    scored = [step for step in steps if "rollout/overlong_penalty_mean" in step]
    assert scored and all(-0.5 <= step["rollout/overlong_penalty_mean"] <= -1 / 16 for step in scored), steps
    assert all(0 <= step["rollout/truncated_share"] <= 1 for step in scored)
    evaluation = metrics[-1]
    assert is_evaluation_row(evaluation) and evaluation["eval/reward_mean"] == 1.0


def test_a_task_whose_groups_all_score_uniformly_halts_with_a_checkpoint_instead_of_sampling_forever(
    local_ray, tmp_path, capsys
):
    from actors.buffer import audit_ledger

    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1, "reward": 0.0} for n in range(4)]
    task = _dataset_task(tmp_path, rows, SOMETIMES_UNIFORM_REWARD)
    job = _job(
        tmp_path,
        max_lag=1,
        steps=3,
        task=task,
        learner={"num_ranks": 1},
        algorithm={"drop_uniform_groups": True, "max_uniform_groups_in_a_row": 5},
        logging={"run_name": "all-uniform"},
    )
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert cli_main(["train", str(tmp_path / "job.yaml")]) == 1
    error = capsys.readouterr().err
    assert "prompt groups in a row were dropped because every response scored the same" in error, error
    assert "(algorithm.max_uniform_groups_in_a_row = 5)" in error and "stableasync train --resume" in error
    run_dir = tmp_path / "runs" / "all-uniform"
    assert (run_dir / "checkpoints" / "step-000000" / "driver.json").exists()
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(ledger) == [] and not [r for r in ledger if r["event"] == "trained"]
    assert sum(r["event"] == "dropped" and r["reason"].startswith("uniform rewards") for r in ledger) >= 5


def test_bad_job_file_names_the_field_and_starts_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "task: {name: arithmetic}\nlearner: {num_ranks: two}\nasync: {max_lag: -3}\n"
        f"logging: {{run_dir: {tmp_path / 'runs'}}}\n"
    )
    was_running = ray.is_initialized()
    assert cli_main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "learner.num_ranks" in err and "async.max_lag" in err
    assert not (tmp_path / "runs").exists()
    assert ray.is_initialized() == was_running


def test_resume_from_a_checkpoint_continues_without_gap_or_duplicate(local_ray, tmp_path, capsys, caplog):
    """A run checkpoints at steps 2 and 4; with step 4's checkpoint damaged (a crash while it was
    being replaced), `--resume` falls back to step 2: the ledger and metrics are cut back there,
    in-flight groups are issued again, and every step's groups are trained exactly once. Step 2's
    evaluation was still running at its checkpoint (its row came after the cut): the resume answers it
    again on the restored weights, so each evaluation has one row, and each step's rollout samples one set."""
    job = _job(
        tmp_path,
        max_lag=1,
        steps=4,
        logging={"run_name": "resumed", "samples": {"every_steps": 1}},
        checkpoint={"every_steps": 2},
        eval={"every_steps": 2, "num_problems": 4},
    )
    run_dir = tmp_path / "runs" / "resumed"
    from cluster.run.driver import train

    train(validate_job(job))
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step-000002", "step-000004"]
    _assert_the_last_checkpoint_exports_the_saved_model(run_dir, capsys)
    (run_dir / "checkpoints" / "step-000004" / "driver.json").write_text('{"version": 4, "trunc')

    assert json.loads((run_dir / "checkpoints" / "step-000002" / "driver.json").read_text())["evaluating"] == [2]

    with caplog.at_level("INFO", logger="stableasync"):
        assert cli_main(["train", "--resume", str(run_dir)]) == 0
    assert "evaluating step 2 again: its evaluation was in flight at the checkpoint" in caplog.text
    _assert_each_group_ends_once(run_dir, steps=4)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["train/step"], m["eval/policy_version"]) for m in metrics if is_evaluation_row(m)] == [(2, 2), (4, 4)]
    cut = json.loads((run_dir / "checkpoints" / "step-000002" / "driver.json").read_text())["ledger_lines"]
    assert (run_dir / f"ledger.after-{cut}.jsonl").exists()
    samples = [json.loads(line)["step"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4  # steps 3 and 4 cut back and logged again
    assert (run_dir / "samples.after-8.jsonl").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert json.loads((run_dir / "checkpoints" / "step-000004" / "driver.json").read_text())["version"] == 4


@pytest.mark.slow  # about 70 s: a 4-step run and its resume
def test_a_streaming_run_resumes_from_a_checkpoint_with_every_group_once(local_ray, tmp_path):
    """A streaming run's checkpoint at step 2 holds its buffered groups with their version spans and the groups
    in flight; resumed from it (step 4's damaged), every step's groups are trained once and each trained step
    logs its tokens' lags again."""
    job = _job(
        tmp_path,
        max_lag=2,
        steps=4,
        logging={"run_name": "streaming-resumed"},
        checkpoint={"every_steps": 2},
        generator={"streaming": True, "requests_in_flight": 2, "prompts_per_request": 1},
    )
    run_dir = tmp_path / "runs" / "streaming-resumed"
    from cluster.run.driver import train

    train(validate_job(job))
    (run_dir / "checkpoints" / "step-000004" / "driver.json").write_text('{"version": 4, "trunc')
    state = json.loads((run_dir / "checkpoints" / "step-000002" / "driver.json").read_text())
    assert all(c["version_spans"] for group in state["ready"] for c in group["completions"])
    assert cli_main(["train", "--resume", str(run_dir)]) == 0
    _assert_each_group_ends_once(run_dir, steps=4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["train/step"] > 0 and "async/token_lag" in r]
    assert [r["train/step"] for r in steps] == [1, 2, 3, 4]
    assert all(len(r["async/token_lag"]) <= 3 and sum(r["async/token_lag"]) > 0 for r in steps)  # lags 0 to 2


@pytest.mark.slow  # 60 s: a 2-step run and its resume
def test_a_checkpoint_whose_rank_1_shard_is_damaged_resumes_both_ranks_from_the_older_one(local_ray, tmp_path, caplog):
    """Only rank 1's ZeRO optimizer shard of the newest checkpoint is damaged (cut short on disk). Rank 1 fails
    to load it while rank 0 loads its own: `--resume` must not go on from two different steps, nor wait on a
    rank, but load the older checkpoint on both ranks, train step 2 again, and write a whole step 2. The log
    names the rank that failed."""
    job = _job(
        tmp_path, max_lag=1, steps=2, logging={"run_name": "damaged-shard"}, checkpoint={"every_steps": 1, "keep": 3}
    )
    run_dir = tmp_path / "runs" / "damaged-shard"
    from cluster.run.driver import train

    train(validate_job(job))
    (shard,) = (run_dir / "checkpoints" / "step-000002").rglob("zero_pp_rank_1_*optim_states.pt")
    whole = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:1000])

    with caplog.at_level("INFO", logger="stableasync"):
        assert cli_main(["train", "--resume", str(run_dir)]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any("step-000002 did not load" in m and "trying an older checkpoint" in m for m in messages), messages
    failed = [m for m in messages if "failed in load_checkpoint" in m]
    assert failed == ["learner rank(s) [1] failed in load_checkpoint; the error of rank 1 follows"], messages
    assert any("from step-000001 (policy version 1)" in m for m in messages), messages
    _assert_each_group_ends_once(run_dir, steps=2)
    assert shard.stat().st_size == whole, "the resumed run wrote step 2's checkpoint again, whole"


def _assert_the_last_checkpoint_exports_the_saved_model(run_dir: Path, capsys) -> None:
    """`stableasync export` merges the two ranks' ZeRO shards of the last step's checkpoint into a model
    folder with exactly the weights the finished run saved in RUN_DIR/model."""
    import torch
    from safetensors.torch import load_file

    blocked = run_dir / "summary.json" / "model"  # under a file: no folder can be written there
    assert cli_main(["export", str(run_dir), "--checkpoint", "step-000004", "--out", str(blocked)]) == 1
    reason = capsys.readouterr().err.rstrip().splitlines()[-1]  # after the shard-writing progress bar
    assert reason.startswith(f"stableasync export: the model could not be written to {blocked}: "), reason
    assert "Not a directory" in reason, reason
    assert not (run_dir / "summary.json").is_dir() and not list(run_dir.glob(".*.tmp"))
    assert cli_main(["export", str(run_dir), "--checkpoint", "step-000004"]) == 0
    exported = load_file(run_dir / "model-step-000004" / "model.safetensors")
    saved = load_file(run_dir / "model" / "model.safetensors")
    assert set(exported) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    assert (run_dir / "model-step-000004" / "tokenizer.json").exists()


@pytest.mark.slow  # 50 s; tests/component/test_regularizers.py checks the ranks' reload in the default suite
def test_the_kl_reference_is_the_policy_after_the_warm_up(local_ray, tmp_path):
    """algorithm.kl.reference rl_start (the default): the driver writes the warmed-up policy to RUN_DIR/reference
    and the ranks measure the KL against it, so the first RL step's KL is 0, not the warm-up's distance."""
    result = _run(
        tmp_path,
        max_lag=0,
        steps=2,
        logging={"run_name": "reference"},
        learner={"num_ranks": 1},
        algorithm={"kl": {"coef": 0.01}},
    )
    assert (result.run_dir / "reference" / "config.json").is_file()
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [m["stability/kl_ref_mean"] for m in metrics if "stability/kl_ref_mean" in m]
    assert len(kl) == 2 and kl[0] == 0.0 < kl[1]


def test_a_lora_job_with_kl_and_entropy_trains_the_adapter_and_exports_it(local_ray, tmp_path, capsys):
    """model.lora: the learners train an adapter, the generator samples with each version's adapter, the
    saved model and the checkpoint's export are the same merged model, each with the adapter beside it, and
    the run resumes from a checkpoint. The KL
    term (its reference is the base model, the adapter off: the model before the SFT warm-up) and the entropy
    bonus ride along."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    job = _job(
        tmp_path,
        max_lag=0,
        steps=2,
        logging={"run_name": "lora"},
        checkpoint={"every_steps": 1},
        learner={"num_ranks": 1},
        model={"lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}},
        algorithm={"kl": {"coef": 0.01, "reference": "model"}, "entropy_coef": 0.001},
    )
    from cluster.run.driver import train

    result = train(validate_job(job))
    run_dir = result.run_dir
    _assert_each_group_ends_once(run_dir, steps=2)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [m["stability/kl_ref_mean"] for m in metrics if "stability/kl_ref_mean" in m]
    assert len(kl) == 2 and 0 < kl[0] < kl[-1]  # the reference is the model before the warm-up trained the adapter
    trained = _trained(run_dir)
    assert max(r["issued_version"] for r in trained) >= 1  # the generator sampled with an RL-trained adapter

    assert cli_main(["export", str(run_dir), "--checkpoint", "step-000002"]) == 0
    saved, exported = (load_file(run_dir / name / "model.safetensors") for name in ("model", "model-step-000002"))
    assert set(exported) == set(saved)
    for name, tensor in saved.items():
        assert torch.allclose(exported[name], tensor, atol=1e-6), name
    adapter_config = json.loads((run_dir / "model" / "adapter" / "adapter_config.json").read_text())
    base_path = adapter_config["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    assert any(not torch.equal(base.state_dict()[name], tensor) for name, tensor in saved.items())
    adapted = PeftModel.from_pretrained(base, str(run_dir / "model-step-000002" / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(adapted(ids).logits, merged(ids).logits, atol=1e-4)

    # resume from step 1's checkpoint (step 2's damaged): the adapter and its optimizer state load back
    (run_dir / "checkpoints" / "step-000002" / "driver.json").write_text('{"version": 2, "trunc')
    assert cli_main(["train", "--resume", str(run_dir)]) == 0
    _assert_each_group_ends_once(run_dir, steps=2)


@pytest.mark.slow  # 85 s: a whole job; tests/component/test_reward_model_actor.py runs the actor in the default suite
def test_a_job_with_a_reward_model_logs_each_component(local_ray, tiny_qwen2, tmp_path):
    """A composite reward: the task's verifier, a reward model in its own actor and the format term, each
    component in the step rows, every sample scored without a failure."""
    from cluster.run.driver import train
    from tests.unit.cluster.test_composite_rewards import build_tiny_reward_model

    reward_model = build_tiny_reward_model(tiny_qwen2, tmp_path / "rm")
    job = _job(
        tmp_path,
        max_lag=1,
        steps=2,
        learner={"num_ranks": 1, "prompts_per_step": 2},
        model={"sft_warmup": {"steps": 0}},
        scoring={
            "timeout_s": 60,
            "rewards": [  # generous: a shared CI machine may be slow, not failing
                {"name": "task", "weight": 1.0},
                {"name": "reward_model", "weight": 0.5, "path": reward_model, "max_length": 64, "timeout_s": 300},
                {"name": "format", "weight": 0.1},
            ],
        },
    )
    result = train(validate_job(job))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["train/step"] > 0]
    assert [row["train/step"] for row in steps] == [1, 2]
    for key in ("rollout/reward_task_mean", "rollout/reward_reward_model_mean", "rollout/reward_format_mean"):
        assert all(key in row for row in steps) and any(math.isfinite(row[key]) for row in steps), key
    ledger = [json.loads(line) for line in (result.run_dir / "ledger.jsonl").read_text().splitlines()]
    scored = [row for row in ledger if row["event"] == "scored"]
    assert scored and all(row["score_errors"] == 0 for row in scored)
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    rule_only = {round(task + 0.1 * form, 6) for task in (0.0, 0.1, 1.0) for form in (0, 1)}
    assert samples and any(round(s["reward"], 6) not in rule_only for s in samples), "the reward model adds its part"


def test_killed_learner_resumes_from_its_checkpoint_by_itself(local_ray, tmp_path):
    import threading

    from cluster.run.driver import run_job

    job = _job(
        tmp_path,
        max_lag=1,
        steps=4,
        logging={"run_name": "killed-learner"},
        checkpoint={"every_steps": 1},
        learner={"num_ranks": 1, "max_restarts": 1},
    )
    run_dir = tmp_path / "runs" / "killed-learner"
    killed: list[int] = []
    killer = threading.Thread(
        target=_kill_after_step, args=(run_dir, "killed-learner-learner-0", killed, 2), daemon=True
    )
    killer.start()
    result = run_job(validate_job(job))
    killer.join(timeout=5)
    assert killed, "the learner was killed during the run"
    assert json.loads((result.run_dir / "summary.json").read_text())["learner_restarts"] == 1
    _assert_each_group_ends_once(run_dir, steps=4)


@pytest.mark.slow  # 90 s: a run and two learner restarts
def test_a_learner_killed_while_publishing_and_again_while_loading_resumes_from_its_checkpoint(
    local_ray, tmp_path, monkeypatch, caplog
):
    """The learner rank is SIGKILLed as step 2's weights are published (step 2 trained, its row and checkpoint
    not yet written), and the restarted rank again while it loads step 1's checkpoint. Each time the job
    restarts the learners from its latest checkpoint on its own and says what they were doing; the third
    learner group loads it, and every group is trained exactly once."""
    import os
    import signal

    from cluster.run import learner_group, weight_sync
    from cluster.run.driver import run_job

    publish, load_checkpoint = weight_sync.ObjectStorePublisher.publish, learner_group.LearnerGroup.load_checkpoint
    killed: list[str] = []

    def kill_rank_0(learners: learner_group.LearnerGroup, doing: str) -> None:
        killed.append(doing)
        os.kill(ray.get(learners.ranks[0].process_id.remote()), signal.SIGKILL)

    def kill_then_publish(self, version: int) -> None:
        if version == 2 and "publishing" not in killed:
            kill_rank_0(self.learners, "publishing")
        publish(self, version)

    def kill_then_load(self, directory: str, tag: str) -> int:
        if "loading" not in killed:
            kill_rank_0(self, "loading")
        return load_checkpoint(self, directory, tag)

    monkeypatch.setattr(weight_sync.ObjectStorePublisher, "publish", kill_then_publish)
    monkeypatch.setattr(learner_group.LearnerGroup, "load_checkpoint", kill_then_load)
    job = _job(
        tmp_path,
        max_lag=1,
        steps=4,
        logging={"run_name": "killed-publishing"},
        checkpoint={"every_steps": 1},
        learner={"num_ranks": 1, "max_restarts": 2},
    )
    with caplog.at_level("INFO", logger="stableasync"):
        result = run_job(validate_job(job))
    assert killed == ["publishing", "loading"]
    resumed = [r.getMessage() for r in caplog.records if "from its latest checkpoint" in r.getMessage()]
    assert len(resumed) == 2, resumed
    assert "while publishing weights (ActorDiedError" in resumed[0] and "(restart 1 of 2)" in resumed[0], resumed
    assert "while loading a checkpoint (ActorDiedError" in resumed[1] and "(restart 2 of 2)" in resumed[1], resumed
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming ")]
    assert len(loaded) == 1 and "from step-000001 (policy version 1)" in loaded[0], loaded
    assert json.loads((result.run_dir / "summary.json").read_text())["learner_restarts"] == 2
    _assert_each_group_ends_once(result.run_dir, steps=4)


def test_a_checkpoint_or_model_the_learner_cannot_write_is_an_alert_and_loses_nothing(
    local_ray, tmp_path, monkeypatch, caplog
):
    """Step 2's checkpoint and then the trained model meet a real filesystem error inside the learner (a file
    where DeepSpeed makes its folder, a folder where the weights file goes), as a full disk would fail them.
    The checkpoint's partial folder is removed, an alert names the step and the error, and the run trains to
    its end with the checkpoints before and after it. The model that cannot be written is an alert and a
    `model_error` in the result and summary that points at the last checkpoint, which exports as said."""
    from cluster.run import learner_group

    save_checkpoint, save_model = learner_group.LearnerGroup.save_checkpoint, learner_group.LearnerGroup.save_model

    def blocked_at_step_2(self, directory: str, tag: str) -> None:
        if ".step-000002.tmp" in directory:
            Path(directory).write_text("in the way")
        save_checkpoint(self, directory, tag)

    def blocked_model(self, directory: str) -> None:
        (Path(directory) / "model.safetensors").mkdir(parents=True)  # where the weights file goes
        save_model(self, directory)

    monkeypatch.setattr(learner_group.LearnerGroup, "save_checkpoint", blocked_at_step_2)
    monkeypatch.setattr(learner_group.LearnerGroup, "save_model", blocked_model)
    run_dir = tmp_path / "runs" / "full-disk"
    with caplog.at_level("WARNING", logger="stableasync"):
        result = _run(
            tmp_path,
            max_lag=1,
            steps=3,
            logging={"run_name": "full-disk"},
            checkpoint={"every_steps": 1, "keep": 3},
            learner={"num_ranks": 1},
        )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000001", "step-000003"]
    alerts = [r.getMessage() for r in caplog.records if "ALERT checkpoint failed" in r.getMessage()]
    assert len(alerts) == 1 and "step 2" in alerts[0] and "Error" in alerts[0], alerts
    assert "newest usable checkpoint is step-000001" in alerts[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoint_failures"] == 1
    _assert_each_group_ends_once(run_dir, steps=3)

    assert result.model_dir is None and summary["model"] is None and not (run_dir / "model").exists()
    assert result.model_error == summary["model_error"]
    assert f"could not be written to {run_dir / 'model'}: " in result.model_error
    assert f"step-000003, holds the policy of step 3: stableasync export {run_dir}" in result.model_error
    model_alerts = [r.getMessage() for r in caplog.records if "ALERT trained model not saved" in r.getMessage()]
    assert len(model_alerts) == 1 and result.model_error in model_alerts[0]
    assert cli_main(["export", str(run_dir)]) == 0  # the recovery the message gives
    assert (run_dir / "model-step-000003" / "config.json").exists()


@pytest.mark.slow  # 90 s: a run, a 5 s wait and a learner restart
def test_one_rank_that_cannot_write_its_shard_restarts_the_learners_instead_of_hanging(
    local_ray, tmp_path, monkeypatch, caplog
):
    """Rank 1's ZeRO shard of step 2's checkpoint meets a real write error (a folder where the file goes) while
    rank 0 has written its part and waits in DeepSpeed's closing barrier, which it would leave only at the
    process-group timeout (DeepSpeed's default: 10 minutes). The driver sees rank 0 still inside the call
    after `rank_straggle_s`, restarts the learners from step 1's checkpoint, and the run ends with every
    group trained once."""
    from cluster.run import learner_group

    save = learner_group.LearnerGroup.save_checkpoint
    blocked = []

    def rank_1_blocked_once(self, directory: str, tag: str) -> None:
        if ".step-000002.tmp" in directory and not blocked:
            blocked.append(directory)
            (Path(directory) / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").mkdir(parents=True)
        save(self, directory, tag)

    monkeypatch.setattr(learner_group.LearnerGroup, "save_checkpoint", rank_1_blocked_once)
    run_dir = _run_with_rank_1_failing_once(
        tmp_path, monkeypatch, caplog, "rank-1-full", "learner rank 1 failed in save_checkpoint (RayTaskError(OSError)"
    )
    assert blocked, "step 2's checkpoint was blocked for rank 1"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000001", "step-000002", "step-000003"]


def _run_with_rank_1_failing_once(tmp_path, monkeypatch, caplog, run_name: str, failure: str) -> Path:
    """A 3-step, 2-rank run checkpointing every step, in which rank 1 fails once while rank 0 waits: the log
    says the group broke with `failure`, the learners restarted once, and every group ends once."""
    from cluster.run import learner_group

    monkeypatch.setattr(learner_group.LearnerGroup, "rank_straggle_s", 5.0)
    with caplog.at_level("WARNING", logger="stableasync"):
        result = run_job_in(
            tmp_path, max_lag=1, steps=3, logging={"run_name": run_name}, checkpoint={"every_steps": 1, "keep": 3}
        )
    resumed = [r.getMessage() for r in caplog.records if "from its latest checkpoint" in r.getMessage()]
    assert len(resumed) == 1, resumed
    assert failure in resumed[0] and "rank(s) [0] had not ended theirs 5 s later" in resumed[0], resumed[0]
    assert json.loads((result.run_dir / "summary.json").read_text())["learner_restarts"] == 1
    _assert_each_group_ends_once(result.run_dir, steps=3)
    return result.run_dir


@pytest.mark.slow  # 90 s: a run, a 5 s wait and a learner restart
def test_one_rank_that_raises_in_a_step_restarts_the_learners_instead_of_hanging(
    local_ray, tmp_path, monkeypatch, caplog
):
    """Rank 1 raises in step 2's forward (a batch it cannot embed, as an out-of-memory batch would fail one
    GPU) while rank 0 waits for it in the step's first all-reduce. The loop wakes on rank 1's error, sees rank
    0 still inside the step `rank_straggle_s` later, and restarts the learners from step 1's checkpoint."""
    import dataclasses

    from cluster.run import driver

    shards = driver.AsyncLoop._shards
    broken: list[int] = []

    def rank_1_unembeddable_once(self, groups):
        batches = shards(self, groups)
        if self.version == 1 and not broken:
            broken.append(self.version)
            batches[1] = dataclasses.replace(batches[1], input_ids=batches[1].input_ids.float())
        return batches

    monkeypatch.setattr(driver.AsyncLoop, "_shards", rank_1_unembeddable_once)
    _run_with_rank_1_failing_once(
        tmp_path,
        monkeypatch,
        caplog,
        "rank-1-raises",
        "broke the group during step 2 (LearnerGroupBroken: learner rank 1 failed in train_step",
    )
    assert broken, "step 2's batch was broken for rank 1"


def test_nan_rollouts_skip_steps_then_stop_the_job_with_a_checkpoint(local_ray, tmp_path, monkeypatch, caplog):
    """From step 3 on, every rollout reaches the learner with NaN behaviour log-probs (a broken engine):
    each such step is skipped on every rank and alerts, its groups are dropped (not trained) in the
    ledger, and after learner.max_skipped_steps_in_a_row the job stops with a checkpoint to resume from."""
    from cluster.run import driver
    from cluster.run.faults import NumericalFailure

    shards_of = driver.AsyncLoop._shards

    def poisoned(self, groups):
        shards = shards_of(self, groups)
        if self.version >= 2:
            for shard in shards:
                shard.behaviour_logprobs.fill_(float("nan"))
        return shards

    monkeypatch.setattr(driver.AsyncLoop, "_shards", poisoned)
    job = _job(tmp_path, max_lag=1, steps=10, logging={"run_name": "nan"}, learner={"max_skipped_steps_in_a_row": 3})
    run_dir = tmp_path / "runs" / "nan"
    with pytest.raises(NumericalFailure, match=r"3 steps in a row.*stableasync train --resume"):
        driver.train(validate_job(job))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["stability/skipped_step"] for m in metrics if m["train/step"] > 0] == [0, 0, 1, 1, 1]
    assert caplog.text.count("ALERT learner step skipped") == 3
    assert (run_dir / "checkpoints" / "step-000005" / "driver.json").exists()
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["event"] == "trained"]
    skipped = [r for r in rows if r["event"] == "dropped" and "skipped" in (r["reason"] or "")]
    assert sorted(r["trained_step"] for r in trained) == [0, 0, 1, 1]
    assert len(skipped) == 3 * 2


def test_a_hanging_verifier_fails_its_samples_and_the_job_goes_on(local_ray, tmp_path, monkeypatch):
    """The job's verifier hangs on every third problem: those samples time out after the job's
    scoring.timeout_s (reward 0, counted as score errors in the ledger), the worker is replaced, and every
    group still ends exactly once."""
    from cluster.run import driver, evaluation
    from tasks.scoring import ScorePool

    def hanging_pool(task_name, task_config, **scoring):
        assert scoring["timeout_s"] == 0.5, "the driver passes the job's scoring section"
        return ScorePool("hanging-arithmetic", task_config, extra_modules=("tasks.testing",), **scoring)

    monkeypatch.setattr(evaluation, "ScorePool", hanging_pool)  # verifier_pool builds the loop's verifiers
    job = _job(tmp_path, max_lag=1, steps=3, logging={"run_name": "hanging"}, scoring={"timeout_s": 0.5})
    driver.train(validate_job(job))
    run_dir = tmp_path / "runs" / "hanging"
    rows = _assert_each_group_ends_once(run_dir, steps=3)
    scored = {r["problem_id"]: r["score_errors"] for r in rows if r["event"] == "scored"}
    hung = {p for p in scored if int(p.rsplit("-", 1)[-1]) % 3 == 0}
    assert hung, "some trained problem had a hanging verifier"
    assert all(scored[p] == 4 for p in hung), "every sample of a hanging problem failed"
    assert all(scored[p] == 0 for p in set(scored) - hung)


def _session_processes(session_id: int) -> dict[int, str]:
    """The live processes of a session, pid -> name (/proc/PID/stat: state, then session id 4 fields on)."""
    processes = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == session_id and fields[0] != "Z":
            processes[int(stat.parent.name)] = name
    return processes


# a minute each in CI: run with -m slow. The default suite keeps Ctrl-C's parts: the driver's stop at a step
# boundary (test_stopping.py), verifier workers outliving a terminal's SIGINT (test_tasks_scoring.py)
@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_at_a_step_with_a_checkpoint_and_the_run_resumes(local_ray, tmp_path, signal_name):
    """Ctrl-C at a terminal signals its whole process group: the driver, the local Ray cluster it
    started and its verifier workers. The first one stops the run once the step in flight is done, with a
    checkpoint (none is configured), a complete ledger and W&B run, the resume command and exit 130;
    nothing of it is left running; `--resume` then finishes the run without gap or duplicate. SIGTERM
    (`kill PID`: the driver alone, whose handler ray.init replaces) does the same with exit 143."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.unit.cluster.test_metrics import _wandb_records

    steps = 12
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        json.dumps(
            _job(
                tmp_path,
                max_lag=1,
                steps=steps,
                logging={"run_name": "interrupted"},
                learner={"num_ranks": 1},
                cluster={"num_cpus": 2},
            )
        )
    )
    run_dir = tmp_path / "runs" / "interrupted"
    driver = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "train", str(job_file)],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal starts it
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (
        metrics.exists() and any(json.loads(line)["train/step"] >= 2 for line in metrics.read_text().splitlines())
    ):
        assert driver.poll() is None and time.monotonic() < deadline, "the job did not reach step 2"
        time.sleep(0.05)
    ray_cluster = {pid for pid, name in _session_processes(driver.pid).items() if name in ("gcs_server", "raylet")}
    assert len(ray_cluster) == 2, "the driver started a local Ray cluster in its session"
    number = getattr(signal, signal_name)
    if number == signal.SIGINT:
        os.killpg(driver.pid, number)
    else:
        os.kill(driver.pid, number)
    time.sleep(0.3)  # Ray's services block SIGINT: the stop relies on it, and takes longer than this
    assert driver.poll() is None and ray_cluster <= set(_session_processes(driver.pid)), (
        "the local Ray cluster outlives the Ctrl-C while the driver stops"
    )
    _, err = driver.communicate(timeout=120)

    assert driver.returncode == 128 + number, err[-3000:]
    stopped_at = int(err.split(f"stopped by {signal_name} after step ")[1].split(",")[0])
    assert 2 <= stopped_at < steps
    assert f"to continue: stableasync train --resume {run_dir}" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step-{stopped_at:06d}"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in rows if r["train/step"] > 0] == list(range(1, stopped_at + 1))
    from actors.buffer import audit_ledger

    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(ledger) == [], "every issued group ends once, trained or dropped with the reason"
    assert any(f"stopped by {signal_name}" in (r.get("reason") or "") for r in ledger if r["event"] == "dropped")
    assert all(r["score_errors"] == 0 for r in ledger if r["event"] == "scored"), (
        "no sample scored before the stop failed"
    )
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    kinds = [record.WhichOneof("record_type") for record in _wandb_records(wandb_file)]
    assert kinds.count("history") == 2 + stopped_at and "exit" in kinds  # SFT warm-up rows, then RL steps
    left = time.monotonic() + 15
    while _session_processes(driver.pid) and time.monotonic() < left:
        time.sleep(0.5)
    assert _session_processes(driver.pid) == {}, "the local Ray cluster and the workers ended with the driver"

    assert cli_main(["train", "--resume", str(run_dir)]) == 0
    _assert_each_group_ends_once(run_dir, steps=steps)


FAULTY_CALCULATOR = '''
import time

from tasks.builtin_tools import calculator as exact


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    first = expression.split()[0] if expression.split() else ""
    if first == "7":
        raise RuntimeError("calculator bug on purpose")
    if first == "8":
        print("x" * 10_000_000)
    if first == "9":
        time.sleep(600)
    return exact(expression)
'''


def _tool_job(tmp_path: Path, name: str) -> dict:
    """Arithmetic with a calculator that raises, prints 10 MB or hangs when the expression starts with 7, 8 or 9;
    the tiny model learns to call it in the warm-up."""
    tools = tmp_path / "faulty_tools.py"
    tools.write_text(FAULTY_CALCULATOR)
    return _job(
        tmp_path,
        max_lag=1,
        steps=4,
        model={"sft_warmup": {"steps": 60, "prompts_per_step": 16, "learning_rate": 5e-3}},
        environment={"tools": [f"{tools}:calculator"], "max_turns": 3, "tool_timeout_s": 1.0},
        generator={"max_new_tokens": 64, "max_model_len": 400},
        learner={"num_ranks": 1},
        checkpoint={"every_steps": 2},
        eval={"every_steps": 4, "num_problems": 4},
        logging={"run_name": name, "samples": {"every_steps": 1}},
    )


def test_tool_episodes_train_with_failing_tools_failing_only_their_episode(local_ray, tmp_path):
    """The warmed-up tiny model calls the calculator in most episodes; a call that raises, prints 10 MB or hangs
    fails that episode alone (not scored nor trained, its reason in the ledger) and the run trains or drops every
    group once within the lag bound. The samples show each episode's transcript, the tools' messages in it."""
    from cluster.run.driver import train

    train(validate_job(_tool_job(tmp_path, "tools")))
    run_dir = tmp_path / "runs" / "tools"
    rows = _assert_each_group_ends_once(run_dir, steps=4)
    assert max(r["lag"] for r in rows if r["event"] == "trained") <= 1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # a step row has the episode keys when episodes were scored since the previous row, and never a NaN for
    # "nothing scored" (a row whose step trained groups scored before the previous row leaves them out)
    every_step = [m for m in metrics if m["train/step"] > 0 and not is_evaluation_row(m)]
    assert not any(math.isnan(metric_number(m.get("rollout/tool_calls_mean", 0.0))) for m in every_step)
    steps = [m for m in every_step if "rollout/tool_calls_mean" in m]
    assert len(steps) >= 2, every_step
    assert sum(m["rollout/tool_calls_mean"] for m in steps) / len(steps) > 0.5
    assert sum(m["rollout/turns_mean"] for m in steps) / len(steps) > 1.5
    assert 0 < sum(m["rollout/tool_token_share"] for m in steps) / len(steps) < 0.6
    reasons = [reason for r in rows if r["event"] == "scored" for reason in r["sample_errors"] or []]
    assert reasons and all(reason.startswith("episode failed: tool calculator") for reason in reasons)
    assert any(m["rollout/failed_episode_share"] > 0 for m in steps)
    # the failed episodes were left out of training, each group's ledger saying so (or dropping the group)
    left_out = [
        r
        for r in rows
        if r["event"] in ("scored", "dropped") and "episodes failed for their tools' sake" in (r.get("reason") or "")
    ]
    assert left_out
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert any("<tool_call>" in s["completion"] and "\n[tool] " in s["completion"] for s in samples)
    evaluations = [m for m in metrics if is_evaluation_row(m)]
    assert [m["train/step"] for m in evaluations] == [4]  # the evaluation's episodes call the tools too


@pytest.mark.slow  # about 70 s
def test_a_streaming_generator_runs_episodes_across_weight_versions(local_ray, tmp_path):
    """Each episode takes its next turn when its tools answer, beside the others, while weights load: some groups'
    episodes span versions, every group is trained once and its lag, from its oldest token, within the bound."""
    from cluster.run.driver import train

    job = _tool_job(tmp_path, "tools-streaming")
    job["generator"].update(streaming=True, requests_in_flight=2, prompts_per_request=1)
    train(validate_job(job))
    rows = _assert_each_group_ends_once(tmp_path / "runs" / "tools-streaming", steps=4)
    trained = [r for r in rows if r["event"] == "trained"]
    assert max(r["lag"] for r in trained) <= 1
    assert all(r["lag"] == r["trained_step"] - r["sampled_versions"][0] for r in trained)
    assert any(r["sampled_versions"][1] > r["sampled_versions"][0] for r in trained), "no episode spanned a load"


@pytest.mark.slow  # about 80 s: a tool run and its resume
def test_a_tool_run_resumes_its_episodes_whole(local_ray, tmp_path):
    """Episodes in flight at the checkpoint are issued again whole on resume: every group still ends once."""
    from cluster.run.driver import train

    train(validate_job(_tool_job(tmp_path, "tools-resumed")))
    run_dir = tmp_path / "runs" / "tools-resumed"
    (run_dir / "checkpoints" / "step-000004" / "driver.json").write_text('{"version": 4, "trunc')
    assert cli_main(["train", "--resume", str(run_dir)]) == 0
    rows = _assert_each_group_ends_once(run_dir, steps=4)
    assert any(r["event"] == "reissued" for r in rows) or all(
        r["trained_step"] < 2 for r in rows if r["event"] == "trained" and r["reissues"]
    )
