"""The job file: every error at once with its field path, cross-field checks, no torch/ray import."""

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.job import Job, JobValidationError, dump_job, load_job, validate_job

ROOT = Path(__file__).resolve().parents[3]
MINIMAL = {"task": {"name": "arithmetic"}}


def _errors(data):
    with pytest.raises(JobValidationError) as info:
        validate_job(data, "job.yaml")
    return {e.path: e.message for e in info.value.errors}


def test_minimal_job_gets_the_defaults():
    job = validate_job(MINIMAL)
    assert job.algorithm.stabilizer.name == "tis_seq" and job.algorithm.stabilizer.cap == 2.0
    assert job.async_.max_lag == 1 and job.learner.zero_stage == 2


# Their task.path is the repository as `ray up` syncs it to every node, absent here unless cloned there
DATA_ON_THE_CLUSTER = {"cluster.yaml", "qwen2.5-7b.yaml"}
CLUSTER_DATA = Path("~/stableasync/tasks/data/gsm8k/train.jsonl").expanduser()


def test_every_deploy_job_validates(monkeypatch, capsys):
    """`stableasync validate` from the repository root, as the README runs them: the schema, then the task
    (data rows, reward function) and the evaluation set."""
    from cluster.cli import main as cli_main

    jobs = sorted((ROOT / "deploy" / "jobs").glob("*.yaml"))
    assert len(jobs) >= 2, "deploy/jobs holds the demo job and the dataset template"
    monkeypatch.chdir(ROOT)
    for path in jobs:
        relative = str(path.relative_to(ROOT))
        assert cli_main(["validate", "--schema-only", relative]) == 0, capsys.readouterr().err
        if path.name in DATA_ON_THE_CLUSTER and not CLUSTER_DATA.is_file():
            assert cli_main(["validate", relative]) == 2
            assert f"task.path: no data file at {CLUSTER_DATA}" in capsys.readouterr().err
        else:
            assert cli_main(["validate", relative]) == 0, capsys.readouterr().err


def test_all_errors_at_once_with_field_paths():
    errors = _errors(
        {
            "task": {"name": "arithmetic", "max_operand": "many"},
            "learner": {"num_ranks": 0, "zero_stage": 5},
            "async": {"max_lag": -1},
            "algorithm": {"stabilizer": {"name": "tis_seq", "cap": 2.0, "capp": 3}},
            "surprise": 1,
        }
    )
    assert set(errors) >= {
        "task.max_operand",
        "learner.num_ranks",
        "learner.zero_stage",
        "async.max_lag",
        "algorithm.stabilizer.capp",
        "surprise",
    }
    assert "greater than or equal to 0" in errors["async.max_lag"]


def test_unknown_stabilizer_names_the_choices():
    errors = _errors({**MINIMAL, "algorithm": {"stabilizer": {"name": "magic"}}})
    message = errors["algorithm.stabilizer"]
    assert "magic" in message and "vcpo" in message and "m2po" in message


def test_stabilizer_sections_carry_reference_defaults():
    job = validate_job({**MINIMAL, "algorithm": {"stabilizer": {"name": "vcpo"}}})
    vcpo = job.algorithm.stabilizer
    assert vcpo.cap == 8.0 and vcpo.rho_on == 1.0 and vcpo.use_baseline and vcpo.opob_impl == "auto"


def test_stabilizer_values_out_of_their_bounds_name_the_field():
    # each of these used to pass validation and fail steps into the run: log(0) for a cap of 0, a BAPO
    # bound walk with step 0 that never ends, an MIS band that masks everything
    assert (
        "greater than 0"
        in _errors({**MINIMAL, "algorithm": {"stabilizer": {"name": "tis_seq", "cap": 0}}})["algorithm.stabilizer.cap"]
    )
    assert (
        "greater than 0"
        in _errors({**MINIMAL, "algorithm": {"stabilizer": {"name": "bapo", "step": 0}}})["algorithm.stabilizer.step"]
    )
    swapped = _errors({**MINIMAL, "algorithm": {"stabilizer": {"name": "mis_token", "low": 2.0, "high": 0.5}}})
    assert "low (2.0) must not exceed high (0.5)" in swapped["algorithm.stabilizer"]
    assert validate_job({**MINIMAL, "algorithm": {"stabilizer": {"name": "mis_token", "low": 0.2, "high": 4}}})


