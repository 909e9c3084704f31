"""Slow smoke tests: the benchmarks that start Ray, vLLM or DeepSpeed, and `stableasync soak`, each run as the
docs show it, in a fresh process, with its smallest arguments (a few steps, one round). The default run keeps
async_speedup's analysis through recorded runs (tests/unit/benchmarks/test_benchmarks.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"\d+\.\d+"


def _command(args: list[str], tmp_path: Path, timeout_s: int = 540) -> str:
    """Run `python -m ARGS` from the repository root with its own model cache; its stdout, after exit 0."""
    env = {**os.environ, "STABLEASYNC_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _demo_with(tmp_path: Path, **sections: dict) -> Path:
    """The demo job with some of its sections' keys changed, written to tmp_path."""
    job = yaml.safe_load((ROOT / "deploy" / "jobs" / "demo.yaml").read_text())
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_async_speedup_trains_each_lag_and_prints_its_tables(tmp_path):
    """The demo job evaluating every 3 steps, so the analysis meets evaluation rows as the full run does."""
    job = _demo_with(tmp_path, eval={"every_steps": 3, "num_problems": 8})
    out = _command(
        [
            "benchmarks.async_speedup",
            "--job",
            str(job),
            "--lags",
            "0,1",
            "--steps",
            "6",
            "--out",
            str(tmp_path / "bench"),
        ],
        tmp_path,
    )
    for lag in (0, 1):
        rows = [
            json.loads(line)
            for line in (tmp_path / "bench" / f"lag{lag}" / "metrics.jsonl").read_text().split("\n")
            if line
        ]
        assert sum("eval/solved" in row for row in rows) == 2, "evaluated at steps 3 and 6"
        assert re.search(
            rf"^{lag:>7}\s+{NUMBER}\s+{NUMBER}\s+\d+%\s+(never|{NUMBER})\s+{NUMBER}\s+[+-]\d+%$", out, re.MULTILINE
        ), out
        assert re.search(rf"^{lag:>7}(\s+{NUMBER}){{5}}\s+\d+%$", out, re.MULTILINE), out  # its own phases
    assert "phases at max_lag 0: generator g" in out and "slowdown x" in out


def test_streaming_benchmark_trains_both_generators_and_prints_their_rows(tmp_path):
    out = _command(
        ["benchmarks.streaming", "--steps", "7", "--requests-in-flight", "2", "--out", str(tmp_path / "bench")],
        tmp_path,
    )
    assert re.search(rf"^\s*request-batch\s+{NUMBER}\s+1\.00\s+(never|{NUMBER})\s+{NUMBER}\s+-$", out, re.MULTILINE), (
        out
    )
    assert re.search(
        rf"^\s*streaming\s+{NUMBER}\s+{NUMBER}\s+(never|{NUMBER})\s+{NUMBER}\s+{NUMBER}$", out, re.MULTILINE
    ), out


# one configuration of each kind by default (plain, VCPO's norms, the decoupled objective: each child process
# costs seconds of DeepSpeed start), tis_seq's step profiled; every configuration with -m slow
@pytest.mark.parametrize(
    "labels", [("tis_seq", "vcpo-auto", "tis_seq-recompute-2x2"), pytest.param(None, marks=pytest.mark.slow)]
)
def test_learner_step_times_its_configurations(tmp_path, labels):
    from benchmarks.learner_step import CONFIGS

    chosen = ["--configs", ",".join(labels), "--profile", "tis_seq"] if labels else []
    out = _command(
        ["benchmarks.learner_step", "--sequences", "16", "--tokens", "32", "--rounds", "1", *chosen], tmp_path
    )
    assert re.search(r"^cpu, float32; ZeRO-2, 1 rank", out, re.MULTILINE), out
    if labels:  # the profile's lines follow tis_seq's row, before the next configuration's
        profile = re.search(
            r"^tis_seq\s.*\n  profile of tis_seq: .* top operators by self CPU time:\n"
            r"((    .*\n){1,10})vcpo-auto\s",
            out,
            re.MULTILINE,
        )
        assert profile and "aten::" in profile.group(1), out
    for label in labels or CONFIGS:
        found = re.search(
            rf"^{re.escape(label)}\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+(\d+)\s+({NUMBER})\s+"
            rf"(-|{NUMBER})\s+(\d+)\s+(\d+)\s+({NUMBER})$",
            out,
            re.MULTILINE,
        )
        assert found, out
        assert float(found.group(1)) > 0 and (label != "tis_seq" or found.group(2) == found.group(3) == "1.00")
        assert (found.group(6) == "-") == (not label.startswith("vcpo")), out  # book-kept share: VCPO only


