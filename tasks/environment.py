"""Multi-turn episodes: the policy answers in turns, calling tools between them.

An episode starts from a problem's chat prompt. Each policy turn is sampled from the context so far; the
tool calls in it are parsed (`tasks.tools`, the chat template's tool-call format), run in sandboxed tool
workers, and their results appended as tool messages rendered by the model's chat template. The episode
ends at a turn without a tool call (the answer), at `max_turns`, when the token budget runs out, or when a
tool fails (raises, hangs, prints too much): then only this episode fails, with the reason.

The episode is one response to the learner: the completion is every token after the prompt, the policy's
and the tools', and `policy_mask` marks the policy's. Tool tokens are context, never trained on: they carry
no behaviour log-prob and no version, and fall outside the loss, every importance ratio and the ESS.

The engine is a callable, so this module runs without vLLM: `actors/generator.py` samples turns in
batches, `actors/streaming.py` one episode at a time while weights may change between turns.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.base import Problem, TaskError
from tasks.records import Completion
from tasks.sandbox import SandboxLimits
from tasks.tools import ParsedTurn, ToolCall, ToolResult, load_tools, parse_tool_calls, tool_schemas, tools_prompt


@dataclass(frozen=True)
class EnvironmentSpec:
    """The job's `environment` section as plain values (the generator's process builds its tools from it)."""

    tools: tuple[str, ...]  # built-in tool names or a user's 'FILE.py:NAME'
    max_turns: int = 4  # policy turns per episode, the answer's included
    tool_call_format: str = "hermes"
    tool_timeout_s: float = 5.0
    tool_memory_limit_mb: int | None = 1024
    max_tool_output_chars: int = 4096
    tool_workers: int = 1  # calls of different episodes (or of one turn) that run at once
    sandbox: SandboxLimits = field(
        default_factory=SandboxLimits
    )  # the job's `sandbox` section: isolation, environment, limits


@dataclass(frozen=True)
class TurnRequest:
    """One policy turn to sample: the episode's context so far and the tokens it may still take."""

    context_ids: list[int]  # [P + T so far]
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class Turn:
    """One policy turn as the engine sampled it."""

    token_ids: list[int]  # [n] the stop token included when the model stopped
    logprobs: list[float]  # [n]
    text: str
    finish_reason: str  # "stop" or "length"
    version_spans: list[list[int]]  # [[version, start, end), ...] from the turn's first token


def turn_of(record: Completion) -> Turn:
    """A sampled turn from the generator's record of one response to the episode's context."""
    return Turn(
        record["completion_ids"],
        record["behaviour_logprobs"],
        record["text"],
        record["finish_reason"],
        record["version_spans"],
    )


@dataclass
class Episode:
    """One episode's state: explicit changes through `add_turn`, `add_tool_results` and `end`."""

    problem: Problem
    prompt_ids: list[int]
    seed: int
    completion_ids: list[int] = field(default_factory=list)  # [T] policy and tool tokens in order
    behaviour_logprobs: list[float] = field(default_factory=list)  # [T] 0.0 on tool tokens
    policy_mask: list[int] = field(default_factory=list)  # [T] 1: the policy's token
    version_spans: list[list[int]] = field(default_factory=list)  # over the policy's tokens only
    policy_texts: list[str] = field(default_factory=list)  # each turn's text: what the verifier reads, joined
    transcript: list[str] = field(default_factory=list)  # the turns and the tools' messages, for a person to read
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str | None = None  # set when it ended: stop, length, max_turns or tool_error
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def turns(self) -> int:
        return len(self.policy_texts)

    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_turn(self, turn: Turn) -> None:
        offset = len(self.completion_ids)
        for version, start, end in turn.version_spans:
            last = self.version_spans[-1] if self.version_spans else None
            if last is not None and last[0] == version and last[2] == offset + start:
                last[2] = offset + end
            else:
                self.version_spans.append([version, offset + start, offset + end])
        self.completion_ids += turn.token_ids
        self.behaviour_logprobs += turn.logprobs
        self.policy_mask += [1] * len(turn.token_ids)
        self.policy_texts.append(turn.text)
        self.transcript.append(turn.text)

    def add_tool_results(self, token_ids: list[int], contents: Sequence[str]) -> None:
        self.transcript += [f"[tool] {content}" for content in contents]
        self.completion_ids += token_ids
        self.behaviour_logprobs += [0.0] * len(token_ids)
        self.policy_mask += [0] * len(token_ids)

    def end(self, finish_reason: str, error: str | None = None) -> None:
        self.finish_reason, self.error = finish_reason, error

    def record(self) -> Completion:
        return Completion(
            completion_ids=self.completion_ids,
            behaviour_logprobs=self.behaviour_logprobs,
            text="\n".join(self.policy_texts),
            finish_reason=self.finish_reason or "length",
            version_spans=self.version_spans,
            policy_mask=self.policy_mask,
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            episode_error=self.error,
            transcript="\n".join(self.transcript),
        )


_PROBE_ANSWER = "PROBE-ASSISTANT-TURN"