def test_vcpo_gradient_norm_path_is_a_closed_choice():
    errors = _errors({**MINIMAL, "algorithm": {"stabilizer": {"name": "vcpo", "opob_impl": "vmap"}}})
    assert "ghost" in errors["algorithm.stabilizer.opob_impl"]


def test_vcpo_book_keeping_budget_is_auto_or_mib_above_0():
    def stabilizer(**values):
        return {**MINIMAL, "algorithm": {"stabilizer": {"name": "vcpo", **values}}}

    assert validate_job(stabilizer()).algorithm.stabilizer.bookkeeping_budget_mb == "auto"
    assert validate_job(stabilizer(bookkeeping_budget_mb=512)).algorithm.stabilizer.bookkeeping_budget_mb == 512
    for bad in (0, -1.5):
        message = _errors(stabilizer(bookkeeping_budget_mb=bad))["algorithm.stabilizer"]
        assert f"bookkeeping_budget_mb must be auto or a number of MiB > 0, got {bad}" in message
    assert "bookkeeping_budget_mb" in str(_errors(stabilizer(bookkeeping_budget_mb="lots")))


def test_cross_field_checks():
    errors = _errors(
        {
            **MINIMAL,
            "learner": {"num_ranks": 2, "prompts_per_step": 3},
            "algorithm": {"loss_aggregation": "constant"},
            "generator": {"max_new_tokens": 600, "max_model_len": 512},
            "cluster": {"num_cpus": 2},
        }
    )
    assert "split evenly over 2 ranks" in errors["learner.prompts_per_step"]
    assert "required" in errors["algorithm.constant_tokens"]
    assert "no room for the prompt" in errors["generator.max_new_tokens"]
    assert "needs 3 CPUs" in errors["cluster.num_cpus"]


def test_dropping_uniform_groups_needs_groups_of_more_than_one_response():
    errors = _errors(
        {
            **MINIMAL,
            "algorithm": {"drop_uniform_groups": True, "max_uniform_groups_in_a_row": 0},
            "generator": {"samples_per_prompt": 1},
        }
    )
    assert "all would be dropped" in errors["algorithm.drop_uniform_groups"]
    assert "greater than 0" in errors["algorithm.max_uniform_groups_in_a_row"]
    job = validate_job({**MINIMAL, "algorithm": {"drop_uniform_groups": True}, "generator": {"samples_per_prompt": 2}})
    assert job.algorithm.drop_uniform_groups and job.algorithm.max_uniform_groups_in_a_row == 256
    assert not validate_job(MINIMAL).algorithm.drop_uniform_groups  # off unless asked for


def test_nucleus_sampling_is_refused_because_the_learner_cannot_mirror_its_log_probs():
    """vLLM renormalises a nucleus-sampled token's log-prob over the nucleus; the learner's are over the whole
    vocabulary: with top_p < 1 every ratio would be biased, so validation says so instead of training on it."""
    errors = _errors({**MINIMAL, "generator": {"top_p": 0.9}})
    assert (
        "renormalised over the nucleus" in errors["generator.top_p"]
        and "generator.temperature" in errors["generator.top_p"]
    )
    assert validate_job({**MINIMAL, "generator": {"top_p": 1.0}}).generator.top_p == 1.0


