"""A generator's reported seconds: overlapping calls count once, loads between calls add to busy time."""

import pytest

import actors.generator
from actors.generator import GeneratedGroup, ReportsTimings


@pytest.fixture
def now(monkeypatch):
    """A clock that moves only when the test says so: now[0] seconds."""
    reading = [0.0]
    monkeypatch.setattr(actors.generator, "clock", lambda: reading[0])
    return reading


def _group() -> GeneratedGroup:
    return GeneratedGroup(0, "p", [1])


def test_overlapping_calls_count_once_and_a_report_takes_what_ran_until_then(now):
    timings = ReportsTimings()
    with timings.calling():  # the first call, from t = 0
        now[0] = 2.0
        with timings.calling():  # a second call, from t = 2, at the same time
            now[0] = 5.0
            [first] = timings._report([_group()])  # it returns at t = 5 while the first runs on
        now[0] = 9.0
        [second] = timings._report([_group()])  # the first returns at t = 9
    assert (first.generate_s, first.busy_s) == (5.0, 5.0)  # not 5 + 3: overlapping seconds count once
    assert (second.generate_s, second.busy_s) == (4.0, 4.0)  # only what ran after the first report
    assert first.weight_loads == second.weight_loads == 0


def test_a_load_between_calls_is_busy_time_reported_once_with_the_next_call(now):
    timings = ReportsTimings()
    with timings.loading():
        now[0] = 1.5
    assert timings._report([]) == []  # a call without groups leaves the load for the next
    now[0] = 4.0  # idle
    with timings.calling():
        now[0] = 7.0
        [group] = timings._report([_group()])
    assert (group.weight_loads, group.weight_load_s, group.generate_s, group.busy_s) == (1, 1.5, 3.0, 4.5)
    with timings.calling():
        now[0] = 8.0
        [later] = timings._report([_group()])
    assert (later.weight_loads, later.weight_load_s, later.busy_s) == (0, 0.0, 1.0)


def test_a_load_during_a_call_is_busy_time_once(now):
    timings = ReportsTimings()
    with timings.calling():
        now[0] = 1.0
        with timings.loading():  # a streaming generator loads new weights while its call runs
            now[0] = 3.0
        now[0] = 4.0
        [group] = timings._report([_group()])
    assert (group.generate_s, group.busy_s, group.weight_load_s) == (4.0, 4.0, 2.0)
