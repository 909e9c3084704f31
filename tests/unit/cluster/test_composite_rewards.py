"""Composite rewards (`scoring.rewards`): weighted components, a reward model whose failures fail only its own
samples, the schema and the load check that name the field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tasks.base import Problem, build_task
from tasks.config import ArithmeticConfig
from tasks.rewards import CompositeScorer, FormatReward, InlineRewardModel, RewardModelScorer, WeightedComponent
from tasks.scoring import score_inline

PROBLEM = Problem("p", "What is 1 + 1?", "2")
COMPLETIONS = ["<answer>2</answer>", "<answer>3</answer>", "no answer", "<answer>2</answer> and more words"]


def build_tiny_reward_model(policy_path: str, out: Path) -> str:
    """A random-init Qwen2 sequence-classification model with one output, with the tiny policy's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    config = AutoConfig.from_pretrained(policy_path)
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a head big enough that the scores of different texts differ clearly
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def tiny_reward_model(tiny_qwen2: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_reward_model(tiny_qwen2, tmp_path_factory.mktemp("models") / "tiny-reward-model")


class _InlineTask:
    """The task's verifier in-process, as a component (the pool does the same in subprocesses)."""

    def __init__(self) -> None:
        self.task = build_task("arithmetic", ArithmeticConfig())

    def score_many(self, problems, completions):
        return score_inline(self.task, problems, completions)

    def close(self) -> None:
        pass


def _messages(problem: Problem) -> list[dict[str, str]]:
    return [{"role": "user", "content": problem.question}]


def test_the_reward_model_scores_a_batch_as_it_scores_each_text_alone(tiny_reward_model):
    scorer = RewardModelScorer(tiny_reward_model, max_length=64, batch_size=3)
    conversations = [(_messages(PROBLEM), c) for c in COMPLETIONS]
    batched = scorer.score(conversations)
    alone = [scorer.score([item])[0] for item in conversations]
    assert all(r.error is None and math.isfinite(r.reward) for r in batched)
    assert [r.reward for r in batched] == pytest.approx([r.reward for r in alone], abs=1e-4)  # padding ignored
    assert len({round(r.reward, 4) for r in batched}) > 1, "different texts, different scores"


def test_a_chat_templated_text_is_read_with_one_bos_as_the_template_wrote_it(tiny_reward_model, tmp_path):
    """A Llama-style reward model: its template writes the BOS and its tokenizer adds one to whatever it encodes.
    The scorer's input starts with exactly one (two would shift every position the head was trained on)."""
    import shutil

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    folder = tmp_path / "llama-style"
    shutil.copytree(tiny_reward_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bos = tokenizer.eos_token  # a token the model's embedding has, standing in for <s>
    tokenizer.bos_token = bos
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.eos_token_id)]
    )
    tokenizer.save_pretrained(folder)
    scorer = RewardModelScorer(str(folder), max_length=64)
    assert scorer.tokenizer("x")["input_ids"][0] == tokenizer.eos_token_id  # the tokenizer does add one
    text = scorer.text(_messages(PROBLEM), COMPLETIONS[0])
    ids = scorer.encode([text])["input_ids"][0].tolist()
    assert ids[0] == tokenizer.eos_token_id and ids[1] != tokenizer.eos_token_id
    assert math.isfinite(scorer.score([(_messages(PROBLEM), COMPLETIONS[0])])[0].reward)