def test_several_updates_per_step_need_the_recomputed_proximal_policy_and_whole_groups_per_mini_batch():
    errors = _errors({**MINIMAL, "learner": {"epochs": 2, "prompts_per_step": 8, "num_ranks": 2, "mini_batches": 3}})
    assert "6 updates per step" in errors["algorithm.proximal"] and "recompute" in errors["algorithm.proximal"]
    assert "4 prompt groups per rank cannot be split evenly into 3" in errors["learner.mini_batches"]
    job = validate_job(
        {
            **MINIMAL,
            "algorithm": {"proximal": "recompute"},
            "learner": {"epochs": 2, "prompts_per_step": 8, "num_ranks": 2, "mini_batches": 2},
        }
    )
    assert (job.learner.mini_batches, job.learner.epochs, job.algorithm.proximal_eps_high) == (2, 2, 0.2)
    assert validate_job(MINIMAL).algorithm.proximal == "behaviour"  # one update against the behaviour policy


def test_the_overlong_buffer_must_fit_in_a_response():
    errors = _errors({**MINIMAL, "algorithm": {"overlong_buffer_tokens": 65, "overlong_penalty": -1}})
    assert "more than the 64 tokens" in errors["algorithm.overlong_buffer_tokens"]
    assert "greater than or equal to 0" in errors["algorithm.overlong_penalty"]
    assert validate_job({**MINIMAL, "algorithm": {"overlong_buffer_tokens": 64}}).algorithm.overlong_penalty == 1.0


def test_field_and_cross_field_errors_come_in_one_pass():
    errors = _errors(
        {
            "task": {"name": "countdown", "extra": 1},
            "learner": {"num_ranks": 2, "prompts_per_step": 3},
            "algorithm": {"stabilizer": {"name": "m2po", "tau": "small"}},
        }
    )
    assert set(errors) == {"task.extra", "algorithm.stabilizer.tau", "learner.prompts_per_step"}


def test_an_evaluation_file_is_refused_for_a_task_that_reads_none():
    assert _errors({**MINIMAL, "eval": {"every_steps": 5, "task_path": "/data/test.jsonl"}}) == {
        "eval.task_path": "task 'arithmetic' reads no data file; leave it unset"
    }
    assert validate_job({**MINIMAL, "eval": {"every_steps": 5, "num_problems": 8}}).eval.every_steps == 5


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task:\n  name: arithmetic\n learner: [\n")
    with pytest.raises(JobValidationError) as info:
        load_job(path)
    assert info.value.errors[0].path.startswith("line ")


def test_dry_run_round_trips(tmp_path):
    job = validate_job({**MINIMAL, "async": {"max_lag": 4}})
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_job(job))
    assert load_job(path) == job


def test_validate_dry_run_prints_the_resolved_job(monkeypatch, capsys, tmp_path):
    """The README's `stableasync validate deploy/jobs/demo.yaml --dry-run`: the job with every default filled,
    which loads back as the same job."""
    from cluster.cli import main as cli_main

    monkeypatch.chdir(ROOT)
    assert cli_main(["validate", "deploy/jobs/demo.yaml", "--dry-run"]) == 0
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(capsys.readouterr().out)
    assert "lr_warmup_steps: 0" in resolved.read_text()  # a default the demo file leaves out
    assert load_job(resolved) == load_job(ROOT / "deploy" / "jobs" / "demo.yaml")


def test_schema_imports_no_torch_or_ray():
    import subprocess
    import sys

    code = "import sys, cluster.job; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert not {"torch", "ray", "vllm", "deepspeed"} & set(out.split())


leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=8))
job_like = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "task",
                    "name",
                    "learner",
                    "async",
                    "max_lag",
                    "stabilizer",
                    "algorithm",
                    "cap",
                    "num_ranks",
                    "generator",
                    "model",
                    "x",
                ]
            ),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job_like)
def test_fuzzed_job_files_either_validate_or_raise_a_job_error(data):
    try:
        job = validate_job(data)
    except JobValidationError as error:
        assert error.errors and all(e.path and e.message for e in error.errors)
    else:
        assert isinstance(job, Job)
        yaml.safe_load(dump_job(job))


