"""Faults in whole jobs on a local Ray cluster: killed generators and learners, rewards that fail or hang, NaN
rollouts, storage that cannot be written, stop signals; each loses nothing and says what happened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from cluster.cli import main as cli_main  # noqa: E402
from cluster.job import validate_job  # noqa: E402
from tests.integration.whole_jobs import (  # noqa: E402  # noqa: E402
    NEVER_A_NUMBER_REWARD,
    SOMETIMES_UNIFORM_REWARD,
    WANDB_KEY,
    assert_each_group_ends_once,
    assert_no_file_holds,
    dataset_task,
    job_config,
    kill_after_step,
    run_job_here,
    run_with_rank_1_failing_once,
    session_processes,
    trained_rows,
)


@pytest.mark.parametrize("streaming", [False, pytest.param(True, marks=pytest.mark.slow)])  # 50 s more
def test_killed_generator_is_restarted_and_loses_no_group(local_ray, tmp_path, streaming, monkeypatch):
    """Killed during the run, a generator is restarted once and every group still ends once; a streaming
    one dies with several calls in flight, all of which fail and go out again, for one restart. The run
    stays within max_lag, the generator ran ahead of the learner, and the W&B key in the environment
    (passed to the actors, the restarted one too) is in no file of the run."""
    import threading

    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    job = job_config(
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
        target=kill_after_step, args=(run_dir, "killed-generator-generator-0", killed), daemon=True
    )
    killer.start()
    from cluster.run.driver import train

    result = train(validate_job(job))
    killer.join(timeout=5)
    assert killed, "the generator was killed during the run"
    assert json.loads((run_dir / "summary.json").read_text())["generator_restarts"] == 1
    rows = assert_each_group_ends_once(run_dir, steps=5)
    reissued = [r for r in rows if r["event"] == "reissued"]
    assert all("generator 0" in r["reason"] for r in reissued)
    assert result.ledger_counts["trained"] == 5 * 2
    lags = [r["lag"] for r in trained_rows(run_dir)]
    assert 1 <= max(lags) <= 2, lags
    assert_no_file_holds(run_dir, WANDB_KEY)


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
    job = job_config(
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
    rows = assert_each_group_ends_once(result.run_dir, steps=4)
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
    job = job_config(
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
    assert_each_group_ends_once(result.run_dir, steps=3)


def test_a_reward_that_never_returns_a_number_stops_the_run_naming_it(local_ray, tmp_path, caplog):
    """A user's reward returning NaN, None, the text "1.0", inf or 1e30: nothing trains on a stand-in 0. The first
    failure is said once, naming task.reward and the value; after a step's worth of responses without one
    scored, the run stops with an error that says what to fix (it used to end 'successfully' at reward 0)."""
    from cluster.run.faults import RewardsFailed

    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1} for n in range(1, 7)]
    task = dataset_task(tmp_path, rows, NEVER_A_NUMBER_REWARD, stem="broken")
    with caplog.at_level("WARNING", logger="stableasync"), pytest.raises(RewardsFailed) as stopped:
        run_job_here(tmp_path, max_lag=1, steps=4, task=task, logging={"run_name": "broken"})
    message = str(stopped.value)
    assert "8 responses in a row failed to score" in message and "broken_reward.py:score" in message
    assert "learner.prompts_per_step x generator.samples_per_prompt" in message and "--resume" in message
    said = [r.getMessage() for r in caplog.records if "ALERT reward failed" in r.getMessage()]
    assert len(said) == 1 and "task.reward" in said[0] and "returned" in said[0], said
    ledger = [json.loads(line) for line in (tmp_path / "runs" / "broken" / "ledger.jsonl").read_text().splitlines()]
    assert not any(r["event"] == "trained" for r in ledger)
    assert all("failed to score" in r["reason"] for r in ledger if r["event"] == "dropped" and r["reason"])


def test_a_task_whose_groups_all_score_uniformly_halts_with_a_checkpoint_instead_of_sampling_forever(
    local_ray, tmp_path, capsys
):
    from actors.buffer import audit_ledger

    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1, "reward": 0.0} for n in range(4)]
    task = dataset_task(tmp_path, rows, SOMETIMES_UNIFORM_REWARD)
    job = job_config(
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


def test_killed_learner_resumes_from_its_checkpoint_by_itself(local_ray, tmp_path):
    import threading

    from cluster.run.driver import run_job

    job = job_config(
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
        target=kill_after_step, args=(run_dir, "killed-learner-learner-0", killed, 2), daemon=True
    )
    killer.start()
    result = run_job(validate_job(job))
    killer.join(timeout=5)
    assert killed, "the learner was killed during the run"
    assert json.loads((result.run_dir / "summary.json").read_text())["learner_restarts"] == 1
    assert_each_group_ends_once(run_dir, steps=4)


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
    job = job_config(
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
    assert_each_group_ends_once(result.run_dir, steps=4)


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
        result = run_job_here(
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
    assert_each_group_ends_once(run_dir, steps=3)

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
    run_dir = run_with_rank_1_failing_once(
        tmp_path, monkeypatch, caplog, "rank-1-full", "learner rank 1 failed in save_checkpoint (RayTaskError(OSError)"
    )
    assert blocked, "step 2's checkpoint was blocked for rank 1"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000001", "step-000002", "step-000003"]


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
    run_with_rank_1_failing_once(
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
    job = job_config(
        tmp_path, max_lag=1, steps=10, logging={"run_name": "nan"}, learner={"max_skipped_steps_in_a_row": 3}
    )
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
    job = job_config(tmp_path, max_lag=1, steps=3, logging={"run_name": "hanging"}, scoring={"timeout_s": 0.5})
    driver.train(validate_job(job))
    run_dir = tmp_path / "runs" / "hanging"
    rows = assert_each_group_ends_once(run_dir, steps=3)
    scored = {r["problem_id"]: r["score_errors"] for r in rows if r["event"] == "scored"}
    hung = {p for p in scored if int(p.rsplit("-", 1)[-1]) % 3 == 0}
    assert hung, "some trained problem had a hanging verifier"
    assert all(scored[p] == 4 for p in hung), "every sample of a hanging problem failed"
    assert all(scored[p] == 0 for p in set(scored) - hung)


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
            job_config(
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
    ray_cluster = {pid for pid, name in session_processes(driver.pid).items() if name in ("gcs_server", "raylet")}
    assert len(ray_cluster) == 2, "the driver started a local Ray cluster in its session"
    number = getattr(signal, signal_name)
    if number == signal.SIGINT:
        os.killpg(driver.pid, number)
    else:
        os.kill(driver.pid, number)
    time.sleep(0.3)  # Ray's services block SIGINT: the stop relies on it, and takes longer than this
    assert driver.poll() is None and ray_cluster <= set(session_processes(driver.pid)), (
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
    while session_processes(driver.pid) and time.monotonic() < left:
        time.sleep(0.5)
    assert session_processes(driver.pid) == {}, "the local Ray cluster and the workers ended with the driver"

    assert cli_main(["train", "--resume", str(run_dir)]) == 0
    assert_each_group_ends_once(run_dir, steps=steps)