def test_a_composite_reward_is_the_weighted_sum_of_its_components(tiny_reward_model):
    scorer = RewardModelScorer(tiny_reward_model, max_length=64, batch_size=2)
    model_scores = [r.reward for r in scorer.score([(_messages(PROBLEM), c) for c in COMPLETIONS])]
    task_scores = [1.0, 0.1, 0.0, 1.0]
    with CompositeScorer(
        [
            WeightedComponent("task", 0.7, _InlineTask()),
            WeightedComponent("reward_model", -0.25, InlineRewardModel(scorer, _messages)),
            WeightedComponent("format", 0.5, FormatReward()),
        ]
    ) as composite:
        results = composite.score_many([PROBLEM] * len(COMPLETIONS), COMPLETIONS)
    by_hand = [0.7 * t - 0.25 * m + 0.5 * (c != "no answer") for t, m, c in zip(task_scores, model_scores, COMPLETIONS)]
    assert [r.reward for r in results] == pytest.approx(by_hand)
    assert [r.error for r in results] == [None] * 4
    assert [r.components["task"] for r in results] == task_scores
    assert [r.components["reward_model"] for r in results] == pytest.approx(model_scores)
    assert [r.components["format"] for r in results] == [1.0, 1.0, 0.0, 1.0]


def test_a_reward_model_that_returns_nan_or_raises_fails_only_its_samples(tiny_reward_model, monkeypatch):
    scorer = RewardModelScorer(tiny_reward_model, max_length=64, batch_size=2)
    calls = []

    def flaky(texts):
        calls.append(len(texts))
        if len(calls) == 1:
            return [0.5, math.nan]  # the first batch: one non-finite score
        raise RuntimeError("CUDA error: device-side assert")  # the second batch

    monkeypatch.setattr(scorer, "_logits", flaky)
    composite = CompositeScorer(
        [
            WeightedComponent("task", 1.0, _InlineTask()),
            WeightedComponent("reward_model", 2.0, InlineRewardModel(scorer, _messages)),
        ]
    )
    results = composite.score_many([PROBLEM] * len(COMPLETIONS), COMPLETIONS)
    assert calls == [2, 2]
    assert results[0].reward == pytest.approx(1.0 + 2 * 0.5) and results[0].error is None
    assert results[1].reward == 0.0 and results[1].error == "reward_model: non-finite score nan"
    for failed in results[2:]:
        assert failed.reward == 0.0
        assert failed.error == "reward_model: raised RuntimeError: CUDA error: device-side assert"
    assert results[1].components == {"task": 0.1}, "the task's score is kept for its metric; the sample still fails"
    assert composite.failures == 3


def test_a_failing_verifier_fails_the_sample_with_its_component_named():
    composite = CompositeScorer(
        [WeightedComponent("task", 1.0, _FailingTask()), WeightedComponent("format", 1.0, FormatReward())]
    )
    results = composite.score_many([PROBLEM, PROBLEM], ["<answer>2</answer>", "RAISE"])
    assert results[0].reward == 2.0 and results[1].reward == 0.0
    assert results[1].error == "task: raised RuntimeError: verifier bug"


class _FailingTask(_InlineTask):
    def __init__(self) -> None:
        from tasks.testing import FaultyArithmetic  # noqa: F401  (registers faulty-arithmetic)

        self.task = build_task("faulty-arithmetic", ArithmeticConfig())


# ---- the schema ---------------------------------------------------------------------------------------------


def _errors(rewards, **sections) -> list[str]:
    from cluster.job import JobValidationError, validate_job

    try:
        validate_job({"task": {"name": "arithmetic"}, "scoring": {"rewards": rewards}, **sections})
    except JobValidationError as error:
        return [str(e) for e in error.errors]
    return []


def test_the_schema_fills_in_a_reward_models_defaults_and_leaves_the_verifier_alone_without_rewards():
    import yaml

    from cluster.job import dump_job, validate_job

    job = validate_job(
        {
            "task": {"name": "arithmetic"},
            "scoring": {
                "rewards": [
                    {"name": "task", "weight": 0.5},
                    {"name": "reward_model", "path": "/models/rm", "weight": 0.5},
                ]
            },
        }
    )
    model = job.scoring.rewards[1]
    assert (model.path, model.batch_size, model.timeout_s, model.gpus, model.max_length) == (
        "/models/rm",
        8,
        60.0,
        0.0,
        1024,
    )
    assert validate_job({"task": {"name": "arithmetic"}}).scoring.rewards is None
    assert validate_job(yaml.safe_load(dump_job(job))) == job  # the run directory's job.yaml, read on resume


