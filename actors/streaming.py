"""A streaming generator: vLLM's AsyncLLM samples many prompt groups at once and takes new weights between
engine steps, while the requests in flight go on.

Where `Generator` runs one blocking `LLM.generate` per request (new weights wait for it to end, and a group
of short answers waits for the longest in the call), this engine keeps sampling: each `generate` call is
one coroutine among many in the engine's continuous batch, and `update_weights` pauses the scheduler with
the requests kept (`pause_generation(mode="keep")`), loads the weights through the same weight-transfer
engines, recomputes the KV of the requests in flight with the new weights (vLLM preempts and re-prefills
them), and resumes. Every token records the policy version that sampled it: vLLM labels each engine step
with the version `finish_weight_update` set, and a response carries the spans (`Completion.version_spans`).
A group's `version_start` is its oldest token's version, which is what its lag is measured from.

A plain class with coroutines; `cluster/` runs it as an async Ray actor. AsyncLLM always runs its engine
core in a process of its own, so weights reach the worker through `collective_rpc`.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import TYPE_CHECKING, Any

from actors.generator import (
    GeneratedGroup,
    GenerationRequest,
    GeneratorSpec,
    ReportsTimings,
    chat_prompt_ids,
    completion_record,
    engine_args,
    weight_group_info,
)
from actors.vllm_logs import quiet_per_reload_logs
from algorithms.errors import StableAsyncError
from tasks.records import newest_version, oldest_version

if TYPE_CHECKING:
    from learner.weight_sync import PackedWeights
    from tasks.environment import EpisodeRunner, Turn, TurnRequest


class IncompleteGroup(StableAsyncError, RuntimeError):
    """The engine ended a request with fewer responses than asked for (a bug, not a fault)."""


class StreamingGenerator(ReportsTimings):
    """An AsyncLLM engine configured for its device by `engine_args`, sampling groups as they are sent."""

    def __init__(self, spec: GeneratorSpec, index: int = 0) -> None:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        super().__init__()
        self.spec, self.index, self.version = spec, index, 0
        self.incarnation = uuid.uuid4().hex
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(spec, index)))
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
        self.one_load_at_a_time = asyncio.Lock()
        self.episodes: EpisodeRunner | None = None  # tool episodes: built at the first call (it starts tool workers)
        quiet_per_reload_logs()

    async def generate(
        self, requests: list[GenerationRequest], samples: int | None = None, temperature: float | None = None
    ) -> list[GeneratedGroup]:
        """Sample every request's group concurrently with whatever else the engine is sampling; returns when
        all of them are done. Weights may change while they run: each response records its version spans."""
        sample_group = self._episode_group if self.spec.environment is not None else self._group
        with self.calling():
            groups = await asyncio.gather(*(sample_group(r, samples, temperature) for r in requests))
            return self._report(list(groups))

    async def _episode_group(
        self, request: GenerationRequest, samples: int | None, temperature: float | None
    ) -> GeneratedGroup:
        """Each response a multi-turn episode (`tasks/environment.py`), every episode going at its own pace: its next
        turn is sent as soon as its tools answered, and weights may change between turns and within one (each
        token keeps its version; the group's lag counts from the oldest)."""
        from tasks.environment import episode_runner

        if self.episodes is None:
            assert self.spec.environment is not None
            self.episodes = episode_runner(
                self.spec.environment, self.tokenizer, self.spec.max_new_tokens, self.spec.max_model_len
            )
        issued_version = self.version
        episodes = self.episodes.start_group(
            request.group_id, request.problem, request.messages, request.seed, samples or self.spec.samples_per_prompt
        )
        await asyncio.gather(
            *(self.episodes.run_one(episode, lambda turn: self._turn(turn, temperature)) for episode in episodes)
        )
        completions = [episode.record() for episode in episodes]
        return GeneratedGroup(
            request.group_id,
            request.problem_id,
            episodes[0].prompt_ids,
            completions,
            version_start=oldest_version(completions, issued_version),
            version_end=newest_version(completions, issued_version),
            generator_index=self.index,
            incarnation=self.incarnation,
        )

    async def _turn(self, turn: TurnRequest, temperature: float | None) -> Turn:
        """One policy turn of an episode, sampled beside everything else the engine runs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from tasks.environment import turn_of

        issued_version = self.version
        params = SamplingParams(
            n=1,
            temperature=self.spec.temperature if temperature is None else temperature,
            top_p=self.spec.top_p,
            max_tokens=turn.max_tokens,
            logprobs=0,
            seed=turn.seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=turn.context_ids), params, request_id=f"turn-{uuid.uuid4().hex[:12]}"
        ):
            final = next((c for c in output.outputs if c.finished()), final)
        if final is None:
            raise IncompleteGroup(f"vLLM ended an episode's turn (seed {turn.seed}) without its response")
        return turn_of(completion_record(final, issued_version))

    async def _group(
        self, request: GenerationRequest, samples: int | None, temperature: float | None
    ) -> GeneratedGroup:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        issued_version = self.version
        prompt_ids = chat_prompt_ids(self.tokenizer, request.messages)
        params = SamplingParams(
            n=samples or self.spec.samples_per_prompt,
            temperature=self.spec.temperature if temperature is None else temperature,
            top_p=self.spec.top_p,
            max_tokens=self.spec.max_new_tokens,
            logprobs=0,
            seed=request.seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        # FINAL_ONLY: one output with all n responses (streamed outputs carry one response each, as it moves);
        # kept by index all the same, so that no response is lost whichever way vLLM hands them over
        finished: dict[int, Any] = {}
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=f"{request.group_id}-{uuid.uuid4().hex[:8]}"
        ):
            finished.update((completion.index, completion) for completion in output.outputs if completion.finished())
        if len(finished) != params.n:
            raise IncompleteGroup(f"group {request.group_id}: vLLM returned {len(finished)} of {params.n} responses")
        completions = [completion_record(finished[index], issued_version) for index in sorted(finished)]
        return GeneratedGroup(
            request.group_id,
            request.problem_id,
            prompt_ids,
            completions,
            version_start=oldest_version(completions, issued_version),
            version_end=newest_version(completions, issued_version),
            generator_index=self.index,
            incarnation=self.incarnation,
        )

    async def update_weights(self, weights: PackedWeights, version: int) -> float:
        """Load weights from the object store (`stableasync_packed`) between engine steps; seconds taken. The
        engine core is another process: the buffer goes as bytes (vLLM's msgpack passes a tensor in an untyped
        field as its raw parts, which the worker cannot put back together)."""
        update_info = weights.update_info()
        return await self._load({**update_info, "data": memoryview(update_info["data"].numpy())}, version)

    async def join_weight_transfer(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join learner rank 0's weight group (nccl or stableasync_gloo) from the engine-core process; learner
        rank 0 joins at the same time."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = weight_group_info(self.spec, host, port, rank_offset, world_size)
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def receive_weights(self, update_info: dict[str, Any], version: int) -> float:
        """Receive the broadcast that learner rank 0 sends at the same time, between engine steps, with the
        requests in flight kept; seconds taken."""
        return await self._load(update_info, version)

    async def _load(self, update_info: dict[str, Any], version: int) -> float:
        """Pause with the requests in flight kept, load through vLLM's weight-transfer lifecycle, label the
        next tokens with `version`, recompute the kept requests' KV with the new weights, resume."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self.one_load_at_a_time:
            with self.loading():
                await self.engine.pause_generation(mode="keep", clear_cache=False)
                try:
                    await self.engine.start_weight_update()
                    await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
                    await self.engine.finish_weight_update(str(version))
                    await self.engine.reset_prefix_cache(reset_running_requests=True)
                    self.version = version
                finally:
                    await self.engine.resume_generation()
            return self.last_load_s

    async def process_id(self) -> int:
        """This generator's OS process (operators and fault tests kill it to check recovery)."""
        return os.getpid()

    async def shutdown(self) -> None:
        """Stop the engine core, on the event loop that runs the engine: vLLM closes the client's sockets
        there. Called from anywhere else while that loop is not running, the close is only scheduled, never
        runs, and the client's zmq context then blocks whoever garbage-collects it, for good (a test
        process at exit, or the next test's `ray.init`)."""
        self.engine.shutdown()
