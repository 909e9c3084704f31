"""Reward workers: a verifier that raises, hangs, returns NaN or eats memory fails only its sample."""

import time

from tasks.base import Problem, build_task
from tasks.config import ArithmeticConfig
from tasks.scoring import ScorePool, score_inline

PROBLEM = Problem("p", "What is 1 + 1?", "2")


def test_pool_survives_every_kind_of_verifier_failure():
    completions = ["<answer>2</answer>", "RAISE", "<answer>3</answer>", "NAN", "HANG", "HOG", "<answer>2</answer>"]
    start = time.monotonic()
    with ScorePool("faulty-arithmetic", ArithmeticConfig(), timeout_s=1.0, memory_limit_mb=1024,
                   extra_modules=("tasks.testing",)) as pool:
        results = pool.score_many([PROBLEM] * len(completions), completions)
        again = pool.score_many([PROBLEM], ["<answer>2</answer>"])  # the rebuilt worker still scores
    assert [r.reward for r in results] == [1.0, 0.0, 0.1, 0.0, 0.0, 0.0, 1.0]
    errors = [r.error for r in results]
    assert errors[0] is None and errors[2] is None and errors[6] is None
    assert "raised RuntimeError: verifier bug" in errors[1]
    assert "non-finite reward nan" in errors[3]
    assert "timeout after 1 s" in errors[4]
    assert "memory" in errors[5]
    assert again[0].reward == 1.0 and pool.failures == 4
    assert time.monotonic() - start < 30


def test_the_timeout_holds_per_completion_and_a_dead_worker_fails_only_its_item():
    # One batch holds all eight: four slow answers take longer together than the timeout, yet each is
    # within it; the worker that dies fails its own item, and the items queued behind it still score.
    completions = ["SLOW <answer>2</answer>"] * 4 + ["DIE", "<answer>2</answer>", "HANG", "<answer>2</answer>"]
    with ScorePool("faulty-arithmetic", ArithmeticConfig(), timeout_s=1.0,
                   extra_modules=("tasks.testing",)) as pool:
        results = pool.score_many([PROBLEM] * len(completions), completions)
    assert [r.reward for r in results] == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert "worker died" in results[4].error and "timeout after 1 s" in results[6].error
    assert [r.error is None for r in results] == [True] * 4 + [False, True, False, True]
    assert pool.failures == 2


def test_parallel_workers_keep_the_order():
    completions = [f"<answer>{i}</answer>" for i in range(6)]
    with ScorePool("arithmetic", ArithmeticConfig(), max_workers=2) as pool:
        results = pool.score_many([PROBLEM] * 6, completions)
    assert [r.reward for r in results] == [0.1, 0.1, 1.0, 0.1, 0.1, 0.1]


def test_inline_scoring_catches_failures_too():
    import tasks.testing  # noqa: F401 - registers the faulty task

    task = build_task("faulty-arithmetic", ArithmeticConfig())
    results = score_inline(task, [PROBLEM] * 3, ["<answer>2</answer>", "RAISE", "NAN"])
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]
    assert results[1].error.startswith("raised RuntimeError")