@pytest.mark.parametrize(
    "rewards, expected",
    [
        ([{"name": "bleu"}], "scoring.rewards.0.name: Input should be 'task', 'format' or 'reward_model'"),
        ([{"name": "task"}, {"name": "reward_model"}], "scoring.rewards.1: path: required for a 'reward_model' reward"),
        ([{"name": "task", "path": "/m"}], "scoring.rewards.0: path: not a field of a 'task' reward"),
        ([{"name": "reward_model", "path": "/m", "batch_size": 0}], "scoring.rewards.0.batch_size: Input should be"),
        ([{"name": "task", "weight": ".nan"}], "scoring.rewards.0.weight:"),
        ([{"name": "task"}, {"name": "task"}], "scoring.rewards.1.name: a second 'task' component"),
        ([], "scoring.rewards: List should have at least 1 item"),
    ],
)
def test_the_schema_refuses_bad_reward_components_by_their_field(rewards, expected):
    import yaml

    rewards = yaml.safe_load(yaml.safe_dump(rewards).replace("'.nan'", ".nan"))
    errors = _errors(rewards)
    assert len(errors) == 1 and errors[0].startswith(expected), errors


def test_any_rewards_input_gives_a_job_or_errors_naming_scoring_fields():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from cluster.job import Job, JobValidationError, validate_job

    keys = st.sampled_from(["name", "weight", "path", "batch_size", "timeout_s", "gpus", "max_length", "other", 3])
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 5),
        st.floats(allow_nan=True),
        st.text(max_size=4),
        st.sampled_from(["task", "format", "reward_model"]),
    )
    entries = st.one_of(
        scalars,
        st.lists(scalars, max_size=2),
        st.dictionaries(keys, st.one_of(scalars, st.lists(scalars, max_size=2)), max_size=5),
    )

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.one_of(scalars, st.lists(entries, max_size=3)))
    def check(rewards):
        try:
            assert isinstance(validate_job({"task": {"name": "arithmetic"}, "scoring": {"rewards": rewards}}), Job)
        except JobValidationError as error:
            assert error.errors and all(e.path.startswith("scoring.rewards") for e in error.errors), error

    check()


def test_reward_models_must_fit_on_the_cluster_beside_the_other_actors():
    from cluster.job import cross_field_errors, validate_job

    job = validate_job(
        {
            "task": {"name": "arithmetic"},
            "generator": {"gpus_per_generator": 1},
            "learner": {"gpus_per_rank": 1},
            "scoring": {"rewards": [{"name": "reward_model", "path": "/m", "gpus": 1}]},
        }
    )
    errors = [str(e) for e in cross_field_errors(job, {"CPU": 8, "GPU": 2})]
    assert errors == [
        "scoring.rewards.0.gpus: reward model actors take 1 GPUs beside the 2 of generators and "
        "learner ranks, but the cluster has 2"
    ]
    assert cross_field_errors(job, {"CPU": 8, "GPU": 3}) == []
    assert _errors([{"name": "reward_model", "path": "/m"}], cluster={"num_cpus": 2}) == [
        "scoring.rewards.0.name: reward model actors take 1 CPUs beside the 2 of generators and learner ranks, "
        "but the cluster has 2"
    ]


# ---- the check before any actor starts ----------------------------------------------------------------------


