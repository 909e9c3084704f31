"""The lag bound and the ledger, without Ray: admission, stale drops, exactly-once accounting."""

import json

import pytest

from actors.buffer import Ledger, RolloutBuffer, ScoredGroup


def _group(group_id, version, rewards=(1.0,)):
    completions = [
        {"completion_ids": [1], "behaviour_logprobs": [-0.1], "text": "", "finish_reason": "stop", "reward": reward}
        for reward in rewards
    ]
    return ScoredGroup(group_id, f"p{group_id}", [5, 6], completions, version, version, 0)


def _issue(buffer, group_id, version):
    buffer.issue(group_id, f"p{group_id}", version, 0)


def test_synchronous_admission_waits_for_the_learner():
    buffer = RolloutBuffer(max_lag=0, prompts_per_step=2, stale_policy="wait", ledger=Ledger())
    assert buffer.can_issue(learner_version=0, learner_busy=False, generator_version=0)
    _issue(buffer, 0, 0)
    _issue(buffer, 1, 0)
    # two groups queued fill step 0: a third would be trained at version 1 with version-0 weights
    assert not buffer.can_issue(0, False, 0)
    # while the learner trains, nothing may be sampled with the old weights
    assert not buffer.can_issue(0, True, 0)
    # once weights v1 are on the generator and the learner has finished, sampling resumes
    buffer.add(_group(0, 0)), buffer.add(_group(1, 0))
    buffer.mark_trained(buffer.take(0), 0)
    assert buffer.can_issue(1, False, 1)


def test_one_step_lag_lets_generation_overlap_training():
    buffer = RolloutBuffer(max_lag=1, prompts_per_step=2, stale_policy="wait", ledger=Ledger())
    # the learner trains step v0; a pair sampled now with v0 weights is trained at v1: lag 1
    assert buffer.can_issue(0, True, 0)
    for gid in range(2):
        _issue(buffer, gid, 0)
    assert not buffer.can_issue(0, True, 0)  # the next pair would train at v2: lag 2
    assert buffer.can_issue(1, False, 1)  # ...unless it is sampled with the v1 weights


def test_take_drops_stale_groups_anywhere_in_the_queue_records_why_and_trains_the_oldest_first():
    ledger = Ledger()
    buffer = RolloutBuffer(max_lag=1, prompts_per_step=2, stale_policy="drop", ledger=ledger)
    for gid, version in [(0, 3), (1, 1), (2, 3), (3, 2)]:
        _issue(buffer, gid, version)
        buffer.add(_group(gid, version))
    batch = buffer.take(learner_version=3)
    # group 3 (lag 1) goes now: at the next step it would be stale; of the two at version 3, the first to arrive
    assert [g.group_id for g in batch] == [3, 0]
    assert ledger.entries[1].status == "dropped" and "lag 2 > max_lag 1" in ledger.entries[1].reason
    assert ledger.entries[2].status == "scored"  # lag 0: it waits for the next step
    buffer.mark_trained(batch, 3)
    assert ledger.entries[3].lag == 1 and ledger.entries[0].lag == 0 and ledger.entries[0].trained_step == 3


def test_under_wait_a_step_waits_for_a_group_in_flight_that_would_go_stale_after_it():
    """Two generators finish out of order: a group issued later arrives first. The step that is the older
    group's last chance waits for it instead of leaving it to go stale."""
    ledger = Ledger()
    buffer = RolloutBuffer(max_lag=1, prompts_per_step=1, stale_policy="wait", ledger=ledger)
    _issue(buffer, 0, 0)  # sampled with v0 on generator 0: trainable at v0 or v1
    _issue(buffer, 1, 1)  # sampled with v1 on generator 1, and back first
    buffer.add(_group(1, 1))
    assert buffer.take(learner_version=1) is None  # group 0 would be lag 2 at v2: this step is its last
    buffer.add(_group(0, 0))
    assert [g.group_id for g in buffer.take(learner_version=1)] == [0]
    assert [g.group_id for g in buffer.take(learner_version=2)] == [1]
    drop = RolloutBuffer(max_lag=1, prompts_per_step=1, stale_policy="drop", ledger=Ledger())
    _issue(drop, 0, 0)
    _issue(drop, 1, 1)
    drop.add(_group(1, 1))
    assert [g.group_id for g in drop.take(learner_version=1)] == [1]  # drop runs ahead and may lose group 0


def test_drop_policy_bounds_how_far_generators_run_ahead():
    buffer = RolloutBuffer(max_lag=0, prompts_per_step=2, stale_policy="drop", ledger=Ledger())
    issued = 0
    while buffer.can_issue(0, True, 0):
        _issue(buffer, issued, 0)
        issued += 1
    assert issued == 2 * (0 + 2)


