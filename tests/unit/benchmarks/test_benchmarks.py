"""Smoke tests of the benchmarks that fit the default run: each command with its smallest arguments, its
analysis and printing included. async_speedup's analysis runs on recorded runs (tests/fixtures/bench-async,
evaluation rows included); its real runs, and the benchmarks that start vLLM, DeepSpeed or Ray, are in
tests/integration/test_benchmark_runs.py (slow)."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.fixtures import BENCH_ASYNC as RECORDED
from tests.fixtures import learner_rows, metric_rows

ROOT = Path(__file__).resolve().parents[3]
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
    monkeypatch.setattr(
        async_speedup,
        "slowdown_with_both_cores_busy",
        lambda: {"compute (matmul 256^2)": (0.94, 0.95), "memory (16 MB pass)": (0.18, 0.30)},
    )
    monkeypatch.chdir(ROOT)
    async_speedup.main(["--lags", ",".join(map(str, lags)), "--steps", str(RECORDED_STEPS), "--out", str(tmp_path)])
    out = capsys.readouterr().out

    steps = {lag: learner_rows(RECORDED / f"lag{lag}") for lag in lags}
    skip = async_speedup.SKIP_STEPS
    wall = {
        lag: (rows[-1]["time/wall_s"] - rows[skip - 1]["time/wall_s"]) / (len(rows) - skip)
        for lag, rows in steps.items()
    }
    steady = steps[0][skip:]
    g = statistics.fmean(row["time/generator_busy_s"] for row in steady)
    t = statistics.fmean(row["time/learner_step_s"] + row["perf/weight_sync_s"] for row in steady)
    assert f"generator g (calls + weight loads) = {g:.3f} s/step, learner + sync t = {t:.3f} s/step" in out
    for lag in lags:
        speedup = wall[0] / wall[lag]
        assert re.search(
            rf"^{lag:>7}{wall[lag]:>13.3f}{speedup:>9.2f}{speedup / ((g + t) / max(g, t)):>10.0%}"
            r"\s+(never|\d+\.\d)\s+\d+\.\d{3}\s+[+-]\d+%$",
            out,
            re.MULTILINE,
        ), out
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
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.core_contention", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def test_every_learner_step_configuration_builds_its_stabilizer_and_learner_spec():
    """A misspelt stabilizer option or LearnerSpec field fails here, not minutes into a benchmark's run."""
    from algorithms import registry
    from benchmarks.learner_step import CONFIGS
    from learner.rank import LearnerSpec

    for name, config, options in CONFIGS.values():
        registry.build(name, **config)
        LearnerSpec(model_path="unused", **options)
    assert CONFIGS["m2po"][0] == "m2po" and CONFIGS["tis_seq-gc"][2] == {"gradient_checkpointing": True}