def test_alert_thresholds_default_validate_and_turn_off():
    alerts = validate_job(MINIMAL).logging.alerts
    assert (alerts.ess_ratio_below, alerts.ess_collapse_steps) == (0.1, 3)
    assert (alerts.grad_norm_above, alerts.grad_norm_spike_factor, alerts.grad_norm_window_steps) == (None, 10.0, 20)
    errors = _errors(
        {
            **MINIMAL,
            "logging": {
                "alerts": {
                    "ess_ratio_below": 1.5,
                    "ess_collapse_steps": 0,
                    "grad_norm_above": -1,
                    "grad_norm_spike_factor": 0.5,
                    "grad_norm_window_steps": 0,
                    "ess_below": 0.2,
                }
            },
        }
    )
    assert set(errors) == {
        f"logging.alerts.{name}"
        for name in (
            "ess_ratio_below",
            "ess_collapse_steps",
            "grad_norm_above",
            "grad_norm_spike_factor",
            "grad_norm_window_steps",
            "ess_below",
        )
    }
    off = validate_job({**MINIMAL, "logging": {"alerts": {"ess_ratio_below": None, "grad_norm_spike_factor": None}}})
    assert off.logging.alerts.ess_ratio_below is None and off.logging.alerts.grad_norm_spike_factor is None
    assert validate_job(yaml.safe_load(dump_job(off))) == off


def test_every_alert_threshold_is_documented():
    from cluster.job import AlertsSection

    assert all(field.description for field in AlertsSection.model_fields.values())
    docs = (ROOT / "docs" / "wandb.md").read_text()
    assert all(f"`{name}`" in docs for name in AlertsSection.model_fields)


def test_scoring_settings_default_validate_and_are_documented():
    from cluster.job import ScoringSection

    scoring = validate_job(MINIMAL).scoring
    settings = (scoring.workers, scoring.timeout_s, scoring.memory_limit_mb, scoring.startup_timeout_s)
    assert settings == (1, 5.0, 4096, 120.0)
    errors = _errors(
        {
            **MINIMAL,
            "scoring": {"workers": 0, "timeout_s": 0, "memory_limit_mb": -1, "startup_timeout_s": -5, "timeout": 3},
        }
    )
    assert set(errors) == {
        f"scoring.{name}" for name in ("workers", "timeout_s", "memory_limit_mb", "startup_timeout_s", "timeout")
    }
    assert validate_job({**MINIMAL, "scoring": {"memory_limit_mb": None}}).scoring.memory_limit_mb is None
    assert all(field.description for field in ScoringSection.model_fields.values())
    jobs_doc = (ROOT / "docs" / "jobs.md").read_text()  # the job file's walkthrough, linked from the README
    assert all(f"`scoring.{name}`" in jobs_doc for name in ScoringSection.model_fields)


def test_a_model_path_that_is_no_folder_stops_validate_and_train_before_anything_starts(tmp_path, capsys):
    from cluster.cli import main as cli_main

    runs = tmp_path / "runs"
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{path: {tmp_path}/nowhere}}\ntask: {{name: arithmetic}}\nlogging: {{run_dir: {runs}}}\n")
    assert cli_main(["validate", str(job)]) == 2
    assert f"model.path: no model folder at {tmp_path}/nowhere" in capsys.readouterr().err
    assert cli_main(["validate", "--schema-only", str(job)]) == 0
    assert cli_main(["train", str(job)]) == 2
    assert capsys.readouterr().err.startswith(f"stableasync train: model.path: no model folder at {tmp_path}/nowhere")
    assert not runs.exists(), "no run directory for a job that never started"


def test_a_micro_batch_budget_below_one_sequence_names_the_field():
    errors = _errors(
        {
            **MINIMAL,
            "generator": {"max_model_len": 1024, "max_new_tokens": 64},
            "learner": {"max_tokens_per_micro_batch": 1000},
        }
    )
    assert "1000 is less than one sequence may hold" in errors["learner.max_tokens_per_micro_batch"]
    job = validate_job(
        {
            **MINIMAL,
            "generator": {"max_model_len": 1024, "max_new_tokens": 64},
            "learner": {"max_tokens_per_micro_batch": 1024},
        }
    )
    assert job.learner.max_tokens_per_micro_batch == 1024


