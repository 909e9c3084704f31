"""Reward workers: a verifier that raises, hangs, returns NaN or eats memory fails only its sample."""

import time

import pytest

from tasks.base import Problem, build_task
from tasks.config import ArithmeticConfig
from tasks.scoring import RewardWorkerError, ScorePool, score_inline

PROBLEM = Problem("p", "What is 1 + 1?", "2")


def test_pool_survives_every_kind_of_verifier_failure():
    completions = ["<answer>2</answer>", "RAISE", "<answer>3</answer>", "NAN", "HANG", "HOG", "<answer>2</answer>"]
    start = time.monotonic()
    with ScorePool(
        "faulty-arithmetic", ArithmeticConfig(), timeout_s=1.0, memory_limit_mb=1024, extra_modules=("tasks.testing",)
    ) as pool:
        results = pool.score_many([PROBLEM] * len(completions), completions)
        again = pool.score_many([PROBLEM], ["<answer>2</answer>"])  # the rebuilt worker still scores
    assert [r.reward for r in results] == [1.0, 0.0, 0.1, 0.0, 0.0, 0.0, 1.0]
    errors = [r.error for r in results]
    assert errors[0] is None and errors[2] is None and errors[6] is None
    assert "raised RuntimeError: verifier bug" in errors[1]
    assert "returned nan, not a finite number" in errors[3]
    assert "timeout after 1 s" in errors[4]
    assert "memory" in errors[5]
    assert again[0].reward == 1.0 and pool.failures == 4
    assert time.monotonic() - start < 30


def test_the_timeout_holds_per_completion_and_a_dead_worker_fails_only_its_item():
    # One batch holds all eight: four slow answers take longer together than the timeout, yet each is
    # within it; the worker that dies fails its own item, and the items queued behind it still score.
    completions = ["SLOW <answer>2</answer>"] * 4 + ["DIE", "<answer>2</answer>", "HANG", "<answer>2</answer>"]
    with ScorePool("faulty-arithmetic", ArithmeticConfig(), timeout_s=1.0, extra_modules=("tasks.testing",)) as pool:
        results = pool.score_many([PROBLEM] * len(completions), completions)
    assert [r.reward for r in results] == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert "worker died" in results[4].error and "timeout after 1 s" in results[6].error
    assert [r.error is None for r in results] == [True] * 4 + [False, True, False, True]
    assert pool.failures == 2


def test_a_worker_that_is_slow_to_start_fails_no_completion():
    # Building the task takes 1.5 s, the per-completion timeout is 0.5 s: the clock starts once the
    # worker is up, so neither the first worker nor the one replacing the dead one fails anything.
    completions = ["<answer>2</answer>", "DIE", "<answer>2</answer>", "<answer>3</answer>"]
    with ScorePool(
        "slow-start-arithmetic", ArithmeticConfig(), timeout_s=0.5, extra_modules=("tasks.testing",)
    ) as pool:
        results = pool.score_many([PROBLEM] * len(completions), completions)
    assert [r.error for r in results] == [None, "worker died (killed or out of memory)", None, None]
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.1]


def test_a_worker_that_cannot_start_raises_with_the_task_and_the_reason():
    with ScorePool("broken-start-arithmetic", ArithmeticConfig(), extra_modules=("tasks.testing",)) as pool:
        reason = "'broken-start-arithmetic' failed to start: ImportError: no module"
        with pytest.raises(RewardWorkerError, match=reason):
            pool.score_many([PROBLEM], ["<answer>2</answer>"])


def test_a_worker_that_does_not_start_in_time_raises():
    with (
        ScorePool(
            "slow-start-arithmetic", ArithmeticConfig(), startup_timeout_s=0.3, extra_modules=("tasks.testing",)
        ) as pool,
        pytest.raises(RewardWorkerError, match=r"did not start within 0.3 s"),
    ):
        pool.score_many([PROBLEM], ["<answer>2</answer>"])


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


def _address_space_limit(pid: int) -> str:
    """The soft 'Max address space' limit of a process, as /proc shows it (bytes, or 'unlimited')."""
    with open(f"/proc/{pid}/limits") as limits:
        return next(line.split()[3] for line in limits if line.startswith("Max address space"))


def _address_space_peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmPeak:"))


def test_the_job_scoring_section_sets_the_reward_workers():
    from cluster.job import validate_job
    from cluster.run.loop import reward_workers

    job = validate_job(
        {"task": {"name": "arithmetic"}, "scoring": {"workers": 2, "timeout_s": 2.5, "memory_limit_mb": 768}}
    )
    with reward_workers(job) as pool:
        results = pool.score_many([PROBLEM] * 3, ["<answer>2</answer>", "<answer>3</answer>", "no answer"])
        pids = [worker.worker_pid for worker in pool._workers]  # its Python process, under unshare with namespaces
        # the limit is the worker's start-up footprint plus 768 MB
        footprints = [int(_address_space_limit(pid)) - (768 << 20) for pid in pids]
        peaks = [_address_space_peak(pid) for pid in pids]
    assert [r.reward for r in results] == [1.0, 0.1, 0.0]
    assert pool.timeout_s == 2.5 and len(pids) == 2
    assert all(0 < footprint <= peak for footprint, peak in zip(footprints, peaks)), (footprints, peaks)

    unlimited = validate_job({"task": {"name": "arithmetic"}, "scoring": {"memory_limit_mb": None}})
    with reward_workers(unlimited) as pool:
        pool.score_many([PROBLEM], ["<answer>2</answer>"])
        assert _address_space_limit(pool._workers[0].worker_pid) == "unlimited"


def test_a_ctrl_c_at_the_terminal_leaves_the_workers_scoring():
    """Ctrl-C reaches every process in the terminal's group, verifier workers included; they ignore
    it, so a run that stops cleanly still scores the groups in flight, and none fails for it."""
    import os
    import signal

    with ScorePool("arithmetic", ArithmeticConfig(), max_workers=2) as pool:
        assert [r.reward for r in pool.score_many([PROBLEM] * 2, ["<answer>2</answer>"] * 2)] == [1.0, 1.0]
        for worker in pool._workers:
            os.kill(worker.process.pid, signal.SIGINT)
        time.sleep(0.5)
        results = pool.score_many([PROBLEM] * 4, ["<answer>2</answer>"] * 4)
        assert [r.reward for r in results] == [1.0] * 4 and pool.failures == 0
