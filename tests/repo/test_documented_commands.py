"""Every command README.md, CONTRIBUTING.md and docs/ show: each command line still parses, and each command,
like every benchmark module, has a smoke test that runs it. A command a user copies from the docs cannot rot
unnoticed, and a newly documented one fails here until a test runs it."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULE = re.compile(r"(benchmarks|cluster)(\.[a-z_]+)+")

# Each documented command (and benchmark module) -> the tests that run it ("path::function"). Tests marked
# slow run with `-m slow`; each command keeps at least its parsing, analysis or error path in the default run.
SMOKE_TESTS: dict[str, tuple[str, ...]] = {
    "stableasync train": (
        "tests/unit/cluster/test_job.py::test_validate_and_train_refuse_a_hub_id_that_is_not_cached_when_the_hub_cannot_be_reached",
        "tests/integration/test_faults.py::test_ctrl_c_stops_at_a_step_with_a_checkpoint_and_the_run_resumes",
        "tests/integration/test_resume.py::test_resume_from_a_checkpoint_continues_without_gap_or_duplicate",
    ),
    "stableasync validate": (
        "tests/unit/cluster/test_job.py::test_every_deploy_job_validates",
        "tests/unit/cluster/test_job.py::test_validate_dry_run_prints_the_resolved_job",
    ),
    "stableasync prepare-model": (
        "tests/component/test_models.py::test_prepare_model_names_the_models_it_knows",
        "tests/component/test_models.py::test_prepare_smollm2_from_the_wheel",
    ),
    "stableasync evaluate": (
        "tests/unit/cluster/test_evaluation.py::test_evaluate_refuses_bad_input_with_exit_2_before_loading_a_model",
        "tests/integration/test_evaluate.py::test_evaluate_answers_every_set_and_writes_each_ones_results",
    ),
    "stableasync export": (
        "tests/integration/test_faults.py::test_a_checkpoint_or_model_the_learner_cannot_write_is_an_alert_and_loses_nothing",
        "tests/unit/cluster/test_checkpoints.py::test_export_of_a_run_without_checkpoints_gives_its_finished_model_or_says_what_to_set",
        "tests/unit/cluster/test_checkpoints.py::test_export_to_the_hub_where_it_cannot_be_reached_fails_at_once_and_keeps_the_folder",
    ),
    "stableasync wandb-workspace": (
        "tests/unit/cluster/test_wandb_workspace.py::test_the_command_writes_the_view_offline_and_a_bad_file_exits_2",
        "tests/unit/cluster/test_wandb_workspace.py::test_online_saves_the_workspace_and_prints_its_url",
        "tests/unit/cluster/test_wandb_workspace.py::test_offline_from_any_directory_needs_no_entity_project_or_spec_and_says_how_to_save",
    ),
    "stableasync submit": (
        "tests/integration/test_submit_to_ray.py::test_a_submission_without_the_token_or_with_a_wrong_one_is_refused",
        "tests/integration/test_submit_to_ray.py::test_two_jobs_at_once_each_with_its_own_stabilizer_run_dir_and_wandb_run",
    ),
    "stableasync status": (
        "tests/integration/test_submit_to_ray.py::test_a_submission_without_the_token_or_with_a_wrong_one_is_refused",
        "tests/integration/test_submit_to_ray.py::test_two_jobs_at_once_each_with_its_own_stabilizer_run_dir_and_wandb_run",
    ),
    "stableasync logs": (
        "tests/integration/test_submit_to_ray.py::test_two_jobs_at_once_each_with_its_own_stabilizer_run_dir_and_wandb_run",
    ),
    "stableasync stop": (
        "tests/integration/test_submit_to_ray.py::test_stop_ends_a_submitted_job_at_a_step_with_a_checkpoint",
    ),
    "stableasync sweep": (
        "tests/unit/cluster/test_sweep.py::test_sweep_set_options_change_every_cell_through_the_job_schema",
        "tests/unit/cluster/test_sweep.py::test_a_sweep_with_seeds_prints_a_row_per_cell_over_its_seeds",
    ),
    "stableasync report": (
        "tests/unit/cluster/test_report.py::test_the_documented_report_command_on_recorded_runs_counts_their_steps_not_their_evaluations",
        "tests/unit/cluster/test_report_records.py::test_records_report_what_their_runs_report",
    ),
    "stableasync simulate": (
        "tests/unit/cluster/test_simulate.py::test_cli_prints_a_prediction_and_the_paper_comparison",
        "tests/unit/cluster/test_simulate.py::test_the_documented_calibrate_commands_on_a_recorded_run_with_evaluation_rows",
    ),
    "stableasync soak": ("tests/integration/test_benchmark_runs.py::test_soak_runs_the_job_and_audits_its_ledger",),
    "cluster.remote.job_entrypoint": ("tests/unit/cluster/test_job_entrypoint.py::test_no_command_is_a_usage_error",),
    "benchmarks.model_configs": (
        "tests/unit/benchmarks/test_model_configs.py::test_a_built_folder_loads_as_the_learner_loads_it_and_is_built_once",
    ),
    "benchmarks.output_layer": (
        "tests/unit/benchmarks/test_benchmarks.py::test_output_layer_compares_the_fused_and_whole_paths",
    ),
    "benchmarks.async_speedup": (
        "tests/unit/benchmarks/test_benchmarks.py::test_async_speedup_analyses_recorded_runs_whose_evaluations_have_their_own_rows",
        "tests/integration/test_benchmark_runs.py::test_async_speedup_trains_each_lag_and_prints_its_tables",
    ),
    "benchmarks.core_contention": (
        "tests/unit/benchmarks/test_benchmarks.py::test_core_contention_prints_each_loop_alone_and_with_both_cores_busy",
    ),
    "benchmarks.stabilizers": (
        "tests/unit/benchmarks/test_benchmarks.py::test_stabilizers_benchmark_prints_a_row_per_stabilizer",
    ),
    "benchmarks.learner_memory": (
        "tests/integration/test_benchmark_runs.py::test_learner_memory_measures_each_batch_size_in_its_own_process",
    ),
    "benchmarks.learner_step": (
        "tests/integration/test_benchmark_runs.py::test_learner_step_times_its_configurations",
    ),
    "benchmarks.step_measures": (
        "tests/unit/benchmarks/test_benchmarks.py::test_a_counted_step_gives_its_flops_and_the_backwards_through_the_model",
    ),
    "benchmarks.stack_versions": (
        "tests/unit/benchmarks/test_benchmarks.py::test_the_gpu_run_names_each_version_beside_the_gpu_extras_pin",
    ),
    "benchmarks.generation": (
        "tests/integration/test_benchmark_runs.py::test_generation_compares_vllm_with_transformers",
    ),
    "benchmarks.streaming": (
        "tests/integration/test_benchmark_runs.py::test_streaming_benchmark_trains_both_generators_and_prints_their_rows",
    ),
    "benchmarks.weight_sync": (
        "tests/integration/test_benchmark_runs.py::test_weight_sync_prints_the_paths_and_their_ratios",
    ),
    "cluster.reference_loop": (
        "tests/integration/test_reference_loop.py::test_the_reference_loop_learns_the_demo_task",
    ),
}


def commands_in(text: str) -> list[tuple[str, list[str]]]:
    """(command, its arguments) for each of the project's commands in one shell line: `stableasync X` (also as
    `python -m cluster.cli X`; `a|b` names several) and `python -m benchmarks.X` / `cluster.X`. Comments end
    the line; `[--flag VALUE]` counts as given."""
    found = []
    for segment in text.split("&&"):
        try:
            tokens = shlex.split(segment, comments=True)
        except ValueError:  # an unbalanced quote in prose
            tokens = segment.split()
        tokens = [token.strip("[]") for token in tokens]
        tokens = [token for token in tokens if token]
        for i, token in enumerate(tokens):
            after_m = i > 0 and tokens[i - 1] == "-m"
            if (token.split("/")[-1] == "stableasync" or (after_m and token == "cluster.cli")) and i + 1 < len(tokens):
                for name in tokens[i + 1].split("|"):
                    found.append((f"stableasync {name}", [name, *tokens[i + 2 :]]))
                break
            if after_m and MODULE.fullmatch(token):
                found.append((token, tokens[i + 1 :]))
                if token != "cluster.remote.job_entrypoint":  # the entrypoint's arguments are the command it runs
                    break
    return found


def documented_lines() -> list[tuple[str, str, list[str]]]:
    """(where, command, arguments) of every command line in a fenced block of the docs (continuations joined)."""
    out = []
    for path in DOCS:
        fenced, pending, start = False, "", 0
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                continue
            pending, start = (pending + " " + line, start) if pending else (line, number)
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            out += [(f"{path.relative_to(ROOT)}:{start}", command, args) for command, args in commands_in(pending)]
            pending = ""
    return out


def documented_names() -> set[str]:
    """Every command the docs name, in fenced blocks or inline code (`stableasync train --resume RUN_DIR`)."""
    names = {command for _, command, _ in documented_lines()}
    for path in DOCS:
        for span in re.findall(r"`([^`\n]+)`", path.read_text()):
            names |= {command for command, _ in commands_in(span)}
    return names


def benchmark_modules() -> set[str]:
    return {f"benchmarks.{path.stem}" for path in (ROOT / "benchmarks").glob("*.py") if path.stem != "__init__"}


def test_the_docs_are_read_as_expected():
    """The extraction itself: a sample of what the docs show, so an extractor that finds nothing cannot pass."""
    lines = documented_lines()
    assert len(lines) >= 30
    assert (
        "stableasync report",
        [
            "report",
            "RUN_DIR...",
            "--out",
            "cmp",
            "--target-reward",
            "0.6",
            "--ess-collapse-below",
            "0.2",
            "--ess-collapse-steps",
            "5",
        ],
    ) in [(c, a) for _, c, a in lines]
    assert {
        "stableasync status",
        "stableasync logs",
        "stableasync stop",
        "stableasync sweep",
        "benchmarks.async_speedup",
        "cluster.remote.job_entrypoint",
    } <= {c for _, c, _ in lines}
    assert commands_in(".venv/bin/python -m benchmarks.generation --job JOB.yaml   # a comment") == [
        ("benchmarks.generation", ["--job", "JOB.yaml"])
    ]


def test_every_documented_command_line_parses():
    """Each command line in a fenced block, through the command's own argument parser: a renamed or removed
    flag, subcommand or benchmark fails here, naming the line."""
    from cluster.cli import build_parser

    failures = []
    for where, command, args in documented_lines():
        if command == "cluster.remote.job_entrypoint":  # it takes any command: the one it wraps is checked on its own
            continue
        try:
            parser = (
                build_parser()
                if command.startswith("stableasync ")
                else importlib.import_module(command).build_parser()
            )
            parser.parse_args(args)
        except (SystemExit, ImportError, AttributeError) as error:
            failures.append(f"{where}: {command} {' '.join(args)} ({type(error).__name__}: {error})")
    assert not failures, "\n".join(failures)


def test_every_documented_command_and_every_benchmark_has_a_smoke_test():
    """The table above, against the docs and benchmarks/: each command in it, and only those; every test it
    names exists and runs its command (the command's name is in the test's code)."""
    from cluster.cli import build_parser

    subcommands = next(action.choices for action in build_parser()._actions if action.dest == "command")
    documented = documented_names()
    unknown = {
        name
        for name in documented
        if name.startswith("stableasync ") and name.removeprefix("stableasync ") not in subcommands
    }
    assert not unknown, f"the docs name commands the CLI does not have: {sorted(unknown)}"
    wanted = documented | benchmark_modules()
    assert not wanted - set(SMOKE_TESTS), f"no smoke test listed for {sorted(wanted - set(SMOKE_TESTS))}"
    assert not set(SMOKE_TESTS) - wanted, (
        f"listed but neither documented nor a benchmark: {sorted(set(SMOKE_TESTS) - wanted)}"
    )
    for command, tests in SMOKE_TESTS.items():
        name = command.split()[-1].split(".")[-1]
        runs_it = re.compile(rf"""(["'.]|import ){re.escape(name)}\b""")  # "train", -m benchmarks.x, import x
        for test in tests:
            path, function = test.split("::")
            source = (ROOT / path).read_text()
            found = [
                node
                for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.FunctionDef) and node.name == function
            ]
            assert found, f"{test} (for {command}) does not exist"
            assert runs_it.search(ast.get_source_segment(source, found[0])), f"{test} does not run {command}"


@pytest.mark.parametrize("line", ["stableasync nosuch RUN_DIR", "python -m benchmarks.async_speedup --max-lag 1"])
def test_a_command_line_that_no_longer_parses_is_caught(line):
    """The parsing check can fail: an unknown subcommand, a misspelt flag."""
    from cluster.cli import build_parser

    ((command, args),) = commands_in(line)
    parser = build_parser() if command.startswith("stableasync ") else importlib.import_module(command).build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(args)