def test_the_micro_batch_budget_is_auto_by_default_and_any_max_model_len_passes():
    """auto fits the rank's memory at start (learner/memory_budget.py), so no max_model_len is too long for it
    here; the resolved job says auto, and loads back so."""
    job = validate_job({**MINIMAL, "generator": {"max_model_len": 100000, "max_new_tokens": 64}})
    assert job.learner.max_tokens_per_micro_batch == "auto"
    assert "max_tokens_per_micro_batch: auto" in dump_job(job)
    assert validate_job({**MINIMAL, "learner": {"max_tokens_per_micro_batch": "auto"}}) == validate_job(MINIMAL)


@pytest.mark.parametrize("value", ["big", "Auto", 0, -8, 1.5, True, None])
def test_a_micro_batch_budget_neither_auto_nor_a_token_count_is_one_error_naming_the_field(value):
    errors = _errors({**MINIMAL, "learner": {"max_tokens_per_micro_batch": value}})
    assert errors == {
        "learner.max_tokens_per_micro_batch": f"{value!r} is neither auto nor a whole number of tokens above 0"
    }


def test_set_overrides_fields_as_yaml_and_the_schema_checks_them(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"task": {"name": "arithmetic"}, "learner": {"steps": 5}}))
    job = load_job(
        path,
        [
            "learner.steps=100",
            "learner.learning_rate=2e-6",
            "async.max_lag=3",
            "algorithm.stabilizer={name: vcpo, use_baseline: false}",
            "eval.before_training=true",
        ],
    )
    assert job.learner.steps == 100 and job.learner.learning_rate == 2e-6 and job.async_.max_lag == 3
    assert job.algorithm.stabilizer.name == "vcpo" and job.algorithm.stabilizer.use_baseline is False
    assert job.eval.before_training is True  # a section the file does not have is created
    with pytest.raises(JobValidationError) as info:
        load_job(path, ["learner.stepz=7", "learner.steps=-1", "novalue", "task.name.x=1"])
    errors = {e.path: e.message for e in info.value.errors}
    assert set(errors) == {"--set", "task.name", "learner.steps", "learner.stepz"}  # every error at once
    assert "not FIELD=VALUE" in errors["--set"] and "not a section" in errors["task.name"]


def test_a_resumed_run_refuses_set(tmp_path, capsys):
    from cluster.cli import main as cli_main

    assert cli_main(["train", "--resume", str(tmp_path), "--set", "learner.steps=9"]) == 2
    assert "a resumed run keeps its own job.yaml" in capsys.readouterr().err


def test_the_cli_prints_an_explained_failure_without_a_traceback(monkeypatch, capsys):
    import cluster.cli as cli
    from tasks.base import TaskError

    def fails(args):
        raise TaskError("task.path: row 3 has no 'answer'")

    monkeypatch.setattr(cli, "_validate", fails)
    assert cli.main(["validate", "job.yaml"]) == 1
    assert capsys.readouterr().err.strip() == "stableasync validate: task.path: row 3 has no 'answer'"


def test_kl_and_entropy_settings_validate_and_bad_ones_name_their_field():
    job = validate_job(
        {
            **MINIMAL,
            "algorithm": {
                "kl": {"coef": 0.01, "in": "reward", "target": 0.1},
                "advantage": "rloo",
                "entropy_coef": 0.001,
            },
        }
    )
    assert (job.algorithm.kl.in_, job.algorithm.kl.estimator, job.algorithm.kl.target) == ("reward", "low_var+", 0.1)
    assert validate_job(yaml.safe_load(dump_job(job))) == job  # `in` round-trips under its own name
    errors = _errors({**MINIMAL, "algorithm": {"kl": {"estimator": "k9"}, "entropy_coef": -1}})
    assert "'k1', 'k2', 'k3', 'low_var', 'k3+' or 'low_var+'" in errors["algorithm.kl.estimator"]
    assert "algorithm.entropy_coef" in errors
    k1_in_loss = _errors({**MINIMAL, "algorithm": {"kl": {"estimator": "k1"}}})  # no gradient in expectation
    assert "expected gradient of 0" in k1_in_loss["algorithm.kl.estimator"]
    assert validate_job({**MINIMAL, "algorithm": {"kl": {"estimator": "k1", "in": "reward"}, "advantage": "dr_grpo"}})