def test_learner_step_compares_packed_and_padded_micro_batches_on_drawn_lengths(tmp_path):
    out = _command(
        [
            "benchmarks.learner_step",
            "--sequences",
            "8",
            "--lengths",
            "lognormal:48:128",
            "--budget",
            "256",
            "--rounds",
            "1",
            "--configs",
            "tis_seq-padded",
        ],
        tmp_path,
    )
    assert re.search(
        r"^model .*; 8 sequences of 16 prompt tokens and responses of \d+-\d+ tokens "
        r"\(lognormal:48:128, mean \d+\): \d+ real tokens",
        out,
        re.MULTILINE,
    ), out
    rows = {
        label: re.search(rf"^{label}\s+.*\s(\d+)\s+({NUMBER})$", out, re.MULTILINE)
        for label in ("tis_seq", "tis_seq-padded")
    }
    assert all(rows.values()), out
    assert int(rows["tis_seq"].group(1)) <= int(rows["tis_seq-padded"].group(1)), out  # packed: no more micro-batches
    assert re.search(
        rf"^tis_seq: packed tokens/s x padded: {NUMBER} \(fastest steps\), {NUMBER} \(medians\)$", out, re.MULTILINE
    ), out


def test_generation_compares_vllm_with_transformers(tmp_path):
    out = _command(
        ["benchmarks.generation", "--prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--rounds", "1"],
        tmp_path,
    )
    assert re.search(
        rf"^round 1: vllm \d+ tok/s, transformers \d+ tok/s, vllm x transformers {NUMBER}$", out, re.MULTILINE
    ), out
    for engine in ("vllm", "transformers"):
        found = re.search(rf"^{engine}\s+({NUMBER})\s+(\d+)\s+(\d+)\s+({NUMBER})$", out, re.MULTILINE)
        assert found and 0 < int(found.group(2)) <= 2 * 2 * 8, out  # generated tokens: prompts x samples x max
    assert re.search(r"^transformers\s.*\s1\.00$", out, re.MULTILINE), out


def test_weight_sync_prints_the_paths_and_their_ratios(tmp_path):
    out = _command(["benchmarks.weight_sync", "--rounds", "1"], tmp_path)
    for path in ("sync (gather, put, get, vLLM reload)", "raw ray.put + ray.get", "learner step"):
        assert re.search(rf"^{re.escape(path)}\s+{NUMBER}", out, re.MULTILINE), out
    assert re.search(rf"object-store path bandwidth / raw bandwidth: {NUMBER} \(goal >= 0.50\)", out), out


def test_soak_runs_the_job_and_audits_its_ledger(tmp_path):
    """`stableasync soak` on a small job; the kill interval outlasts the run, so this checks the run, the audit
    and what it prints (tests/integration/test_faults.py kills generators)."""
    job = _demo_with(
        tmp_path,
        model={"sft_warmup": {"steps": 2, "prompts_per_step": 8}},
        learner={"prompts_per_step": 2},
        eval={"every_steps": 0},
        logging={"run_dir": str(tmp_path / "runs"), "wandb": {"mode": "disabled"}},
    )
    out = _command(["cluster.cli", "soak", str(job), "--steps", "4", "--kill-every-s", "3600"], tmp_path)
    assert re.search(
        r"^soak: 4 steps in \d+\.\d min, 0 generator kills, 0 restarts seen, 0 groups reissued; "
        r"ledger \{'trained': 8(, 'dropped': \d+)?\}; audit: complete$",
        out,
        re.MULTILINE,
    ), out


def test_learner_memory_measures_each_batch_size_in_its_own_process(tmp_path, tiny_qwen2):
    out = _command(
        [
            "benchmarks.learner_memory",
            "--model",
            tiny_qwen2,
            "--sequences",
            "8,16",
            "--tokens",
            "24",
            "--budget",
            "64",
            "--stabilizers",
            "tis_seq,m2po",
        ],
        tmp_path,
    )
    assert re.search(r"^cpu, float32; ZeRO-2, 1 rank, 2 torch thread\(s\); memory: resident set$", out, re.MULTILINE), (
        out
    )
    for stabilizer, passes in (("tis_seq", 1), ("m2po", 2)):
        # a single micro-batch is the whole batch, which any stabilizer decides on in its one pass
        assert re.search(rf"^{stabilizer}\s+8\s+single\s+1\s+\d+\s+{NUMBER}\s+1\.00$", out, re.MULTILINE), out
        for count, micro_batches in ((8, 4), (16, 8)):  # 64 tokens hold 2 sequences of 24
            assert re.search(
                rf"^{stabilizer}\s+{count}\s+{micro_batches}\s+{passes}\s+\d+\s+{NUMBER}\s+{NUMBER}\s+"
                rf"{NUMBER}$",
                out,
                re.MULTILINE,
            ), out
