"""What a user's job trains on a local Ray cluster: their own rows and reward, dynamic sampling, overlong shaping, a KL
reference, LoRA, a reward model, tool episodes; a bad job file starts nothing."""

from __future__ import annotations

import json
import math

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from cluster.cli import main as cli_main  # noqa: E402
from cluster.job import validate_job  # noqa: E402
from cluster.telemetry.run_files import is_evaluation_row, metric_number  # noqa: E402
from tests.integration.whole_jobs import (  # noqa: E402  # noqa: E402
    DATASET_REWARD,
    SOMETIMES_UNIFORM_REWARD,
    assert_each_group_ends_once,
    dataset_task,
    job_config,
    run_job_here,
    tool_job,
    trained_rows,
)


def test_a_dataset_job_trains_on_the_users_rows_with_the_users_reward(local_ray, tmp_path):
    """A JSONL file and a reward function in a .py file, as a user brings them. The driver and the spawned
    reward workers load the function; every trained sample's reward is what it returned for its row (the
    row's weight), and a row on which it raises fails only its own samples (reward 0, score errors)."""
    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1, "weight": round(0.1 * n, 1)} for n in range(1, 7)]
    rows[2]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 1?"}]
    rows[3]["explode"] = True
    task = dataset_task(tmp_path, rows, DATASET_REWARD, stem="mine")
    result = run_job_here(
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


def test_uniform_reward_groups_are_dropped_and_replaced_so_every_step_trains_groups_with_signal(local_ray, tmp_path):
    """Half the rows score the same for every response (their groups carry no advantage), the other half score
    each response at random. With algorithm.drop_uniform_groups, the first kind never reaches the learner: each
    is dropped with why, and the steps fill up with the second kind."""
    rows = [{"prompt": f"What is {n} + 1?", "answer": n + 1, **({"reward": 1.0} if n % 2 else {})} for n in range(6)]
    task = dataset_task(tmp_path, rows, SOMETIMES_UNIFORM_REWARD)
    result = run_job_here(
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
    task = dataset_task(tmp_path, rows, SOMETIMES_UNIFORM_REWARD)
    result = run_job_here(
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


@pytest.mark.slow  # 50 s; tests/component/test_regularizers.py checks the ranks' reload in the default suite
def test_the_kl_reference_is_the_policy_after_the_warm_up(local_ray, tmp_path):
    """algorithm.kl.reference rl_start (the default): the driver writes the warmed-up policy to RUN_DIR/reference
    and the ranks measure the KL against it, so the first RL step's KL is 0, not the warm-up's distance."""
    result = run_job_here(
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

    job = job_config(
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
    assert_each_group_ends_once(run_dir, steps=2)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [m["stability/kl_ref_mean"] for m in metrics if "stability/kl_ref_mean" in m]
    assert len(kl) == 2 and 0 < kl[0] < kl[-1]  # the reference is the model before the warm-up trained the adapter
    trained = trained_rows(run_dir)
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
    assert_each_group_ends_once(run_dir, steps=2)


@pytest.mark.slow  # 85 s: a whole job; tests/component/test_reward_model_actor.py runs the actor in the default suite
def test_a_job_with_a_reward_model_logs_each_component(local_ray, tiny_qwen2, tmp_path):
    """A composite reward: the task's verifier, a reward model in its own actor and the format term, each
    component in the step rows, every sample scored without a failure."""
    from cluster.run.driver import train
    from tests.unit.cluster.test_composite_rewards import build_tiny_reward_model

    reward_model = build_tiny_reward_model(tiny_qwen2, tmp_path / "rm")
    job = job_config(
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


def test_tool_episodes_train_with_failing_tools_failing_only_their_episode(local_ray, tmp_path):
    """The warmed-up tiny model calls the calculator in most episodes; a call that raises, prints 10 MB or hangs
    fails that episode alone (not scored nor trained, its reason in the ledger) and the run trains or drops every
    group once within the lag bound. The samples show each episode's transcript, the tools' messages in it."""
    from cluster.run.driver import train

    train(validate_job(tool_job(tmp_path, "tools")))
    run_dir = tmp_path / "runs" / "tools"
    rows = assert_each_group_ends_once(run_dir, steps=4)
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

    job = tool_job(tmp_path, "tools-streaming")
    job["generator"].update(streaming=True, requests_in_flight=2, prompts_per_request=1)
    train(validate_job(job))
    rows = assert_each_group_ends_once(tmp_path / "runs" / "tools-streaming", steps=4)
    trained = [r for r in rows if r["event"] == "trained"]
    assert max(r["lag"] for r in trained) <= 1
    assert all(r["lag"] == r["trained_step"] - r["sampled_versions"][0] for r in trained)
    assert any(r["sampled_versions"][1] > r["sampled_versions"][0] for r in trained), "no episode spanned a load"