def test_the_kl_reference_is_the_policy_rl_starts_from_unless_lora_cannot_give_it():
    job = validate_job({**MINIMAL, "algorithm": {"kl": {}}})
    assert job.algorithm.kl.reference == "rl_start"
    lora_warm = {**MINIMAL, "model": {"lora": {"rank": 8}, "sft_warmup": {"steps": 5}}, "algorithm": {"kl": {}}}
    assert "set algorithm.kl.reference: model" in _errors(lora_warm)["algorithm.kl.reference"]
    assert validate_job({**lora_warm, "algorithm": {"kl": {"reference": "model"}}})


def test_kl_in_the_reward_is_refused_before_a_std_normalisation_naming_both_fields():
    """GRPO's std would rescale a group of equal rewards' KL differences to unit advantages."""
    grpo = _errors({**MINIMAL, "algorithm": {"kl": {"in": "reward"}}})["algorithm.kl.in"]
    assert "algorithm.advantage (grpo)" in grpo and "dr_grpo, rloo or reinforce" in grpo
    vcpo = _errors({**MINIMAL, "algorithm": {"kl": {"in": "reward"}, "stabilizer": {"name": "vcpo"}}})
    assert "algorithm.stabilizer.norm_by_std" in vcpo["algorithm.kl.in"]
    for fine in (
        {"advantage": "reinforce"},
        {"stabilizer": {"name": "vcpo", "norm_by_std": False}},
        {"advantage": "grpo", "kl": {"in": "loss"}},
    ):
        assert validate_job({**MINIMAL, "algorithm": {"kl": {"in": "reward"}, **fine}})
    errors = _errors(
        {**MINIMAL, "algorithm": {"entropy_coef": 0.01, "stabilizer": {"name": "vcpo", "opob_impl": "bookkeeping"}}}
    )
    assert "cannot carry a KL term in the loss or an entropy bonus" in errors["algorithm.stabilizer.opob_impl"]


def test_lora_settings_outside_what_runs_name_their_field():
    lora = {"model": {"lora": {"rank": 8}}}
    assert validate_job({**MINIMAL, **lora}).model.lora.target_modules[0] == "q_proj"
    errors = _errors(
        {
            **MINIMAL,
            **lora,
            "learner": {"zero_stage": 3},
            "async": {"weight_sync": "gloo"},
            "generator": {"streaming": True},
        }
    )
    assert {"learner.zero_stage", "async.weight_sync", "generator.streaming"} <= set(errors)
    assert "model.lora.rank" in _errors({**MINIMAL, "model": {"lora": {"rank": 0}}})
    assert "model.lora.target_modules" in _errors({**MINIMAL, "model": {"lora": {"target_modules": []}}})


def test_a_fixed_lag_refuses_each_setting_that_would_train_a_group_at_another_lag():
    assert validate_job({**MINIMAL, "async": {"fixed_lag": 4, "max_lag": 4}}).async_.fixed_lag == 4
    assert validate_job(MINIMAL).async_.fixed_lag is None
    errors = _errors(
        {
            **MINIMAL,
            "async": {"fixed_lag": 4, "max_lag": 2, "stale_policy": "drop"},
            "generator": {"streaming": True},
            "algorithm": {"drop_uniform_groups": True},
        }
    )
    refused = {"async.max_lag", "async.stale_policy", "generator.streaming", "algorithm.drop_uniform_groups"}
    assert refused <= set(errors), errors
    assert all("async.fixed_lag 4" in errors[field] for field in refused), errors
    assert "async.fixed_lag" in _errors({**MINIMAL, "async": {"fixed_lag": -1}})