class ToolChat:
    """The model's chat template, for tool episodes: the prompt with the tools described, and tool messages
    rendered as the tokens that follow the policy's turn (exactly what the template writes between the end of an
    assistant turn and the start of the next one)."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
        self.tokenizer, self.schemas = tokenizer, schemas
        probe = [{"role": "user", "content": "q"}]
        self.template_renders_tools = self._render(probe, tools=schemas) != self._render(probe)
        self.eos_id: int = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.eos_token or ""
        self.tool_names = schema_names(schemas)

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool = False, **extra: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **extra
        )

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """A task's messages with the tools described in the system message, for templates that ignore `tools`."""
        if self.template_renders_tools:
            return messages
        description = tools_prompt(self.schemas)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{description}"}, *messages[1:]]
        return [{"role": "system", "content": description}, *messages]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        extra = {"tools": self.schemas} if self.template_renders_tools else {}
        text = self._render(self.messages(messages), generation_prompt=True, **extra)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tool_turn_ids(self, contents: Sequence[str], after_stop_token: bool = True) -> list[int]:
        """The tokens of the tool messages `contents` and the next assistant turn's opening, following a policy
        turn that ended with the stop token (`after_stop_token`) or without it."""
        turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE_ANSWER}]
        base = self._render(turn)
        full = self._render(turn + [{"role": "tool", "content": c} for c in contents], generation_prompt=True)
        cut = base.find(_PROBE_ANSWER) + len(_PROBE_ANSWER)
        if not full.startswith(base[:cut]):
            raise TaskError(
                "environment: the model's chat template renders earlier turns differently once tool "
                "messages follow; its episodes cannot be built token by token"
            )
        delta = full[cut:]
        if after_stop_token and self.eos_text and delta.startswith(self.eos_text):
            delta = delta[len(self.eos_text) :]
        return list(self.tokenizer.encode(delta, add_special_tokens=False))

    def demonstration(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """A demonstrated episode (assistant and tool messages after the prompt) as completion ids and policy mask:
        the tokens an episode of these turns would hold."""
        ids: list[int] = []
        mask: list[int] = []
        pending_tools: list[str] = []
        for message in messages:
            if message["role"] == "tool":
                pending_tools.append(message["content"])
                continue
            if pending_tools:
                tool_ids = self.tool_turn_ids(pending_tools)
                ids += tool_ids
                mask += [0] * len(tool_ids)
                pending_tools = []
            turn = [*list(self.tokenizer.encode(message["content"], add_special_tokens=False)), self.eos_id]
            ids += turn
            mask += [1] * len(turn)
        return ids, mask


@dataclass
class EpisodeBudget:
    """Tokens an episode may hold: `max_new_tokens` after its prompt, and `max_model_len` in all."""

    max_new_tokens: int
    max_model_len: int

    def left(self, episode: Episode) -> int:
        return min(
            self.max_new_tokens - len(episode.completion_ids),
            self.max_model_len - len(episode.prompt_ids) - len(episode.completion_ids),
        )


class EpisodeRunner:
    """The steps of an episode between engine calls: what a sampled turn asks for, and what the tools' results do.
    The drivers (`run_batched`, and the streaming generator's coroutine) only sample and call these."""

    def __init__(
        self,
        spec: EnvironmentSpec,
        chat: ToolChat,
        run_tools: Callable[[Sequence[tuple[ToolCall, Problem]]], list[ToolResult]],
        budget: EpisodeBudget,
    ) -> None:
        self.spec, self.chat, self.run_tools, self.budget = spec, chat, run_tools, budget

    def start(self, problem: Problem, messages: list[dict[str, str]], seed: int) -> Episode:
        return Episode(problem, self.chat.prompt_ids(messages), seed)

    def start_group(
        self, group_id: int, problem: Problem | None, messages: list[dict[str, str]], seed: int, episodes: int
    ) -> list[Episode]:
        """A prompt group's episodes, each with a seed of its own; the tools need the group's problem."""
        if problem is None:
            raise ValueError(f"group {group_id}: a tool episode needs the request's problem")
        prompt_ids = self.chat.prompt_ids(messages)
        return [Episode(problem, prompt_ids, seed * 1000 + i) for i in range(episodes)]

    def turn_request(self, episode: Episode) -> TurnRequest:
        return TurnRequest(episode.context_ids(), self.budget.left(episode), episode.seed * 1009 + episode.turns)

    def after_turn(self, episode: Episode, turn: Turn) -> ParsedTurn | None:
        """Add the sampled turn; the tool calls to run next, or None when the episode has ended."""
        episode.add_turn(turn)
        if turn.finish_reason == "length" or self.budget.left(episode) <= 0:
            episode.end("length")
            return None
        parsed = parse_tool_calls(turn.text, self.spec.tool_call_format)
        if not parsed.calls and not parsed.malformed:
            episode.end("stop")
            return None
        if episode.turns >= self.spec.max_turns:
            episode.end("max_turns")
            return None
        return parsed

    def after_tools(self, episode: Episode, parsed: ParsedTurn, results: list[ToolResult]) -> None:
        """Append the tool messages (results, then one error per malformed call), or end a failed episode."""
        episode.tool_calls += len(results)
        fatal = next((result for result in results if result.fatal), None)
        if fatal is not None:
            episode.end("tool_error", fatal.error)
            return
        episode.tool_errors += sum(result.error is not None for result in results) + len(parsed.malformed)
        stopped = bool(episode.completion_ids) and episode.completion_ids[-1] == self.chat.eos_id
        contents = [r.content for r in results] + parsed.malformed
        ids = self.chat.tool_turn_ids(contents, after_stop_token=stopped)
        if len(ids) >= self.budget.left(episode):
            episode.end("length")
            return
        episode.add_tool_results(ids, contents)

    async def run_one(self, episode: Episode, sample: Callable[[TurnRequest], Awaitable[Turn]]) -> None:
        """One episode to its end, each turn sampled as soon as the previous one's tools answered (a streaming
        engine: other episodes' turns, and weight loads, go on meanwhile); the tools run in a thread."""
        while not episode.done:
            parsed = self.after_turn(episode, await sample(self.turn_request(episode)))
            if parsed is not None:
                results = await asyncio.to_thread(self.run_tools, [(call, episode.problem) for call in parsed.calls])
                self.after_tools(episode, parsed, results)

    def run_batched(self, episodes: list[Episode], sample: Callable[[list[TurnRequest]], list[Turn]]) -> None:
        """Every episode to its end, one engine call per round of turns (the episodes still going) and one tool
        call per round."""
        while active := [episode for episode in episodes if not episode.done]:
            turns = sample([self.turn_request(episode) for episode in active])
            waiting = [
                (episode, parsed)
                for episode, turn in zip(active, turns, strict=True)
                if (parsed := self.after_turn(episode, turn)) is not None
            ]
            results = self.run_tools([(call, episode.problem) for episode, parsed in waiting for call in parsed.calls])
            for episode, parsed in waiting:
                mine, results = results[: len(parsed.calls)], results[len(parsed.calls) :]
                self.after_tools(episode, parsed, mine)


def schema_names(schemas: list[dict[str, Any]]) -> frozenset[str]:
    """The tools' names as the model calls them."""
    return frozenset(schema["function"]["name"] for schema in schemas)


def environment_tools(spec: EnvironmentSpec, field_name: str = "environment.tools") -> list[dict[str, Any]]:
    """The tools' JSON schemas (loading a user's tool file here checks it, in the caller's process)."""
    return tool_schemas(load_tools(spec.tools, field_name))


def episode_runner(spec: EnvironmentSpec, tokenizer: Any, max_new_tokens: int, max_model_len: int) -> EpisodeRunner:
    """A generator's episode runner, with its tool workers started (they live as long as the generator)."""
    from tasks.tools import ToolPool

    pool = ToolPool(
        spec.tools,
        workers=spec.tool_workers,
        timeout_s=spec.tool_timeout_s,
        memory_limit_mb=spec.tool_memory_limit_mb,
        max_output_chars=spec.max_tool_output_chars,
        limits=spec.sandbox,
    )
    chat = ToolChat(tokenizer, environment_tools(spec))
    return EpisodeRunner(spec, chat, pool.run_many, EpisodeBudget(max_new_tokens, max_model_len))


def score_responses(scorer: Any, problems: Sequence[Problem], completions: Sequence[Completion]) -> list[Any]:
    """The verifier's ScoreResult of each response (to the problem beside it), in one `score_many` call; a failed
    episode is not scored, and fails with its episode's reason (`scorer`: a ScorePool or any scorer like it)."""
    from tasks.scoring import ScoreResult

    live = [(p, c["text"]) for p, c in zip(problems, completions, strict=True) if not c.get("episode_error")]
    scores = iter(scorer.score_many([p for p, _ in live], [text for _, text in live]) if live else [])
    return [
        ScoreResult(0.0, f"episode failed: {c['episode_error']}") if c.get("episode_error") else next(scores)
        for c in completions
    ]


@dataclass
class EpisodeStats:
    """Tool episodes' counts over the responses scored since the last step row (`rollout/*` keys)."""

    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    failed: int = 0
    tool_tokens: int = 0
    tokens: int = 0

    def add(self, completions: Sequence[Completion]) -> None:
        for c in completions:
            if "policy_mask" not in c:
                continue  # one-turn responses
            self.episodes += 1
            self.turns += c.get("turns", 0)
            self.tool_calls += c.get("tool_calls", 0)
            self.tool_errors += c.get("tool_errors", 0)
            self.failed += bool(c.get("episode_error"))
            self.tool_tokens += len(c["policy_mask"]) - sum(c["policy_mask"])
            self.tokens += len(c["policy_mask"])

    def metrics(self) -> dict[str, float]:
        """Per episode means; NaN when no episode was scored since the last row (the step row leaves those out)."""
        episodes = self.episodes or math.nan
        return {
            "rollout/turns_mean": self.turns / episodes,
            "rollout/tool_calls_mean": self.tool_calls / episodes,
            "rollout/tool_errors_mean": self.tool_errors / episodes,
            "rollout/failed_episode_share": self.failed / episodes,
            "rollout/tool_token_share": self.tool_tokens / self.tokens if self.tokens else math.nan,
        }
