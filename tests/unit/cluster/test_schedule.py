"""The loop's schedule with fake generators: random orders of completions, learner steps, generator deaths,
restarts, elastic joins and leaves, and resumes; every group ends exactly once and none trains past the lag
bound. Milliseconds per case, where whole runs on Ray take a minute for one order."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.buffer import Ledger, RolloutBuffer, ScoredGroup
from actors.generator import GeneratedGroup
from cluster.run.generators import GeneratorLost, GeneratorPool
from cluster.run.schedule import Call, Schedule


@dataclass(frozen=True)
class Request:
    group_id: int
    problem_id: str


class FakePool(GeneratorPool):
    """The generator pool with Ray's part taken out: a restarted generator is back at once."""

    def _wait_until_back(self, index: int, reason: str) -> None:
        self.waited.append(index)


class FakeRun:
    """A schedule and generator pool whose generate calls are numbers; the test decides what happens next, as
    Ray would. `elastic`: a generator that dies leaves (its node went away) instead of being restarted."""

    def __init__(
        self,
        generators: int,
        max_lag: int,
        prompts_per_step: int,
        prompts_per_request: int,
        stale_policy: str = "wait",
        elastic: bool = False,
        max_restarts: int = 1000,
        calls_per_generator: int = 1,
    ) -> None:
        self.ledger = Ledger()
        buffer = RolloutBuffer(max_lag, prompts_per_step, stale_policy, self.ledger)  # type: ignore[arg-type]
        self.handles = itertools.count()
        self.schedule: Schedule[Request, int] = Schedule(
            buffer,
            prompts_per_request,
            self._new_request,
            lambda call: next(self.handles),
            calls_per_generator=calls_per_generator,
        )
        for index in range(generators):
            self.schedule.join(index, 0)
        self.pool = FakePool(
            {index: f"actor-{index}" for index in range(generators)},
            self.schedule,
            start_generator=lambda index: f"actor-{index}",
            restore_weights=lambda index: self.schedule.version,
            nodes={},
            resource="generator",
            max_generators=8 if elastic else None,
            max_restarts=max_restarts,
        )
        self.pool.waited = []
        self.next_index = generators
        self.max_lag = max_lag
        self.trained_lags: list[int] = []

    @staticmethod
    def _new_request(group_id: int, generator_index: int) -> Request:
        return Request(group_id, f"problem-{group_id}")

    def turn(self) -> None:
        """The loop's turn before it waits: issue, then start a step if a batch is ready."""
        self.schedule.issue()
        self.schedule.take_batch()

    def finish_call(self, pick: int) -> None:
        handle = list(self.schedule.calls)[pick % len(self.schedule.calls)]
        call = self.schedule.finished(handle)
        for request in call.requests:
            completions = [{"reward": float(n)} for n in range(2)]
            self.schedule.buffer.add(
                ScoredGroup(
                    request.group_id,
                    request.problem_id,
                    [],
                    completions,
                    call.weights_version,
                    call.weights_version,
                    call.index,
                )
            )

    def finish_step(self) -> None:
        self.trained_lags += self.schedule.step_done()
        self.schedule.published()

    def kill(self, pick: int) -> None:
        """A generator dies during its call: Ray restarts it and it gets the latest weights, then its groups
        (an elastic member leaves instead, and its groups wait for another generator)."""
        handle = list(self.schedule.calls)[pick % len(self.schedule.calls)]
        call: Call[Request] = self.schedule.finished(handle)
        self.pool.failed(call, ConnectionError("killed"))  # type: ignore[arg-type]

    def leave(self, pick: int) -> None:
        """An elastic member's node goes away during its call: its groups wait for another generator."""
        handle = list(self.schedule.calls)[pick % len(self.schedule.calls)]
        call = self.schedule.finished(handle)
        self.schedule.leave(call.index, call.requests, f"generator {call.index} left during generation")

    def join(self) -> None:
        self.pool.actors[self.next_index] = f"actor-{self.next_index}"
        self.schedule.join(self.next_index, self.schedule.version)
        self.next_index += 1


EVENTS = st.lists(
    st.tuples(st.sampled_from(["call", "call", "call", "step", "kill", "leave", "join"]), st.integers(0, 1000)),
    min_size=1,
    max_size=120,
)