@pytest.mark.parametrize("vocab", [300, 49152])  # SmolLM2's
def test_the_synthetic_batch_is_near_a_random_models_own_logprobs(vocab):
    """The learner benchmark's behaviour log-probs lie near a random-weight model's own, so its steps train on
    importance weights that are neither all 0 nor all capped (with weights of 0 the gradient is 0)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks.learner_step import synthetic_batch
    from learner.batch import token_logprobs

    torch.manual_seed(0)
    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=vocab, num_key_value_heads=1, **shape))
    batch = synthetic_batch(8, 48, model.config.vocab_size)
    with torch.no_grad():
        own = token_logprobs(model(input_ids=batch.input_ids).logits, batch.input_ids, 1.0)
    mask = batch.loss_mask.bool()
    per_token_log_ratio = (own - batch.behaviour_logprobs)[mask]
    assert per_token_log_ratio.mean().abs() < 0.5, float(per_token_log_ratio.mean())


def test_the_benchmarks_take_the_gpu_options():
    from benchmarks import learner_memory, learner_step, step_measures

    args = learner_step.build_parser().parse_args(
        [
            "--model-config",
            "qwen2.5-1.5b",
            "--dtype",
            "bfloat16",
            "--configs",
            "m2po,tis_seq-gc",
            "--profile",
            "tis_seq,m2po",
        ]
    )
    assert (args.model_config, args.dtype, args.profile) == ("qwen2.5-1.5b", "bfloat16", "tis_seq,m2po")
    assert learner_step.build_parser().parse_args(["--profile"]).profile == "all"  # every measured configuration
    assert learner_step.build_parser().parse_args([]).profile is None
    args = learner_memory.build_parser().parse_args(["--model-config", "smollm2-135m", "--dtype", "float32"])
    assert (args.model_config, args.dtype) == ("smollm2-135m", "float32")
    assert step_measures.default_dtype() == "float32" and step_measures.device_name() == "cpu"  # this machine


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "tis_seq", "--profile", "vcpo-fast"], "--profile: unknown ['vcpo-fast']"),
        (["--configs", "tis_seq", "--model-config", "qwen3-8b"], "choose from smollm2-135m, qwen2.5-1.5b, qwen2.5-7b"),
    ],
)
def test_learner_step_refuses_an_unknown_profile_or_model_config_before_building_anything(capsys, argv, message):
    from benchmarks import learner_step

    with pytest.raises(SystemExit) as exit_info:
        learner_step.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_gpu_busy_time_is_the_union_of_kernel_spans_and_the_top_kernels_are_by_total_time():
    from benchmarks.step_measures import covered_us, top_by_time

    assert covered_us([(20.0, 30.0), (0.0, 10.0), (5.0, 15.0), (6.0, 7.0)]) == 25.0  # overlaps count once
    assert covered_us([]) == 0.0
    assert top_by_time([("a", 1.0), ("b", 3.0), ("a", 2.5), ("c", 0.5)], 2) == [("a", 3.5, 2), ("b", 3.0, 1)]


def test_a_profiled_step_on_the_cpu_names_its_operators_and_prints_them_compactly(capsys):
    from benchmarks.step_measures import PROFILE_TOP_KERNELS, print_profile, profile_step

    matrix = torch.randn(256, 256)
    profile = profile_step(lambda: (matrix @ matrix).sum())
    assert profile["busy_s"] is None and profile["wall_s"] > 0  # no GPU: no kernel time
    assert "aten::mm" in [name for name, _, _ in profile["top"]] and len(profile["top"]) <= PROFILE_TOP_KERNELS
    print_profile("tis_seq", profile)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  profile of tis_seq: ") and len(lines) == 1 + len(profile["top"])
    assert all(re.fullmatch(r"\s+\d+\.\d ms\s+\d+\.\d%\s+\d+x  \S.*", line) for line in lines[1:]), lines


def test_the_peak_memory_of_a_cpu_step_counts_what_it_allocates():
    from benchmarks.step_measures import peak_growth, timed_seconds

    kept = []
    peak = peak_growth(lambda: kept.append(torch.randn(4096, 4096)))  # 64 MiB, still held when the step ends
    assert peak >= 48 * 2**20
    assert timed_seconds(lambda: None) >= 0


def _bench_commands() -> list[list[str]]:
    """deploy/gpu-bench.sh's `python3 ...` commands as argument lists (continuation lines joined)."""
    text = (ROOT / "deploy" / "gpu-bench.sh").read_text().replace("\\\n", "")
    commands = []
    for line in text.splitlines():
        tokens = shlex.split(line, comments=True)
        if "python3" in tokens:
            commands.append(tokens[tokens.index("python3") + 1 :])
    return commands


