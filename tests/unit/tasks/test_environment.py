"""Multi-turn tool episodes (`tasks/environment.py`) driven by a scripted policy, with real tool workers.

The script stands in for the engine only: turns are the tokenizer's tokens of fixed texts, so what the
episode holds can be compared with the chat template's own rendering of the same conversation.
"""

from __future__ import annotations

import math
import textwrap

import pytest

from tasks.base import Problem, TaskError, build_task, tool_call_text
from tasks.config import ArithmeticConfig
from tasks.environment import (
    EnvironmentSpec,
    EpisodeBudget,
    EpisodeRunner,
    EpisodeStats,
    ToolChat,
    Turn,
    TurnRequest,
    environment_tools,
    score_responses,
)
from tasks.scoring import ScoreResult
from tasks.tools import ToolPool

SEED_STRIDE = 1009  # EpisodeRunner.turn_request: seed = episode seed * 1009 + turn
PROBLEM = Problem("p-0", "What is 3 + 5?", "8")
MESSAGES = [{"role": "user", "content": "What is 3 + 5? Reply with the final answer inside <answer></answer> tags."}]
CALL = tool_call_text("calculator", {"expression": "3 + 5"})


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2)


@pytest.fixture(scope="module")
def faulty_tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "faulty.py"
    path.write_text(
        textwrap.dedent('''
        import time

        def boom(x: int) -> str:
            """Raises."""
            raise ValueError("boom on purpose")

        def hang() -> str:
            """Never returns."""
            time.sleep(600)
            return "late"

        def spam() -> str:
            """Prints 10 MB."""
            print("x" * 10_000_000)
            return "done"
    ''')
    )
    return [f"{path}:boom", f"{path}:hang", f"{path}:spam"]


def scripted(tokenizer, scripts: list[list[str]], version: int = 3):
    """The engine: episode i's turn t is scripts[i][t], ended by the stop token; each call is recorded."""
    calls: list[list[TurnRequest]] = []

    def sample(requests: list[TurnRequest]) -> list[Turn]:
        calls.append(requests)
        turns = []
        for request in requests:
            episode, turn = divmod(request.seed, SEED_STRIDE)
            ids = tokenizer.encode(scripts[episode][turn], add_special_tokens=False)[: request.max_tokens]
            stopped = len(ids) < request.max_tokens
            ids = [*ids, tokenizer.eos_token_id] if stopped else ids
            turns.append(
                Turn(
                    ids,
                    [-1.0] * len(ids),
                    scripts[episode][turn],
                    "stop" if stopped else "length",
                    [[version, 0, len(ids)]],
                )
            )
        return turns

    return sample, calls


def runner(tokenizer, tools: list[str], max_turns: int = 4, max_new_tokens: int = 400, timeout_s: float = 5.0):
    spec = EnvironmentSpec(tuple(tools), max_turns=max_turns, tool_timeout_s=timeout_s, max_tool_output_chars=4096)
    pool = ToolPool(spec.tools, workers=2, timeout_s=timeout_s, max_output_chars=spec.max_tool_output_chars)
    chat = ToolChat(tokenizer, environment_tools(spec))
    return EpisodeRunner(spec, chat, pool.run_many, EpisodeBudget(max_new_tokens, 2048)), pool


def run(tokenizer, scripts, **options):
    episode_runner, pool = runner(tokenizer, options.pop("tools", ["calculator"]), **options)
    sample, calls = scripted(tokenizer, scripts)
    with pool:
        episodes = [episode_runner.start(PROBLEM, MESSAGES, i) for i in range(len(scripts))]
        episode_runner.run_batched(episodes, sample)
    return episodes, calls, episode_runner.chat


def tool_text(tokenizer, episode) -> str:
    return tokenizer.decode([t for t, m in zip(episode.completion_ids, episode.policy_mask) if not m])