def test_a_lora_target_the_model_lacks_stops_train_before_anything_starts(tmp_path, tiny_qwen2):
    runs = tmp_path / "runs"
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {{path: {tiny_qwen2}, lora: {{target_modules: [q_proj, attn_c_proj]}}}}\n"
        f"task: {{name: arithmetic}}\nlogging: {{run_dir: {runs}}}\n"
    )
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "train", str(job)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "model.lora.target_modules: ['attn_c_proj'] name no linear layer of the model" in done.stderr, done.stderr
    assert not runs.exists(), "no run directory for a job that never started"


@pytest.mark.parametrize("model", ["tiny", "folder", "smollm2-135m"])
def test_validate_refuses_a_lora_target_the_model_lacks_as_train_would(tmp_path, tiny_qwen2, capsys, model):
    """`validate` said ok where `train` refused: the tiny model, a model folder and a known name are each
    checked from their architecture, on the meta device (nothing is loaded or built)."""
    from cluster.cli import main as cli_main

    path = tiny_qwen2 if model == "folder" else model
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {{path: {path}, lora: {{target_modules: [q_proj, attn_c_proj]}}}}\ntask: {{name: arithmetic}}\n"
    )
    assert cli_main(["validate", str(job)]) == 2
    assert "model.lora.target_modules: ['attn_c_proj'] name no linear layer of" in capsys.readouterr().err
    job.write_text(
        f"model: {{path: {path}, lora: {{target_modules: [q_proj, down_proj]}}}}\ntask: {{name: arithmetic}}\n"
    )
    assert cli_main(["validate", str(job)]) == 0


def test_validate_and_train_refuse_a_hub_id_that_is_not_cached_when_the_hub_cannot_be_reached(tmp_path):
    """`validate` said ok, then `train` retried the hub for 52 s: models are not downloaded at run time here, and
    without the hub (HF_HUB_OFFLINE) a hub id that is not in the cache is refused at once by both with exit 2,
    naming model.path and the way out, before a run directory exists. In a subprocess: the hub client reads
    HF_HUB_OFFLINE at import."""
    import os
    import subprocess
    import sys
    import time

    job = tmp_path / "job.yaml"
    runs = tmp_path / "runs"
    job.write_text(f"model: {{path: some-org/not-a-model}}\ntask: {{name: arithmetic}}\nlogging: {{run_dir: {runs}}}\n")
    for command in ("validate", "train"):
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "cluster.cli", command, str(job)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert done.returncode == 2, done.stderr[-2000:]
        said_by = "stableasync train" if command == "train" else str(job)
        assert done.stderr.startswith(
            f"{said_by}: model.path: 'some-org/not-a-model' is no local folder and not in the Hugging Face cache"
        ), done.stderr[-2000:]
        assert "the hub cannot be reached here (HF_HUB_OFFLINE, or no network)" in done.stderr, done.stderr
        assert done.stderr.rstrip().endswith("or give model.path a local model folder"), done.stderr
        assert time.monotonic() - started < 40, f"{command} waited on the hub"
    assert not runs.exists(), "no run directory for a job that never started"


def test_tool_settings_name_their_field(tmp_path):
    tools = validate_job({**MINIMAL, "environment": {"tools": ["calculator", "countdown_check"], "max_turns": 2}})
    assert tools.environment.tools == ["calculator", "countdown_check"]
    assert validate_job(MINIMAL).environment.tools == []
    errors = _errors(
        {
            **MINIMAL,
            "environment": {
                "tools": ["abacus", "calculator", "calculator", str(tmp_path / "missing.py") + ":lookup", "x.py:"],
                "max_turns": 0,
            },
        }
    )
    assert "unknown tool 'abacus'" in errors["environment.tools.0"] and "calculator" in errors["environment.tools.0"]
    assert "environment.tools.3" not in errors  # a file is read by validate and train: it may be on the cluster
    assert "FILE.py:NAME" in errors["environment.tools.4"]
    assert "listed twice" in errors["environment.tools"]
    assert "greater than or equal to 1" in errors["environment.max_turns"]