def test_uniform_reward_groups_are_dropped_on_arrival_and_free_their_slot_for_another():
    ledger = Ledger()
    buffer = RolloutBuffer(max_lag=0, prompts_per_step=2, stale_policy="wait", ledger=ledger, drop_uniform_groups=True)
    _issue(buffer, 0, 0)
    _issue(buffer, 1, 0)
    assert not buffer.can_issue(0, False, 0)  # two in flight fill step 0
    assert buffer.add(_group(0, 0, [1.0, 1.0, 1.0])) is False
    assert ledger.entries[0].status == "dropped" and ledger.entries[0].reason == (
        "uniform rewards: all 3 responses scored 1, so every advantage is 0 (algorithm.drop_uniform_groups)"
    )
    assert buffer.can_issue(0, False, 0)  # the dropped group's slot goes to a new one
    _issue(buffer, 2, 0)
    assert buffer.add(_group(1, 0, [0.0, 1.0, 0.0])) is True
    assert buffer.add(_group(2, 0, [0.0, 0.0, 0.0])) is False
    assert [e.status for e in ledger.entries.values()] == ["dropped", "scored", "dropped"]
    assert "all 3 responses scored 0," in ledger.entries[2].reason
    assert buffer.uniform_in_a_row == 1  # group 1 broke the first streak
    assert buffer.take(0) is None and buffer.can_issue(0, False, 0)
    _issue(buffer, 3, 0)
    buffer.add(_group(3, 0, [0.5, 0.5, 0.25]))
    assert buffer.uniform_in_a_row == 0 and [g.group_id for g in buffer.take(0)] == [1, 3]


def test_uniform_reward_groups_are_kept_unless_asked():
    ledger = Ledger()
    buffer = RolloutBuffer(max_lag=0, prompts_per_step=1, stale_policy="wait", ledger=ledger)
    _issue(buffer, 0, 0)
    assert buffer.add(_group(0, 0, [1.0, 1.0])) is True
    assert [g.group_id for g in buffer.take(0)] == [0]


def _with_failed_episodes(group, failed):
    """The group with responses `failed` ended by a tool that hung: scored 0 with the episode's reason."""
    for index in failed:
        group.completions[index].update(
            reward=0.0,
            episode_error="tool calculator timed out after 5 s",
            score_error="episode failed: tool calculator timed out after 5 s",
        )
    return group


def test_episodes_that_failed_for_their_tools_sake_are_left_out_of_training_with_the_reason():
    """Group 0: one of three episodes hung, so the two others train and the ledger says why one is missing.
    Group 1: two of three failed, one is left, too few for a group advantage: dropped, with the reason."""
    ledger = Ledger()
    buffer = RolloutBuffer(max_lag=0, prompts_per_step=1, stale_policy="wait", ledger=ledger)
    _issue(buffer, 0, 0)
    _issue(buffer, 1, 0)
    assert buffer.add(_with_failed_episodes(_group(0, 0, [1.0, 0.1, 1.0]), [1]), score_errors=1) is True
    assert buffer.add(_with_failed_episodes(_group(1, 0, [1.0, 0.1, 0.1]), [1, 2]), score_errors=2) is False
    (trained,) = buffer.take(0)
    assert trained.rewards == [1.0, 1.0] and not any(c.get("episode_error") for c in trained.completions)
    assert ledger.entries[0].status == "scored" and ledger.entries[0].reason.startswith(
        "1 of 3 episodes failed for their tools' sake, not the policy's"
    )
    assert ledger.entries[0].sample_errors == ["episode failed: tool calculator timed out after 5 s"]
    assert ledger.entries[1].status == "dropped" and "too few responses left to train" in ledger.entries[1].reason
    assert "environment.train_failed_episodes: true" in ledger.entries[1].reason


def test_failed_episodes_train_at_reward_0_when_asked():
    ledger = Ledger()
    buffer = RolloutBuffer(
        max_lag=0, prompts_per_step=1, stale_policy="wait", ledger=ledger, train_failed_episodes=True
    )
    _issue(buffer, 0, 0)
    assert buffer.add(_with_failed_episodes(_group(0, 0, [1.0, 0.1, 1.0]), [1]), score_errors=1) is True
    assert buffer.take(0)[0].rewards == [1.0, 0.0, 1.0] and ledger.entries[0].reason is None