def play(run: FakeRun, events: list[tuple[str, int]]) -> None:
    """Apply each event that can happen now (a step that is not running, a call when none is out, a leave
    that would leave no generator are skipped), one loop turn before each."""
    for kind, pick in events:
        run.turn()
        calls = run.schedule.calls
        if kind == "call" and calls:
            run.finish_call(pick)
        elif kind == "step" and run.schedule.learner_busy:
            run.finish_step()
        elif kind == "kill" and calls and (not run.pool.elastic or len(run.schedule.members) > 1):
            run.kill(pick)
        elif kind == "leave" and calls and len(run.schedule.members) > 1:
            run.leave(pick)
        elif kind == "join" and len(run.schedule.members) < 6:
            run.join()


@settings(max_examples=150, deadline=None)
@given(
    events=EVENTS,
    generators=st.integers(1, 3),
    max_lag=st.integers(0, 3),
    prompts_per_step=st.integers(1, 4),
    prompts_per_request=st.integers(1, 3),
    stale_policy=st.sampled_from(["wait", "drop"]),
    elastic=st.booleans(),
    calls_per_generator=st.integers(1, 3),
)
def test_every_group_ends_exactly_once_and_none_trains_past_the_lag_bound(
    events, generators, max_lag, prompts_per_step, prompts_per_request, stale_policy, elastic, calls_per_generator
):
    """Streaming generators (several calls each) included."""
    run = FakeRun(
        generators,
        max_lag,
        prompts_per_step,
        prompts_per_request,
        stale_policy,
        elastic,
        calls_per_generator=calls_per_generator,
    )
    play(run, events)
    assert all(lag <= max_lag for lag in run.trained_lags), run.trained_lags
    assert all(lag >= 0 for lag in run.trained_lags)
    if run.schedule.learner_busy:  # the driver ends a run only between steps
        run.finish_step()
    run.schedule.end_unfinished("run finished")
    assert run.ledger.unresolved() == []
    for entry in run.ledger.entries.values():
        ends = [event for event in entry.history if event in ("trained", "dropped")]
        assert len(ends) == 1 and entry.history[-1] == ends[0], entry
    trained = [e for e in run.ledger.entries.values() if e.status == "trained"]
    assert all(e.lag is not None and e.lag <= max_lag for e in trained)
    if stale_policy == "wait":  # admission and the step's wait for stragglers keep every group trainable
        assert not any("stale" in (e.reason or "") for e in run.ledger.entries.values())


def test_a_step_waits_for_older_groups_in_flight_that_a_newer_one_would_push_past_the_bound():
    """Found by the property above: a streaming generator holds two version-0 groups when a new member samples a
    version-1 group that comes back first. A step on it would leave both old groups for the steps after, one
    each, and the second past max_lag 2; under `wait` the step waits for the first of them instead."""
    run = FakeRun(1, max_lag=2, prompts_per_step=1, prompts_per_request=1, calls_per_generator=2)
    play(run, [("call", 0), ("step", 0), ("join", 0), ("call", 80)])  # groups 1 and 2 in flight, group 3 back
    run.turn()
    assert run.schedule.training is None and [g.group_id for g in run.schedule.buffer.ready] == [3]
    play(run, [("call", 0)])  # group 1 back
    run.turn()
    assert run.schedule.training is not None and [g.group_id for g in run.schedule.training] == [1]
    play(run, [("call", 0), ("step", 0), ("step", 0), ("step", 0)])
    assert run.trained_lags == [0, 0, 1, 1, 2, 2, 2, 2]  # groups 0, 1, 2 and 3 in turn, two responses each
    assert not any("stale" in (e.reason or "") for e in run.ledger.entries.values())


@settings(max_examples=100, deadline=None)
@given(events=EVENTS, generators=st.integers(1, 3), max_lag=st.integers(0, 2))
def test_a_call_samples_with_the_weights_its_generator_held_when_it_was_sent(events, generators, max_lag):
    """Each call carries its member's version at send time; no generator ever holds a version the learner
    has not reached, and a new member starts from the latest."""
    run = FakeRun(generators, max_lag, prompts_per_step=2, prompts_per_request=2)
    for kind, pick in events:
        play(run, [(kind, pick)])
        for call in run.schedule.calls.values():
            assert call.weights_version <= run.schedule.version
        for member in run.schedule.members.values():
            assert member.weights_version <= run.schedule.version


def test_a_generator_is_sent_one_call_at_a_time_and_idle_ones_get_work():
    run = FakeRun(generators=3, max_lag=4, prompts_per_step=2, prompts_per_request=2)
    run.turn()
    assert sorted(call.index for call in run.schedule.calls.values()) == [0, 1, 2]
    run.turn()  # nothing is idle: nothing new goes out
    assert len(run.schedule.calls) == 3
    run.finish_call(0)
    run.turn()
    assert sorted(call.index for call in run.schedule.calls.values()) == [0, 1, 2]