def test_a_tool_file_that_does_not_load_stops_validate_and_train_before_anything_starts(tmp_path, capsys):
    from cluster.cli import main as cli_main

    runs = tmp_path / "runs"
    job = tmp_path / "job.yaml"
    job.write_text(
        f"task: {{name: arithmetic}}\nenvironment: {{tools: [calculator, {tmp_path}/gone.py:lookup]}}\n"
        f"logging: {{run_dir: {runs}}}\n"
    )
    assert cli_main(["validate", str(job)]) == 2
    assert f"environment.tools.1: no file {tmp_path}/gone.py" in capsys.readouterr().err
    assert cli_main(["validate", "--schema-only", str(job)]) == 0  # the file may be on the cluster only
    assert cli_main(["train", str(job)]) == 2
    assert f"environment.tools.1: no file {tmp_path}/gone.py" in capsys.readouterr().err
    assert not runs.exists(), "no run directory for a job that never started"


def test_every_commands_positional_argument_says_what_it_is():
    """`train --help` and `validate --help` showed a bare `job`."""
    import argparse

    from cluster.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [
        f"{name} {action.dest}"
        for name, parser in commands.choices.items()
        for action in parser._actions
        if not action.option_strings and not action.help
    ]
    assert not bare, bare


def test_a_misspelt_field_is_answered_with_the_one_it_meant(tmp_path, capsys):
    """'Extra inputs are not permitted' alone left the user to find the field's spelling in the docs."""
    from cluster.cli import main as cli_main

    job = tmp_path / "job.yaml"
    job.write_text(
        "learner: {stepz: 3, learning_rat: 1.0e-5}\n"
        "algorithm: {stabilizer: {name: tis_seq, capp: 2}}\n"
        "task: {name: arithmetic, max_operandd: 3}\n"
        "nonsense: 1\n"
    )
    assert cli_main(["validate", str(job)]) == 2
    err = capsys.readouterr().err
    for line in (
        "learner.stepz: Extra inputs are not permitted; did you mean 'steps'?",
        "learner.learning_rat: Extra inputs are not permitted; did you mean 'learning_rate'?",
        "algorithm.stabilizer.capp: Extra inputs are not permitted; did you mean 'cap'?",
        "task.max_operandd: Extra inputs are not permitted; did you mean 'max_operand'?",
        "nonsense: Extra inputs are not permitted\n",
    ):
        assert line in err, err


def test_an_error_in_a_field_given_by_set_names_the_set_not_the_job_file(capsys):
    from cluster.cli import main as cli_main

    overrides = ["--set", "learner.steps=abc", "--set", "learner.stepz=3", "--set", "seed=1"]
    assert cli_main(["validate", "deploy/jobs/demo.yaml", *overrides]) == 2
    err = capsys.readouterr().err
    assert "learner.steps: Input should be a valid integer" in err and "(from --set learner.steps=abc)" in err
    assert "did you mean 'steps'? (from --set learner.stepz=3)" in err and "seed=1" not in err


def test_compiled_layers_are_refused_under_zero_3_and_reach_the_learner_spec_otherwise():
    from cluster.run.specs import learner_spec

    compiled = {**MINIMAL, "learner": {"compile": "layers"}}
    assert learner_spec(validate_job(compiled), "model").compiled_layers == "inductor"
    assert learner_spec(validate_job(MINIMAL), "model").compiled_layers is None
    debug = {**MINIMAL, "learner": {"compile": "layers", "compile_backend": "aot_eager"}}
    assert learner_spec(validate_job(debug), "model").compiled_layers == "aot_eager"
    errors = _errors({**MINIMAL, "learner": {"compile": "layers", "zero_stage": 3}})
    assert "learner.zero_stage 3" in errors["learner.compile"]
    assert "learner.compile" in _errors({**MINIMAL, "learner": {"compile": "everything"}})
