"""Jobs and checks the whole-job tests share: a small job on the tiny model, runs of it, and what its ledger and
run directory must show."""

from __future__ import annotations

import json
from pathlib import Path

import ray
import yaml

from cluster.cli import main as cli_main
from cluster.job import validate_job
from cluster.telemetry.run_files import is_evaluation_row

WANDB_KEY = "sa-test-key-5f0c1d2e3b4a"

DATASET_REWARD = """
def score(completion, answer, row):
    if row.get("explode"):
        raise ValueError("the user's verifier failed on " + row["prompt"])
    return row["weight"]
"""

NEVER_A_NUMBER_REWARD = """
import math

def score(completion, answer, row):
    return [math.nan, None, "1.0", math.inf, 1e30][len(completion) % 5]
"""

SOMETIMES_UNIFORM_REWARD = """
import random

def score(completion, answer, row):
    return row["reward"] if "reward" in row else float(random.random() < 0.5)
"""

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


def job_config(tmp_path: Path, max_lag: int, steps: int = 4, **overrides) -> dict:
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


def trained_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "trained"]


def run_job_here(tmp_path, **kwargs):
    from cluster.run.driver import train

    return train(validate_job(job_config(tmp_path, **kwargs)))


def run_job_in(tmp_path, **kwargs):
    """`run_job_here` through `run_job`, which resumes a run whose learners crashed."""
    from cluster.run.driver import run_job

    return run_job(validate_job(job_config(tmp_path, **kwargs)))


def assert_rollout_samples_are_rank_zeros_groups(run_dir: Path, trained: list[dict]) -> None:
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


def assert_the_trained_model_is_saved(result, summary: dict) -> None:
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


def assert_no_file_holds(run_dir: Path, secret: str) -> None:
    leaking = [p for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaking == []


def kill_after_step(run_dir: Path, actor_name: str, killed: list[int], step: int = 1) -> None:
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


def assert_each_group_ends_once(run_dir: Path, steps: int, prompts_per_step: int = 2) -> list[dict]:
    from actors.buffer import audit_ledger

    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(rows) == []
    trained_steps = sorted(r["trained_step"] for r in rows if r["event"] == "trained")
    assert trained_steps == sorted(list(range(steps)) * prompts_per_step), "each step trained its groups once"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [m["train/step"] for m in metrics if m["train/step"] > 0 and not is_evaluation_row(m)]
    assert steps_logged == list(range(1, steps + 1))
    return rows


def dataset_task(tmp_path: Path, rows: list[dict], reward_source: str, stem: str = "rows") -> dict:
    """A dataset task section as a user writes one: STEM.jsonl (problem ids STEM-000001, ...) and a reward
    function `score` in STEM_reward.py."""
    data = tmp_path / f"{stem}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / f"{stem}_reward.py").write_text(reward_source)
    return {"name": "dataset", "path": str(data), "reward": f"{tmp_path}/{stem}_reward.py:score"}


def assert_the_last_checkpoint_exports_the_saved_model(run_dir: Path, capsys) -> None:
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


def run_with_rank_1_failing_once(tmp_path, monkeypatch, caplog, run_name: str, failure: str) -> Path:
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
    assert_each_group_ends_once(result.run_dir, steps=3)
    return result.run_dir


def session_processes(session_id: int) -> dict[int, str]:
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


def tool_job(tmp_path: Path, name: str) -> dict:
    """Arithmetic with a calculator that raises, prints 10 MB or hangs when the expression starts with 7, 8 or 9;
    the tiny model learns to call it in the warm-up."""
    tools = tmp_path / "faulty_tools.py"
    tools.write_text(FAULTY_CALCULATOR)
    return job_config(
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
