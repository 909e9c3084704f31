"""`async.fixed_lag`: every group trains exactly K versions stale (the first K steps the initial policy's),
through the buffer and schedule the driver and the simulator share. Without Ray."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.buffer import FixedLag, FixedLagBatchLost, Ledger, RolloutBuffer, ScoredGroup
from tests.unit.cluster.test_schedule import FakeRun


def _group(group_id: int, version: int, failed: bool = False) -> ScoredGroup:
    completions = [
        {"completion_ids": [1], "behaviour_logprobs": [-0.1], "text": "", "finish_reason": "stop", "reward": 1.0}
        | ({"episode_error": "tool hung"} if failed else {})
        for _ in range(2)
    ]
    return ScoredGroup(group_id, f"p{group_id}", [5], completions, version, version, 0)  # type: ignore[arg-type]


def test_version_v_samples_step_v_plus_k_and_version_0_the_first_k_plus_1_steps():
    fixed = FixedLag(lag=3, prompts_per_step=2, steps=10)
    assert [fixed.sampling_version(step) for step in range(7)] == [0, 0, 0, 0, 1, 2, 3]
    assert [fixed.step_of(group_id) for group_id in range(6)] == [0, 0, 1, 1, 2, 2]
    assert fixed.may_issue(7, generator_version=0)  # step 3 is the last that version 0 samples
    assert not fixed.may_issue(8, generator_version=0) and fixed.may_issue(8, generator_version=1)
    assert not fixed.may_issue(8, generator_version=2)  # a later policy may not sample it either
    assert not fixed.may_issue(20, generator_version=7)  # step 10 is past the run: nobody samples it


def test_a_step_waits_until_the_groups_its_weights_owe_have_gone_out():
    """Step v's update replaces version v on the generators, so it starts only once step v + K's groups
    were sent with version v; and only when none of its own groups is still being sampled."""
    buffer = RolloutBuffer(2, 2, "wait", Ledger(), fixed_lag=FixedLag(2, 2, steps=10))
    for group_id in range(6):  # steps 0, 1, 2: all sampled by version 0
        buffer.issue(group_id, f"p{group_id}", 0, 0)
    buffer.add(_group(1, 0))
    assert buffer.take(0, next_group_id=6) is None  # group 0 is still being sampled
    buffer.add(_group(0, 0))
    assert buffer.take(0, next_group_id=5) is None  # group 5 (step 2) has not gone out
    assert [g.group_id for g in buffer.take(0, next_group_id=6)] == [1, 0]  # in arrival order
    buffer.add(_group(3, 0)), buffer.add(_group(2, 0))
    assert buffer.take(1, next_group_id=6) is None  # version 1 owes step 3's groups (6 and 7)
    assert [g.group_id for g in buffer.take(1, next_group_id=8)] == [3, 2]


def test_the_last_steps_owe_nothing_past_the_run():
    buffer = RolloutBuffer(4, 1, "wait", Ledger(), fixed_lag=FixedLag(4, 1, steps=3))
    for group_id in range(3):
        buffer.issue(group_id, f"p{group_id}", 0, 0)
        buffer.add(_group(group_id, 0))
    assert not buffer.can_issue(0, False, 0, next_group_id=3)  # step 3 would be past the run
    assert [[g.group_id for g in buffer.take(step, next_group_id=3)] for step in range(3)] == [[0], [1], [2]]


def test_a_step_trains_the_groups_left_and_says_so_when_none_is():
    ledger = Ledger()
    buffer = RolloutBuffer(0, 2, "wait", ledger, fixed_lag=FixedLag(0, 2))
    for group_id in range(4):
        buffer.issue(group_id, f"p{group_id}", 0 if group_id < 2 else 1, 0)
    buffer.add(_group(0, 0, failed=True)), buffer.add(_group(1, 0))
    assert [g.group_id for g in buffer.take(0, next_group_id=2)] == [1]
    assert ledger.entries[0].status == "dropped" and "tools' sake" in ledger.entries[0].reason
    buffer.add(_group(2, 1, failed=True)), buffer.add(_group(3, 1, failed=True))
    with pytest.raises(FixedLagBatchLost, match=r"step 2 .*environment\.train_failed_episodes"):
        buffer.take(1, next_group_id=4)


def test_a_fixed_lag_above_the_bound_is_refused():
    with pytest.raises(ValueError, match="max_lag 1"):
        RolloutBuffer(1, 2, "wait", Ledger(), fixed_lag=FixedLag(2, 2))


class FixedLagRun(FakeRun):
    def __init__(self, generators: int, lag: int, prompts_per_step: int, prompts_per_request: int, steps: int):
        super().__init__(generators, lag, prompts_per_step, prompts_per_request)
        self.schedule.buffer.fixed_lag = FixedLag(lag, prompts_per_step, steps)
        self.steps = steps


@settings(max_examples=150, deadline=None)
@given(
    orders=st.lists(st.integers(0, 1000), min_size=200, max_size=200),
    generators=st.integers(1, 3),
    lag=st.integers(0, 4),
    prompts_per_step=st.integers(1, 4),
    prompts_per_request=st.integers(1, 3),
)
def test_every_group_trains_exactly_k_versions_stale_in_any_completion_order(
    orders, generators, lag, prompts_per_step, prompts_per_request
):
    """Calls finish in any order and the learner takes any time; step t trains step t's groups, each
    sampled by version max(0, t - K), and the run never stalls. Nothing is sampled for a step past the run."""
    steps = 8
    run = FixedLagRun(generators, lag, prompts_per_step, prompts_per_request, steps)
    for pick in orders:
        if run.schedule.version == steps:
            break
        run.turn()
        busy, calls = run.schedule.learner_busy, run.schedule.calls
        assert busy or calls, "the schedule stalled"
        if busy and (not calls or pick % 3 == 0):
            run.finish_step()
        else:
            run.finish_call(pick)
    assert run.schedule.version == steps
    trained = sorted((e.trained_step, e.lag) for e in run.ledger.entries.values() if e.status == "trained")
    assert trained == sorted((t, min(t, lag)) for t in range(steps) for _ in range(prompts_per_step))
    assert run.trained_lags == [min(t, lag) for t in range(steps) for _ in range(prompts_per_step) for _ in range(2)]
    assert len(run.ledger.entries) == steps * prompts_per_step  # one step's worth sampled per step, none past the run