def test_the_gpu_scripts_are_valid_bash_and_run_only_what_the_repository_has():
    """Checked here because the GPU machine that runs them is lent rarely: each benchmark command parses with
    the benchmark's own parser and names known configurations and models, and the tests it runs exist."""
    from benchmarks import learner_step
    from benchmarks.model_configs import ARCHITECTURES

    for script in ("gpu-bench.sh", "gpu-wheels.sh"):
        checked = subprocess.run(["bash", "-n", str(ROOT / "deploy" / script)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
    modules = []
    for args in _bench_commands():
        if args[:2] == ["-m", "pytest"]:
            paths = [path for path in args if path.startswith("tests/")]
            assert paths and all((ROOT / path).is_dir() for path in paths), args
        elif args == ["-m", "benchmarks.stack_versions"]:  # takes no options
            modules.append(args[1])
        elif args[:1] == ["-m"] and args[1].startswith("benchmarks."):
            modules.append(args[1])
            parsed = importlib.import_module(args[1]).build_parser().parse_args(args[2:])
            assert parsed.model_config in ARCHITECTURES
            for option in ("configs", "profile"):
                labels = getattr(parsed, option, None) or ""
                assert set(labels.split(",")) <= set(learner_step.CONFIGS) | {""}, (option, labels)
    assert modules == ["benchmarks.stack_versions"] + ["benchmarks.learner_step"] * 3 + ["benchmarks.learner_memory"]
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()  # the wheels never reach a commit


def test_the_gpu_wheels_are_the_versions_this_venv_tests():
    """deploy/gpu-wheels.sh's pins against what is installed here: the GPU run imports what CI ran."""
    text = (ROOT / "deploy" / "gpu-wheels.sh").read_text()
    pins = dict(re.findall(r"\b([A-Za-z][\w.-]*)==(\d[\w.]*)", text))
    assert {"deepspeed", "pydantic", "pydantic-core", "hjson", "PyYAML"} <= set(pins)
    for name, pinned in pins.items():
        assert importlib.metadata.version(name) == pinned, name


def test_the_gpu_run_names_each_version_beside_the_gpu_extras_pin(capsys):
    """A GPU table names the torch that ran it: `stack_versions` prints each package with its pin and marks the
    ones that differ (the lent machine's torch 2.11 against the pinned 2.13)."""
    import torch

    from benchmarks import stack_versions

    pins = stack_versions.gpu_pins()
    assert {name: pins[name] for name in stack_versions.PACKAGES} == {
        name: importlib.metadata.version(name).split("+")[0] for name in stack_versions.PACKAGES
    }  # the gpu extra pins what this venv (the cpu extra) tests
    lines = stack_versions.version_lines({"torch": "2.11.0+cu130", "peft": "0.21.2", "einops": "0.8"}, pins)
    assert lines == [
        f"torch 2.11.0+cu130 (gpu extra pins {pins['torch']}; DIFFERS)",
        "peft 0.21.2 (gpu extra pins 0.21.2)",
        "einops 0.8 (gpu extra pins nothing)",
    ]
    assert stack_versions.main() == 0
    assert f"torch {torch.__version__} (gpu extra pins {pins['torch']})" in capsys.readouterr().out


def test_a_counted_step_gives_its_flops_and_the_backwards_through_the_model():
    """A [4 x 8] embedding into an [8 -> 16] linear layer on 5 tokens: the linear forward is 2 x 5 x 8 x 16 FLOPs,
    its backward twice that; a step with a second backward (as VCPO's ghost norms take) counts two."""
    import torch

    from benchmarks.step_measures import counted_step

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(4, 8), torch.nn.Linear(8, 16, bias=False)

        def get_input_embeddings(self) -> torch.nn.Module:
            return self.embed

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids)).sum()

    model, ids = Tiny(), torch.tensor([0, 1, 2, 3, 0])
    forward = 2 * 5 * 8 * 16
    assert counted_step(model, lambda: model(ids).backward()) == (3 * forward, 1)
    assert counted_step(model, lambda: [model(ids).backward() for _ in range(2)]) == (6 * forward, 2)
    with torch.no_grad():
        assert counted_step(model, lambda: model(ids)) == (forward, 0)


def test_output_layer_compares_the_fused_and_whole_paths(capsys):
    """The documented command at a small size: both paths measured, the whole path the reference."""
    from benchmarks import output_layer

    output_layer.main(["--model-config", "smollm2-135m", "--tokens", "64", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("smollm2-135m output layer (49152 x 576), 64 positions")
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert set(rows) == {"whole", "fused"} and rows["whole"][1] == "1.00"
    assert float(rows["fused"][0]) > 0 and float(rows["fused"][2]) >= 0