def test_orphans_go_first_to_the_next_idle_generator_and_the_ledger_says_why():
    run = FakeRun(generators=2, max_lag=4, prompts_per_step=8, prompts_per_request=2)
    run.turn()
    left = run.schedule.calls[0]
    run.leave(0)
    assert [r for r, _ in run.schedule.orphans] == left.requests and 0 not in run.schedule.members
    run.finish_call(0)  # generator 1 comes back free
    run.turn()
    [call] = run.schedule.calls.values()
    assert call.index == 1 and call.requests == left.requests
    entry = run.ledger.entries[left.requests[0].group_id]
    assert entry.reissues == 1 and entry.generator_index == 1 and "left during generation" in entry.reason


def test_lag_zero_waits_for_the_step_and_the_publish_before_issuing_again():
    """max_lag 0 is synchronous: once a batch is out, nothing more is issued until its step ends and the
    generators hold the new weights."""
    run = FakeRun(generators=1, max_lag=0, prompts_per_step=2, prompts_per_request=2)
    run.turn()
    run.finish_call(0)
    run.turn()
    assert run.schedule.learner_busy and not run.schedule.calls
    run.finish_step()
    run.turn()
    [call] = run.schedule.calls.values()
    assert call.weights_version == 1


def test_a_skipped_step_drops_its_groups_with_the_reason_and_still_moves_the_version():
    run = FakeRun(generators=1, max_lag=1, prompts_per_step=1, prompts_per_request=1)
    run.turn()
    run.finish_call(0)
    run.turn()
    [group] = run.schedule.training
    assert run.schedule.step_done("step 1 skipped: non-finite loss") == [0, 0]  # its two responses
    entry = run.ledger.entries[group.group_id]
    assert entry.status == "dropped" and entry.reason == "step 1 skipped: non-finite loss"
    assert run.schedule.version == 1 and not run.schedule.learner_busy


def test_resumed_requests_go_out_a_request_at_a_time_round_the_members():
    """What a checkpoint held in flight is issued again on resume: counted in flight, spread in order."""
    ledger = Ledger()
    buffer = RolloutBuffer(1, 4, "wait", ledger)
    for group_id in range(5):
        ledger.issued(group_id, f"p{group_id}", 0, 0)
    schedule: Schedule[Request, int] = Schedule(buffer, 2, FakeRun._new_request, lambda call: len(schedule.calls))
    schedule.join(0, 3)
    schedule.join(1, 3)
    schedule.resume([Request(g, f"p{g}") for g in range(5)], "resumed from the checkpoint at step 3")
    assert [(c.index, [r.group_id for r in c.requests]) for c in schedule.calls.values()] == [
        (0, [0, 1]),
        (1, [2, 3]),
        (0, [4]),
    ]
    assert buffer.in_flight == 5
    assert all(ledger.entries[g].reissues == 1 for g in range(5))


@pytest.mark.parametrize("stale_policy", ["wait", "drop"])
def test_a_run_of_fake_generators_trains_every_step(stale_policy):
    """Completions in send order, a step whenever one is ready: the run never stalls and reaches step 20."""
    run = FakeRun(generators=3, max_lag=1, prompts_per_step=4, prompts_per_request=2, stale_policy=stale_policy)
    for _ in range(1000):
        run.turn()
        if run.schedule.learner_busy:
            run.finish_step()
        elif run.schedule.calls:
            run.finish_call(0)
        else:
            pytest.fail("nothing to wait for")
        if run.schedule.version == 20:
            break
    assert run.schedule.version == 20


def _groups(call: Call[Request], version: int, incarnation: str) -> list[GeneratedGroup]:
    return [
        GeneratedGroup(
            r.group_id,
            r.problem_id,
            [],
            version_start=version,
            version_end=version,
            generator_index=call.index,
            incarnation=incarnation,
        )
        for r in call.requests
    ]


def test_a_generator_that_dies_is_waited_for_given_the_latest_weights_and_its_groups_again():
    run = FakeRun(generators=2, max_lag=2, prompts_per_step=2, prompts_per_request=2)
    run.turn()
    run.finish_call(0)
    run.turn()
    run.finish_step()  # version 1 published
    dying = next(call for call in run.schedule.calls.values() if call.index == 1)
    run.kill(list(run.schedule.calls.values()).index(dying))
    assert run.pool.waited == [1] and run.schedule.members[1].restarts == 1
    assert run.schedule.members[1].weights_version == 1
    [again] = [call for call in run.schedule.calls.values() if call.index == 1]
    assert again.requests == dying.requests and again.weights_version == 1
    entry = run.ledger.entries[dying.requests[0].group_id]
    assert entry.reissues == 1 and entry.reason == "generator 1 died during generation"