def test_an_episode_holds_exactly_the_templates_conversation(tokenizer):
    [episode], calls, chat = run(tokenizer, [[CALL, "<answer>8</answer>"]])
    assert (episode.finish_reason, episode.turns, episode.tool_calls, episode.tool_errors) == ("stop", 2, 1, 0)
    conversation = [
        *chat.messages(MESSAGES),
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "8"},
        {"role": "assistant", "content": "<answer>8</answer>"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(episode.prompt_ids + episode.completion_ids) + "\n" == rendered
    assert tool_text(tokenizer, episode) == "\n<|im_start|>tool\n8<|im_end|>\n<|im_start|>assistant\n"
    assert "calculator" in tokenizer.decode(episode.prompt_ids)  # the tools are described to the model
    # only the policy's tokens carry log-probs and versions
    assert all(lp == 0.0 for lp, m in zip(episode.behaviour_logprobs, episode.policy_mask) if not m)
    assert all(lp == -1.0 for lp, m in zip(episode.behaviour_logprobs, episode.policy_mask) if m)
    covered = [i for _, start, end in episode.version_spans for i in range(start, end)]
    assert covered == [i for i, m in enumerate(episode.policy_mask) if m]
    assert [len(c) for c in calls] == [1, 1]  # one engine call per round of turns
    record = episode.record()
    assert record["text"] == f"{CALL}\n<answer>8</answer>" and record["turns"] == 2


def test_the_warm_up_demonstration_is_the_episode_the_policy_would_hold(tokenizer):
    task = build_task("arithmetic", ArithmeticConfig())
    demonstration = task.tool_demonstration(PROBLEM, frozenset({"calculator"}))
    [episode], _, chat = run(tokenizer, [[m["content"] for m in demonstration if m["role"] == "assistant"]])
    assert chat.demonstration(demonstration) == (episode.completion_ids, episode.policy_mask)


def test_malformed_calls_and_unknown_tools_are_told_to_the_model_and_counted(tokenizer):
    malformed = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    unknown = tool_call_text("abacus", {"beads": 3})
    [episode], _, _ = run(tokenizer, [[malformed, unknown, CALL, "<answer>8</answer>"]])
    assert (episode.finish_reason, episode.turns, episode.tool_calls, episode.tool_errors) == ("stop", 4, 2, 2)
    told = tool_text(tokenizer, episode)
    assert "not valid JSON" in told and "abacus" in told and "\n8<|im_end|>" in told


def test_max_turns_ends_the_episode_without_running_the_last_calls(tokenizer):
    [two], _, _ = run(tokenizer, [[CALL, CALL, CALL]], max_turns=2)
    assert (two.finish_reason, two.turns, two.tool_calls) == ("max_turns", 2, 1)
    [one], _, _ = run(tokenizer, [[CALL]], max_turns=1)
    assert (one.finish_reason, one.turns, one.tool_calls, sum(one.policy_mask)) == (
        "max_turns",
        1,
        0,
        len(one.completion_ids),
    )


def test_the_token_budget_covers_tool_results_too(tokenizer):
    call_tokens = len(tokenizer.encode(CALL, add_special_tokens=False)) + 1
    [episode], _, _ = run(tokenizer, [[CALL, "<answer>8</answer>"]], max_new_tokens=call_tokens + 3)
    assert episode.finish_reason == "length" and episode.turns == 1  # the tool's message would not fit
    assert len(episode.completion_ids) <= call_tokens + 3


def test_a_failing_tool_fails_its_episode_only(tokenizer, faulty_tools):
    scripts = [
        [tool_call_text("boom", {"x": 1})],
        [tool_call_text("hang", {})],
        [tool_call_text("spam", {})],
        [CALL, "<answer>8</answer>"],
    ]
    episodes, _, _ = run(tokenizer, scripts, tools=["calculator", *faulty_tools], timeout_s=2.0)
    boom, hang, spam, fine = episodes
    assert all(e.finish_reason == "tool_error" for e in (boom, hang, spam))
    assert "ValueError" in boom.error and "boom on purpose" in boom.error
    assert "2 s" in hang.error and "hang" in hang.error
    assert "spam" in spam.error and "4096" in spam.error
    assert (fine.finish_reason, fine.error, fine.tool_calls) == ("stop", None, 1)
    assert "policy_mask" in fine.record() and boom.record()["episode_error"] == boom.error


class _Verifier:
    """The task's verifier in process, recording what it was asked to score."""

    def __init__(self) -> None:
        self.task, self.asked = build_task("arithmetic", ArithmeticConfig()), []

    def score_many(self, problems, texts):
        self.asked += texts
        return [ScoreResult(self.task.score(p, t)) for p, t in zip(problems, texts)]


def test_failed_episodes_are_not_scored_and_carry_their_reason(tokenizer, faulty_tools):
    episodes, _, _ = run(
        tokenizer,
        [[CALL, "<answer>8</answer>"], [tool_call_text("boom", {"x": 1})]],
        tools=["calculator", *faulty_tools],
    )
    verifier = _Verifier()
    good, failed = score_responses(verifier, [PROBLEM] * 2, [e.record() for e in episodes])
    assert good == ScoreResult(1.0) and verifier.asked == [episodes[0].record()["text"]]
    assert failed.reward == 0.0 and failed.error.startswith("episode failed: ") and "boom" in failed.error
    stats = EpisodeStats()
    stats.add([e.record() for e in episodes])
    metrics = stats.metrics()
    assert metrics["rollout/turns_mean"] == 1.5 and metrics["rollout/tool_calls_mean"] == 1.0
    assert metrics["rollout/failed_episode_share"] == 0.5 and 0 < metrics["rollout/tool_token_share"] < 1
    nothing_scored = EpisodeStats().metrics()  # since the last step row: every key, NaN
    assert set(nothing_scored) == set(metrics) and all(math.isnan(v) for v in nothing_scored.values())


def test_an_unknown_tool_in_the_job_names_its_entry():
    with pytest.raises(TaskError, match=r"environment\.tools"):
        environment_tools(EnvironmentSpec(("no_such_file.py:tool",)))


def test_streaming_episodes_tool_calls_run_at_once_up_to_the_workers(tokenizer, tmp_path):
    """A streaming generator runs each episode on its own (`run_one`), its tools in a thread: two episodes'
    one-second calls on two tool workers end together, not one after the other."""
    import asyncio
    import time

    path = tmp_path / "nap.py"
    path.write_text(
        textwrap.dedent('''
        import time

        def nap(seconds: float) -> str:
            """Sleeps, then answers."""
            time.sleep(seconds)
            return "rested"
    ''')
    )
    episode_runner, pool = runner(tokenizer, [f"{path}:nap"])
    scripts = [[tool_call_text("nap", {"seconds": 1.0}), "<answer>8</answer>"]] * 2
    batched, _ = scripted(tokenizer, scripts)

    async def sample(request: TurnRequest) -> Turn:
        return batched([request])[0]

    async def both(episodes) -> None:
        await asyncio.gather(*(episode_runner.run_one(episode, sample) for episode in episodes))

    with pool:
        episodes = [episode_runner.start(PROBLEM, MESSAGES, i) for i in range(2)]
        started = time.monotonic()
        asyncio.run(both(episodes))
        took_s = time.monotonic() - started
    assert [(e.finish_reason, e.tool_calls, e.error) for e in episodes] == [("stop", 1, None)] * 2
    assert "rested" in tool_text(tokenizer, episodes[0])
    assert took_s < 1.8, f"two episodes' calls on two workers took {took_s:.2f} s: one after the other"
