"""Whole jobs on a local Ray cluster: vLLM generator, 2 DeepSpeed learner ranks, weight sync, ledger; the lag bound
checked from the version tags the generator put on every trained group, fixed lags, streaming, collective weight sync,
evaluations, placement."""

from __future__ import annotations

import json
import math

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from cluster.job import validate_job  # noqa: E402
from cluster.telemetry.run_files import is_evaluation_row  # noqa: E402
from tests.integration.whole_jobs import (  # noqa: E402  # noqa: E402
    WANDB_KEY,
    assert_each_group_ends_once,
    assert_no_file_holds,
    assert_rollout_samples_are_rank_zeros_groups,
    assert_the_trained_model_is_saved,
    run_job_here,
    trained_rows,
)


def test_synchronous_job_trains_only_lag_zero(local_ray, tmp_path):
    held_out = tmp_path / "held_out.jsonl"  # a named evaluation set in another task's format (eval.sets)
    held_out.write_text("".join(json.dumps({"prompt": f"What is {a} + 2?", "answer": a + 2}) + "\n" for a in range(3)))
    result = run_job_here(
        tmp_path,
        max_lag=0,
        eval={
            "every_steps": 2,
            "num_problems": 5,
            "before_training": True,
            "sets": {"held": {"path": str(held_out), "task": "dataset"}},
        },
    )
    trained = trained_rows(result.run_dir)
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
    assert_the_trained_model_is_saved(result, summary)
    assert_rollout_samples_are_rank_zeros_groups(result.run_dir, trained)
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


@pytest.mark.slow  # 26 s; the default run's killed-generator job checks the same bound and the same secret
def test_lagged_job_stays_within_max_lag(local_ray, tmp_path, monkeypatch):
    """With a W&B key in the environment (passed to the actors), no file of the run contains it."""
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    result = run_job_here(tmp_path, max_lag=2, steps=5)
    assert_no_file_holds(result.run_dir, WANDB_KEY)
    trained = trained_rows(result.run_dir)
    lags = [r["lag"] for r in trained]
    assert len(trained) == 5 * 2
    assert max(lags) <= 2
    assert max(lags) >= 1, "the generator ran ahead of the learner (asynchrony happened)"
    counts = result.ledger_counts
    assert counts["trained"] == len(trained) and set(counts) <= {"trained", "dropped"}


def test_a_fixed_lag_job_trains_every_group_exactly_k_versions_stale(local_ray, tmp_path):
    """async.fixed_lag 2: steps 1 and 2 train the initial policy's groups (lags 0 and 1), every later step
    groups sampled exactly 2 versions before; one step's worth sampled per step, none past the run."""
    result = run_job_here(tmp_path, max_lag=2, steps=5, **{"async": {"max_lag": 2, "fixed_lag": 2}})
    trained = trained_rows(result.run_dir)
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
    result = run_job_here(
        tmp_path,
        max_lag=1,
        steps=4,
        logging={"run_name": "streaming"},
        generator={"streaming": True, "requests_in_flight": 2, "prompts_per_request": 1},
    )
    trained = trained_rows(result.run_dir)
    assert len(trained) == 4 * 2 and max(r["lag"] for r in trained) <= 1
    assert max(r["trained_step"] - r["lag"] for r in trained) >= 2  # sampled with the weights of step 2 or later
    # the ledger names the oldest and newest version that sampled each group; the lag counts from the oldest
    for row in trained:
        oldest, newest = row["sampled_versions"]
        assert row["lag"] == row["trained_step"] - oldest and oldest <= newest <= row["trained_step"], row
    assert_each_group_ends_once(result.run_dir, steps=4)
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
    result = run_job_here(
        tmp_path, max_lag=1, steps=3, generator=generator, **{"async": {"max_lag": 1, "weight_sync": "gloo"}}
    )
    trained = trained_rows(result.run_dir)
    assert len(trained) == 3 * 2 and max(r["lag"] for r in trained) <= 1
    # the generator tags samples with the version it received over the broadcast
    assert max(r["trained_step"] - r["lag"] for r in trained) >= 1
    assert_each_group_ends_once(result.run_dir, steps=3)


# 27 s; the default suite runs ZeRO-3 VCPO on 2 ranks in tests/component/test_learner.py (the per-sample loop's
# update) and test_devices.py, and the W&B key check in test_lagged_job_stays_within_max_lag
@pytest.mark.slow
def test_vcpo_job_with_the_off_policy_baseline(local_ray, tmp_path):
    """VCPO end to end: ghost per-sample gradient norms feed the baseline on 2 ZeRO-3 ranks."""
    result = run_job_here(
        tmp_path, max_lag=1, steps=3, algorithm={"stabilizer": {"name": "vcpo"}}, learner={"zero_stage": 3}
    )
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if m["train/step"] > 0][-1]
    assert last["opob/fallback_to_loop"] == 0
    assert (
        last["opob/sample_grad_norm_mean"] > 0
        and last["opob/sample_grad_norm_max"] >= last["opob/sample_grad_norm_median"]
    )
    assert 0 < last["stability/lr_scale"] <= 1
    assert len(trained_rows(result.run_dir)) == 3 * 2


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
