"""Smoke tests of the benchmarks that fit the default run: each command with its smallest arguments, its
analysis and printing included. async_speedup's analysis runs on recorded runs (tests/fixtures/bench-async,
evaluation rows included); its real runs, and the benchmarks that start vLLM, DeepSpeed or Ray, are in
tests/integration/test_benchmarks.py (slow)."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.fixtures import BENCH_ASYNC as RECORDED
from tests.fixtures import learner_rows, metric_rows

ROOT = Path(__file__).resolve().parents[2]
RECORDED_STEPS = 12


def test_async_speedup_analyses_recorded_runs_whose_evaluations_have_their_own_rows(monkeypatch, capsys, tmp_path):
    """The documented command's parsing and analysis, with the runs replaced by recorded ones: evaluation rows
    carry a train/step but no learner timings, and are no steps (issue 35: a KeyError after the runs)."""
    from benchmarks import async_speedup

    lags = (0, 1)
    for lag in lags:  # the fixtures hold what made the benchmark crash
        rows = metric_rows(RECORDED / f"lag{lag}")
        evaluations = [row for row in rows if row["train/step"] > 0 and any(key.startswith("eval/") for key in row)]
        assert len(evaluations) == 3 and len(learner_rows(RECORDED / f"lag{lag}")) == RECORDED_STEPS

    def recorded_run(job):
        assert (job.learner.steps, job.generator.num_generators, job.learner.num_ranks) == (RECORDED_STEPS, 1, 1)
        return SimpleNamespace(run_dir=RECORDED / f"lag{job.async_.max_lag}")

    monkeypatch.setattr("cluster.run.driver.train", recorded_run)
    monkeypatch.setattr(async_speedup, "slowdown_with_both_cores_busy",
                        lambda: {"compute (matmul 256^2)": (0.94, 0.95), "memory (16 MB pass)": (0.18, 0.30)})
    monkeypatch.chdir(ROOT)
    async_speedup.main(["--lags", ",".join(map(str, lags)), "--steps", str(RECORDED_STEPS), "--out", str(tmp_path)])
    out = capsys.readouterr().out

    steps = {lag: learner_rows(RECORDED / f"lag{lag}") for lag in lags}
    skip = async_speedup.SKIP_STEPS
    wall = {lag: (rows[-1]["time/wall_s"] - rows[skip - 1]["time/wall_s"]) / (len(rows) - skip)
            for lag, rows in steps.items()}
    steady = steps[0][skip:]
    g = statistics.fmean(row["time/generator_busy_s"] for row in steady)
    t = statistics.fmean(row["time/learner_step_s"] + row["perf/weight_sync_s"] for row in steady)
    assert f"generator g (calls + weight loads) = {g:.3f} s/step, learner + sync t = {t:.3f} s/step" in out
    for lag in lags:
        speedup = wall[0] / wall[lag]
        assert re.search(rf"^{lag:>7}{wall[lag]:>13.3f}{speedup:>9.2f}{speedup / ((g + t) / max(g, t)):>10.0%}"
                         r"\s+(never|\d+\.\d)\s+\d+\.\d{3}\s+[+-]\d+%$", out, re.MULTILINE), out
    assert "slowdown x1.67" in out  # the contention measurement, printed after the tables


def test_async_speedup_refuses_fewer_steps_than_its_warm_up(capsys):
    from benchmarks import async_speedup

    with pytest.raises(SystemExit) as exit_info:
        async_speedup.main(["--steps", str(async_speedup.SKIP_STEPS)])
    assert exit_info.value.code == 2 and "--steps must be above 5" in capsys.readouterr().err


def test_stabilizers_benchmark_prints_a_row_per_stabilizer(capsys):
    import torch

    from algorithms import registry
    from benchmarks import stabilizers

    threads = torch.get_num_threads()  # the benchmark sets them; leave this process as it was
    stabilizers.main(["--batch", "4", "--tokens", "32", "--rounds", "1", "--threads", str(threads)])
    assert torch.get_num_threads() == threads
    rows = {" ".join(line.split()[:-6]): line.split()[-6:] for line in capsys.readouterr().out.splitlines()[3:]}
    assert set(registry.STABILIZERS) <= set(rows)
    assert {"m2po(adaptive_clip)", "bapo(positive_share=0.455)"} <= set(rows)
    assert rows["none"][1] == rows["none"][4] == "1.00"  # none against itself, per step and loss only
    assert all(float(cells[0]) > 0 and float(cells[3]) > 0 for cells in rows.values())  # ms per call


def test_core_contention_prints_each_loop_alone_and_with_both_cores_busy():
    """In a fresh process, as documented: it forks, which a test process with torch's threads must not do."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.core_contention", "--repeats", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    if lines == ["core contention: not measured (fewer than two usable cores)"]:
        pytest.skip("this process may use only one core")
    assert len(lines) == 2 and lines[0].startswith("compute") and lines[1].startswith("memory")
    for line in lines:
        found = re.search(r"alone\s+(\S+) s\s+both cores busy\s+(\S+) s\s+slowdown x(\S+)$", line)
        assert found, line
        alone, both, slowdown = map(float, found.groups())
        assert alone > 0 and both > 0 and slowdown == pytest.approx(both / alone, rel=0.05)  # of rounded seconds