def test_ledger_refuses_double_training_and_unknown_groups(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.issued(7, "p7", 0, 0)
    ledger.scored(7)
    ledger.trained(7, step=1, lag=1)
    with pytest.raises(ValueError, match="already trained"):
        ledger.trained(7, step=2, lag=2)
    with pytest.raises(ValueError, match="never issued"):
        ledger.scored(8)
    with pytest.raises(ValueError, match="issued twice"):
        ledger.issued(7, "p7", 0, 0)
    ledger.close()
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["issued", "scored", "trained"]
    assert rows[-1]["lag"] == 1 and rows[-1]["trained_step"] == 1


def test_a_reissued_group_stays_in_flight_and_is_trained_once(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    buffer = RolloutBuffer(max_lag=1, prompts_per_step=1, stale_policy="wait", ledger=ledger)
    _issue(buffer, 3, 0)
    buffer.reissue(3, version=2, generator_index=1, reason="generator 0 died during generation")
    assert buffer.in_flight == 1 and ledger.unresolved() == [3]
    buffer.add(_group(3, 2))
    groups = buffer.take(learner_version=2)
    buffer.mark_trained(groups, 2)
    with pytest.raises(ValueError, match="already trained"):
        ledger.reissued(3, 2, 0, "too late")
    ledger.close()
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["issued", "reissued", "scored", "trained"]
    assert rows[1]["reason"] == "generator 0 died during generation" and rows[1]["generator_index"] == 1
    assert rows[-1]["reissues"] == 1 and rows[-1]["lag"] == 0


def test_negative_max_lag_is_rejected():
    with pytest.raises(ValueError, match="max_lag"):
        RolloutBuffer(max_lag=-1, prompts_per_step=1, stale_policy="wait", ledger=Ledger())


def test_skip_streak_counts_only_consecutive_skips():
    from cluster.run.faults import SkipStreak

    streak = SkipStreak(limit=3)
    assert [streak.record(s) for s in (True, True, False, True, True)] == [False] * 5
    assert streak.record(True) and streak.count == 3


def test_ledger_audit_names_every_kind_of_gap():
    from actors.buffer import audit_ledger

    rows = [{"event": "issued", "group_id": g} for g in (1, 2, 3, 4)]
    rows += [
        {"event": "trained", "group_id": 1},
        {"event": "dropped", "group_id": 2, "reason": ""},
        {"event": "trained", "group_id": 4},
        {"event": "dropped", "group_id": 4, "reason": "stale"},
        {"event": "trained", "group_id": 9},
    ]
    assert audit_ledger(rows) == [
        "group 2 dropped without a reason",
        "group 3 was issued but never trained or dropped",
        "group 4 ended 2 times: ['trained', 'dropped']",
        "group 9 ended but was never issued",
    ]
    assert audit_ledger(rows[:5]) == [
        "group 2 was issued but never trained or dropped",
        "group 3 was issued but never trained or dropped",
        "group 4 was issued but never trained or dropped",
    ]


def test_the_step_row_reports_the_responses_scored_since_the_last_one_with_each_options_keys():
    from cluster.job import validate_job
    from cluster.run.step_rows import ScoredSinceStep
    from tasks.environment import EpisodeStats

    scored = ScoredSinceStep(
        rewards=[1.0, 0.75, 0.0, 0.5], overlong_penalties=[0.0, -0.25, 0.0, -0.5], truncated=1, uniform_groups_dropped=3
    )
    plain = validate_job({"task": {"name": "arithmetic"}}).algorithm
    assert scored.metrics(plain) == {"rollout/truncated_share": 0.25, "rollout/score_errors": 0}
    both = validate_job(
        {
            "task": {"name": "arithmetic"},
            "generator": {"max_new_tokens": 16},
            "algorithm": {"drop_uniform_groups": True, "overlong_buffer_tokens": 4},
        }
    ).algorithm
    assert scored.metrics(both) == {
        "rollout/truncated_share": 0.25,
        "rollout/score_errors": 0,
        "rollout/scored_reward_mean": 0.5625,
        "rollout/uniform_groups_dropped": 3,
        "rollout/overlong_penalty_mean": -0.1875,
    }
    # nothing scored since the last row: no share or mean (never NaN), only the count of dropped groups
    assert ScoredSinceStep().metrics(both) == {"rollout/uniform_groups_dropped": 0}
    # a job with tools logs the episode keys whenever an episode was scored since the last row
    episode_keys = set(EpisodeStats().metrics())
    assert "rollout/tool_calls_mean" in episode_keys
    assert not episode_keys & set(ScoredSinceStep().metrics(plain, tool_episodes=True))
    assert not episode_keys & set(scored.metrics(plain))


def test_version_mix_counts_each_token_at_the_lag_of_the_version_that_sampled_it():
    from cluster.run.step_rows import version_mix

    def completion(spans):
        return {
            "completion_ids": [0] * spans[-1][2],
            "behaviour_logprobs": [],
            "text": "",
            "finish_reason": "stop",
            "version_spans": spans,
            "reward": 0.0,
            "score_error": None,
        }

    groups = [
        ScoredGroup(0, "p0", [], [completion([[3, 0, 4], [5, 4, 6]]), completion([[5, 0, 2]])], 3, 5, 0),
        ScoredGroup(1, "p1", [], [completion([[4, 0, 3]])], 4, 4, 0),
    ]
    mix = version_mix(groups, learner_version=5)
    assert mix["async/token_lag"] == [2 + 2, 3, 4]  # lag 0: 2 + 2 tokens of version 5; lag 1: 3; lag 2: 4
    assert mix["async/mixed_version_share"] == 1 / 3


def test_a_calls_groups_are_scored_in_one_call_of_the_scorer():
    """A reward model scores in batches: the driver hands it a generate call's groups together, not one group per
    wait (a wait of up to a minute each). Two groups of two responses: one score_many call of four."""
    from types import SimpleNamespace

    from actors.generator import GeneratedGroup, GenerationRequest
    from cluster.job import validate_job
    from cluster.run.faults import ScoreFailureStreak
    from cluster.run.loop import AsyncLoop
    from cluster.run.step_rows import ScoredSinceStep
    from cluster.run.stopping import StopRequest
    from tasks.base import Problem
    from tasks.scoring import ScoreResult

    class CountingScorer:
        def __init__(self):
            self.calls = []

        def score_many(self, problems, completions):
            self.calls.append(len(completions))
            return [ScoreResult(1.0 if text.endswith("2") else 0.0) for text in completions]

    ledger = Ledger()
    buffer = RolloutBuffer(max_lag=0, prompts_per_step=2, stale_policy="wait", ledger=ledger)
    loop = object.__new__(AsyncLoop)  # the scoring step alone: no Ray, no actors
    loop.job = validate_job({"task": {"name": "arithmetic"}})
    loop.scorer, loop.stop, loop.scored = CountingScorer(), StopRequest(), ScoredSinceStep()
    loop.score_failures = ScoreFailureStreak(limit=8, source="task 'arithmetic''s verifier")
    loop.schedule = SimpleNamespace(buffer=buffer, orphans=[])
    loop.problem_of = {gid: Problem(f"p{gid}", "1 + 1", "2") for gid in (0, 1)}
    groups = []
    for gid in (0, 1):
        _issue(buffer, gid, 0)
        groups.append(
            GeneratedGroup(
                gid,
                f"p{gid}",
                [5],
                [
                    {"completion_ids": [1], "behaviour_logprobs": [-0.1], "text": text, "finish_reason": "stop"}
                    for text in ("<answer>2</answer> 2", "<answer>3</answer> 3")
                ],
            )
        )
    loop._score_and_buffer(groups, [GenerationRequest(gid, f"p{gid}", [], 0) for gid in (0, 1)])
    assert loop.scorer.calls == [4]
    assert [g.rewards for g in buffer.take(0)] == [[1.0, 0.0], [1.0, 0.0]]
    assert loop.problem_of == {} and [e.status for e in ledger.entries.values()] == ["scored", "scored"]


def test_responses_whose_verifier_failed_are_left_out_of_training_with_the_first_reason():
    """A reward function that returned NaN for one response of three: the other two train, and the ledger says
    why the third is missing; a group with one response left is dropped (no group advantage from one)."""
    ledger = Ledger()
    buffer = RolloutBuffer(max_lag=0, prompts_per_step=1, stale_policy="wait", ledger=ledger)
    _issue(buffer, 0, 0)
    _issue(buffer, 1, 0)
    group = _group(0, 0, [1.0, 0.0, 0.5])
    group.completions[1].update(score_error="returned nan, not a finite number")
    assert buffer.add(group, score_errors=1) is True
    lone = _group(1, 0, [1.0, 0.0, 0.0])
    for index in (1, 2):
        lone.completions[index].update(score_error="returned None (NoneType), not a number")
    assert buffer.add(lone, score_errors=2) is False
    (trained,) = buffer.take(0)
    assert trained.rewards == [1.0, 0.5]
    assert ledger.entries[0].reason == (
        "1 of 3 responses failed to score (the first: returned nan, not a finite number): left out of training"
    )
    assert ledger.entries[1].status == "dropped" and ledger.entries[1].reason.startswith("2 of 3 responses failed")
