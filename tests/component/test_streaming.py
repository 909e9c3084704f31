"""The streaming generator (vLLM's AsyncLLM): groups sampled concurrently, a weight update that lands while
a long response is in flight, and each token's policy version recorded."""

from __future__ import annotations

import asyncio
import itertools
import statistics

import pytest

from learner.weight_sync import PackedWeights

pytest.importorskip("vllm")


def _request(group_id: int, seed: int = 0):
    from actors.generator import GenerationRequest

    return GenerationRequest(
        group_id, f"p{group_id}", [{"role": "user", "content": f"What is {group_id} + 3?"}], seed=seed + group_id
    )


def _weights(path: str):
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def _never_ending(path: str):
    """Weights under which a response runs to max_new_tokens: sharp logits, and end-of-turn's fixed at 0."""
    from transformers import AutoTokenizer

    weights = _weights(path)
    head = weights["lm_head.weight"] * 50
    head[AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("<|im_end|>")] = 0
    return {**weights, "lm_head.weight": head}


async def _until_tokens_are_sampled(generator, timeout_s: float = 60.0) -> None:
    """Wait until the engine has sampled some tokens of a request in flight."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    states = generator.engine.output_processor.request_states
    while not any(
        state.detokenizer is not None and state.detokenizer.num_output_tokens() > 0 for state in states.values()
    ):
        assert asyncio.get_running_loop().time() < deadline, "no token sampled"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def streaming(tiny_qwen2):
    from actors.generator import GeneratorSpec
    from actors.streaming import StreamingGenerator

    loop = asyncio.new_event_loop()

    async def build():  # AsyncLLM starts its output handler on the running loop
        return StreamingGenerator(
            GeneratorSpec(
                model_path=tiny_qwen2, samples_per_prompt=2, max_new_tokens=400, temperature=1.0, max_model_len=448
            )
        )

    generator = loop.run_until_complete(build())
    yield generator, loop
    loop.run_until_complete(generator.shutdown())
    loop.close()


def test_a_weight_update_lands_while_a_long_response_is_in_flight(streaming, tiny_qwen2):
    """The update pauses the engine with the request kept, loads, and resumes: the response finishes on the
    new weights, its tokens before the update labelled with the old version and after it with the new one,
    and the group's lag is measured from its oldest token. Version 2's weights are sharp and never end a
    response; version 3 is the model's own, so the log-probs show which weights sampled which tokens."""
    generator, loop = streaming

    async def scenario():
        await generator.update_weights(PackedWeights.pack(_weights(tiny_qwen2)), version=1)
        long = _never_ending(tiny_qwen2)
        await generator.update_weights(PackedWeights.pack(long), version=2)
        own = PackedWeights.pack(_weights(tiny_qwen2))  # packed before the request: the update lands early in it
        running = asyncio.ensure_future(generator.generate([_request(0)]))
        await _until_tokens_are_sampled(generator)  # some tokens sampled with version 2
        assert not running.done(), "the response finished before the update could land in it"
        load_s = await generator.update_weights(own, version=3)
        groups = await running
        return groups, load_s

    groups, load_s = loop.run_until_complete(scenario())
    [group] = groups
    assert load_s > 0 and group.weight_loads == 3
    for completion in group.completions:  # the tokens after the update were sampled by the new weights:
        (_, start, update), (_, _, end) = completion["version_spans"]  # sharp before, the model's own after
        logprobs = completion["behaviour_logprobs"]
        # (the head may be only a token or two, the first drawn from a flatter distribution: compared, not fixed)
        before, after = statistics.fmean(logprobs[start:update]), statistics.fmean(logprobs[update:end])
        assert after < -2.0 and before > after + 2.0, (logprobs[start:update], after)
    for completion in group.completions:
        spans = completion["version_spans"]
        assert [span[0] for span in spans] == [2, 3], spans  # sampled by version 2, finished by version 3
        assert spans[0][1] == 0 and spans[-1][2] == len(completion["completion_ids"])
        assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))  # contiguous, every token labelled once
        assert len(completion["behaviour_logprobs"]) == len(completion["completion_ids"])
    assert (group.version_start, group.version_end) == (2, 3)  # lag counts from the oldest token


def test_the_engine_core_process_keeps_vllms_per_load_lines_quiet(streaming):
    """Each load logs four lines in the engine core (pause, resume, the prefix-cache reset, the rotary cache that
    "failed to load"): at one load per step they flood the driver's console. The engine core is a process of
    its own, so the filters must be installed there, not only in the actor's."""
    import os

    from actors.vllm_logs import PER_RELOAD_LOGGERS

    generator, loop = streaming
    [(pid, quieted)] = loop.run_until_complete(generator.engine.collective_rpc("quieted_loggers"))
    assert pid != os.getpid() and quieted == list(PER_RELOAD_LOGGERS)


def test_groups_are_sampled_concurrently_and_each_returns_when_its_own_responses_are_done(streaming, tiny_qwen2):
    """Two generate calls in flight at once on one engine (continuous batching across groups): neither waits
    for the other to be sent back, and both are labelled with the weights they ran on."""
    generator, loop = streaming

    async def scenario():
        await generator.update_weights(PackedWeights.pack(_weights(tiny_qwen2)), version=4)
        return await asyncio.gather(generator.generate([_request(1)]), generator.generate([_request(2), _request(3)]))

    first, second = loop.run_until_complete(scenario())
    assert [g.group_id for g in first] == [1] and [g.group_id for g in second] == [2, 3]
    assert all(len(group.completions) == 2 for group in first + second)  # every sample, however they ended
    for group in first + second:
        assert (group.version_start, group.version_end) == (4, 4)
        assert all(
            c["version_spans"] == [[4, 0, len(c["completion_ids"])]] for c in group.completions if c["completion_ids"]
        )