def test_a_generator_that_dies_more_often_than_max_restarts_fails_the_job_naming_the_setting():
    run = FakeRun(generators=1, max_lag=1, prompts_per_step=2, prompts_per_request=1, max_restarts=1)
    run.turn()
    run.kill(0)
    with pytest.raises(GeneratorLost, match=r"died 2 times, more than generator.max_restarts = 1"):
        run.kill(0)


def test_a_restart_between_calls_shows_in_the_next_result_and_stale_samples_go_out_again():
    """Ray restarts an idle generator with its initial weights; only its next result's incarnation tells. If
    that call sampled with older weights than it was sent with, its groups are issued again."""
    run = FakeRun(generators=1, max_lag=2, prompts_per_step=2, prompts_per_request=1)
    run.turn()
    first = run.schedule.finished(next(iter(run.schedule.calls)))
    assert not run.pool.sampled_before_restart(first, _groups(first, 0, "process-a"))  # learnt, nothing else
    assert run.schedule.members[0].incarnation == "process-a"
    run.schedule.version = 1
    run.schedule.published()
    run.turn()
    second = run.schedule.finished(next(iter(run.schedule.calls)))  # its result is back, as the loop takes it
    assert run.pool.sampled_before_restart(second, _groups(second, 0, "process-b"))  # version 0 < sent with 1
    assert run.schedule.members[0].restarts == 1 and run.pool.waited == [0]
    [reissued] = run.schedule.calls.values()
    assert reissued.requests == second.requests
    fresh = run.schedule.finished(next(iter(run.schedule.calls)))
    assert not run.pool.sampled_before_restart(fresh, _groups(fresh, 1, "process-b"))
    assert run.schedule.members[0].incarnation == "process-b" and run.schedule.members[0].restarts == 1


def test_an_elastic_member_that_dies_leaves_and_its_restarts_still_count():
    run = FakeRun(generators=2, max_lag=2, prompts_per_step=4, prompts_per_request=2, elastic=True)
    run.turn()
    run.schedule.members[0].restarts = 2  # from restarts between calls earlier
    run.kill(0)
    assert 0 not in run.schedule.members and 0 not in run.pool.actors and run.pool.left == 1
    assert len(run.schedule.orphans) == 2 and run.schedule.generator_restarts == 2 and run.pool.waited == []


def test_a_streaming_generator_gets_calls_up_to_its_room_while_the_buffer_admits():
    run = FakeRun(generators=2, max_lag=8, prompts_per_step=4, prompts_per_request=1, calls_per_generator=3)
    run.turn()
    assert sorted(call.index for call in run.schedule.calls.values()) == [0, 0, 0, 1, 1, 1]
    run.finish_call(0)
    run.turn()
    assert [run.schedule.calls_of(index) for index in (0, 1)] == [3, 3]
    tight = FakeRun(generators=1, max_lag=0, prompts_per_step=2, prompts_per_request=1, calls_per_generator=3)
    tight.turn()  # max_lag 0: the lag bound admits one step's worth, whatever the room
    assert len(tight.schedule.calls) == 2


@pytest.mark.parametrize("elastic", [False, True])
def test_one_death_of_a_streaming_generator_fails_all_its_calls_and_counts_once(elastic):
    """A streaming generator dies with two calls in flight: both fail. It is restarted (or leaves) once, and
    the groups of both calls go out again."""
    run = FakeRun(
        generators=2,
        max_lag=4,
        prompts_per_step=8,
        prompts_per_request=1,
        elastic=elastic,
        max_restarts=1,
        calls_per_generator=2,
    )
    run.turn()
    dying = [handle for handle, call in run.schedule.calls.items() if call.index == 0]
    groups = [r.group_id for handle in dying for r in run.schedule.calls[handle].requests]
    for handle in dying:
        run.pool.failed(run.schedule.finished(handle), ConnectionError("killed"))  # type: ignore[arg-type]
    if elastic:
        assert run.pool.left == 1 and sorted(r.group_id for r, _ in run.schedule.orphans) == sorted(groups)
    else:
        assert run.schedule.members[0].restarts == 1 and run.pool.waited == [0]
        again = [r.group_id for call in run.schedule.calls.values() if call.index == 0 for r in call.requests]
        assert sorted(again) == sorted(groups)
    assert all(run.ledger.entries[g].reissues == (0 if elastic else 1) for g in groups)