def test_a_reward_model_path_that_does_not_load_is_refused_by_its_field(tiny_reward_model, tiny_qwen2, tmp_path):
    from cluster.job import JobValidationError, validate_job
    from cluster.run.rewards import check_reward_models

    def job(path: str):
        return validate_job(
            {
                "task": {"name": "arithmetic"},
                "scoring": {"rewards": [{"name": "task"}, {"name": "reward_model", "path": path}]},
            }
        )

    check_reward_models(job(tiny_reward_model))  # loads: no error
    (tmp_path / "empty").mkdir()
    for path, reason in (
        (str(tmp_path / "missing"), "no such folder"),
        (str(tmp_path / "empty"), "does not load"),
        (tiny_qwen2, "is Qwen2ForCausalLM, not a sequence-classification model"),
    ):
        with pytest.raises(JobValidationError) as raised:
            check_reward_models(job(path))
        assert [e.path for e in raised.value.errors] == ["scoring.rewards.1.path"]
        assert reason in raised.value.errors[0].message


def test_two_outputs_are_not_a_reward_model(tiny_reward_model, tmp_path):
    import shutil

    from transformers import AutoConfig

    from cluster.job import validate_job
    from cluster.run.rewards import reward_model_errors

    folder = Path(shutil.copytree(tiny_reward_model, tmp_path / "two-labels"))
    config = AutoConfig.from_pretrained(folder)
    config.num_labels = 2
    config.save_pretrained(folder)
    job = validate_job(
        {"task": {"name": "arithmetic"}, "scoring": {"rewards": [{"name": "reward_model", "path": str(folder)}]}}
    )
    assert [str(e) for e in reward_model_errors(job)] == [
        f"scoring.rewards.0.path: {str(folder)!r} has 2 outputs; a reward model has one (num_labels 1)"
    ]


# ---- the loop's side: the verifier pool alone without rewards, each component's metric -----------------------


def test_without_rewards_training_is_scored_by_the_verifier_pool_itself():
    from cluster.job import validate_job
    from cluster.run.rewards import training_scorer

    pool = object()
    assert training_scorer(validate_job({"task": {"name": "arithmetic"}}), None, pool) is pool  # type: ignore[arg-type]


def test_each_component_is_logged_as_its_mean():
    from cluster.job import AlgorithmSection, ScoringSection
    from cluster.run.step_rows import ScoredSinceStep
    from cluster.telemetry.metrics import KNOWN_METRICS

    scoring = ScoringSection(rewards=[{"name": "task"}, {"name": "reward_model", "path": "/m"}, {"name": "format"}])
    scored = ScoredSinceStep(
        rewards=[1.0, 0.0], components={"task": [1.0, 0.1], "reward_model": [0.5, 1.5], "format": []}
    )
    row = scored.metrics(AlgorithmSection(), scoring)
    assert row["rollout/reward_task_mean"] == pytest.approx(0.55)
    assert row["rollout/reward_reward_model_mean"] == pytest.approx(1.0)
    assert "rollout/reward_format_mean" not in row  # every sample failed it: no mean, no NaN
    nothing_scored = ScoredSinceStep().metrics(AlgorithmSection(), scoring)  # the step trained earlier groups
    assert not any(f"rollout/reward_{name}_mean" in nothing_scored for name in ("task", "reward_model"))
    assert not any("reward_task" in key for key in ScoredSinceStep().metrics(AlgorithmSection(), ScoringSection()))
    assert {"rollout/reward_task_mean", "rollout/reward_reward_model_mean", "rollout/reward_format_mean"} <= set(
        KNOWN_METRICS
    )


def test_every_reward_kind_has_a_builder_a_metric_and_a_known_key():
    """A reward component lives in four places (CONTRIBUTING's checklist): one left out breaks a job only when
    it names that kind, so the four are checked together here."""
    from cluster.job.task_sections import REWARD_KINDS
    from cluster.run.rewards import REWARD_BUILDERS, REWARD_METRICS
    from cluster.telemetry.metrics import KNOWN_METRICS

    assert set(REWARD_BUILDERS) == set(REWARD_KINDS) == set(REWARD_METRICS)
    assert all(REWARD_METRICS[kind] == f"rollout/reward_{kind}_mean" in KNOWN_METRICS for kind in REWARD_KINDS)
