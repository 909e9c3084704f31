"""`stableasync evaluate` on a saved model: the tiny model answers a job's sets on a real vLLM engine in this
process (no Ray), scored by the real verifier workers, and the JSON holds each set's results."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from cluster.cli import main as cli_main


def test_evaluate_answers_every_set_and_writes_each_ones_results(tmp_path, tiny_qwen2, capsys):
    """An arithmetic job with a dataset set of 3 problems (MATH-style {problem, answer} rows, 2 sampled answers
    each) beside its unnamed set of 2: one table row and one JSON entry per set. A set whose file is missing
    exits 2 naming its field, before the engine starts."""
    sums = tmp_path / "sums.jsonl"
    sums.write_text(
        "".join(
            json.dumps({"problem": f"What is {a} + {b}?", "answer": a + b}) + "\n" for a, b in ((1, 2), (3, 4), (2, 2))
        )
    )
    job = tmp_path / "job.yaml"
    job.write_text(
        json.dumps(
            {
                "task": {"name": "arithmetic"},
                "generator": {"max_new_tokens": 8, "max_model_len": 96},
                "eval": {
                    "num_problems": 2,
                    "sets": {
                        "sums": {
                            "path": str(sums),
                            "task": "dataset",
                            "prompt_field": "problem",
                            "samples_per_problem": 2,
                            "temperature": 1.0,
                        }
                    },
                },
            }
        )
    )
    out = tmp_path / "results" / "evaluation.json"
    assert cli_main(["evaluate", tiny_qwen2, "--job", str(job), "--set", "eval.sets.sums.path=gone.jsonl"]) == 2
    assert "eval.sets.sums.path: no data file at gone.jsonl" in capsys.readouterr().err
    assert not out.exists()

    assert cli_main(["evaluate", tiny_qwen2, "--job", str(job), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["model"] == tiny_qwen2 and list(results["sets"]) == ["default", "sums"]
    default, named = results["sets"]["default"], results["sets"]["sums"]
    assert (default["logged_as"], default["task"], default["problems"], default["answers"]) == (
        "eval/*",
        "arithmetic",
        2,
        2,
    )
    assert (default["samples_per_problem"], default["temperature"]) == (1, 0.0)
    assert (named["logged_as"], named["task"], named["problems"], named["answers"]) == ("eval/sums/*", "dataset", 3, 6)
    assert (named["samples_per_problem"], named["temperature"]) == (2, 1.0)
    for result in (default, named):
        assert 0.0 <= result["solved"] <= result["pass_at_k"] <= 1.0 and result["score_errors"] == 0
        assert 0 < result["response_len"] <= 8 and 0.0 <= result["reward_mean"] <= 1.0
    header, *rows = [line for line in printed.splitlines() if line.startswith(("set ", "default ", "sums "))]
    assert header.split() == [
        "set",
        "solved",
        "(avg@k)",
        "pass@k",
        "maj@k",
        "reward",
        "k",
        "problems",
        "answers",
        "score",
        "errors",
    ]
    assert [row.split()[0] for row in rows] == ["default", "sums"] and rows[1].split()[5:] == ["2", "3", "6", "0"]
    assert float(rows[1].split()[4]) == pytest.approx(named["reward_mean"], abs=1e-3)
    answers = [json.loads(line) for line in (out.parent / "evaluation-answers.jsonl").read_text().splitlines()]
    assert [row["set"] for row in answers] == ["default"] * 2 + ["sums"] * 6
    assert sorted(row["answer"] for row in answers[2:]) == ["3", "3", "4", "4", "7", "7"]  # each problem twice
    assert all(row["score_error"] is None and isinstance(row["response"], str) for row in answers)
    assert sum(row["reward"] for row in answers[2:]) / 6 == pytest.approx(named["reward_mean"])
    assert 0.0 <= named["maj_at_k"] <= named["pass_at_k"]  # a majority answer that is right is one right answer
    assert f"results: {out}" in printed
