"""The rollout buffer: version-tagged groups, a lag bound, admission control and a ledger.

Lag of a group at train time = learner version - the version its responses were sampled with.
`wait` (default) throttles generation so no group can exceed `max_lag`, and trains the oldest groups
first: generators finish out of order, so a step that is the last chance of a group still being sampled
waits for it; `drop` lets generators run ahead and drops groups that went stale, recording why. With
`drop_uniform_groups` (DAPO's dynamic sampling) a group whose responses all scored the same is dropped on
arrival, and the generators sample another in its place. An episode that failed for its tools' sake (one
raised, hung, ran out of memory, printed too much) is left out of training unless `train_failed_episodes`:
its reward says nothing of the policy's answer; so is a response whose verifier failed (raised, hung, or
returned no finite number). Either way the ledger accounts for every prompt group:
issued, scored, trained (at which step) or dropped (with a reason).

`fixed_lag` (`FixedLag`) replaces the bound by an exact lag, as the M2PO paper's experiments set it.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from algorithms.errors import StableAsyncError
from learner.records import TrainingSample
from tasks.records import ScoredCompletion


@dataclass
class ScoredGroup:
    """A prompt group with its responses, rewards and version tags, ready to train on."""

    group_id: int
    problem_id: str
    prompt_ids: list[int]
    completions: list[ScoredCompletion]
    version_start: int
    version_end: int
    generator_index: int
    question: str = ""  # the problem as the user wrote it, for the rollout samples a person reads
    answer: str = ""  # its reference answer

    @property
    def rewards(self) -> list[float]:
        return [c["reward"] for c in self.completions]

    @property
    def uniform_rewards(self) -> bool:
        """Whether every response scored the same (all solved, or all failed). Each group-relative advantage
        (GRPO, Dr.GRPO, RLOO, group-mean REINFORCE, VCPO's baseline) is then 0: the group adds tokens to the
        loss's denominator and no learning signal."""
        return max(self.rewards) == min(self.rewards)

    def samples(self) -> list[TrainingSample]:
        """One training sample per response (the learner's collate input)."""
        samples = []
        for c in self.completions:
            sample = TrainingSample(
                prompt_ids=self.prompt_ids,
                completion_ids=c["completion_ids"],
                behaviour_logprobs=c["behaviour_logprobs"],
                reward=c["reward"],
                group_id=self.group_id,
                version=self.version_start,
            )
            if "policy_mask" in c:
                sample["policy_mask"] = c["policy_mask"]
            samples.append(sample)
        return samples


@dataclass
class LedgerEntry:
    group_id: int
    problem_id: str
    issued_version: int
    generator_index: int
    status: Literal["issued", "scored", "trained", "dropped"] = "issued"
    trained_step: int | None = None
    lag: int | None = None  # trained_step minus the oldest sampled version
    sampled_versions: list[int] | None = None  # [oldest, newest] policy version that sampled the group's tokens
    reason: str | None = None
    score_errors: int = 0
    # why samples failed (a verifier's error, or an episode's tool that raised, hung or printed too much), distinct
    sample_errors: list[str] | None = None
    reissues: int = 0
    history: list[str] = field(default_factory=list)


class Ledger:
    """Every prompt group's fate, appended to a JSONL file as it happens."""

    def __init__(self, path: Path | None = None) -> None:
        self.entries: dict[int, LedgerEntry] = {}
        self.path = path
        self.lines = 0  # events written: a checkpoint records it, a resume cuts the file back to it
        self._file = path.open("a") if path is not None else None

    @classmethod
    def resume(cls, path: Path, lines: int) -> Ledger:
        """The ledger as it was after its first `lines` events; later events move to a side file."""
        kept = keep_first_lines(path, lines)
        ledger = cls(path)
        fields = set(LedgerEntry.__dataclass_fields__) - {"history"}
        for line in kept:  # each row holds the whole entry after its event
            row = json.loads(line)
            entry = LedgerEntry(**{name: row[name] for name in fields & set(row)})
            previous = ledger.entries.get(entry.group_id)
            entry.history = (previous.history if previous else []) + [row["event"]]
            ledger.entries[entry.group_id] = entry
        ledger.lines = len(kept)
        return ledger

    def issued(self, group_id: int, problem_id: str, version: int, generator_index: int) -> None:
        if group_id in self.entries:
            raise ValueError(f"group {group_id} issued twice")
        self.entries[group_id] = LedgerEntry(group_id, problem_id, version, generator_index)
        self._record(group_id, "issued")

    def reissued(self, group_id: int, version: int, generator_index: int, reason: str) -> None:
        """An in-flight group whose generator failed is sent again (same group, fresh samples)."""
        entry = self.entries.get(group_id)
        reissues = entry.reissues + 1 if entry is not None else 0
        self._move(
            group_id,
            "issued",
            ("issued",),
            issued_version=version,
            generator_index=generator_index,
            reason=reason,
            reissues=reissues,
            event="reissued",
        )

    def scored(
        self, group_id: int, score_errors: int = 0, sample_errors: list[str] | None = None, reason: str | None = None
    ) -> None:
        self._move(
            group_id,
            "scored",
            ("issued",),
            score_errors=score_errors,
            sample_errors=list(dict.fromkeys(sample_errors)) if sample_errors else None,
            reason=reason,
        )

    def trained(self, group_id: int, step: int, lag: int, sampled_versions: list[int] | None = None) -> None:
        self._move(group_id, "trained", ("scored",), trained_step=step, lag=lag, sampled_versions=sampled_versions)

    def dropped(self, group_id: int, reason: str) -> None:
        self._move(group_id, "dropped", ("issued", "scored"), reason=reason)

    def counts(self) -> dict[str, int]:
        return dict(Counter(entry.status for entry in self.entries.values()))

    def unresolved(self) -> list[int]:
        """Groups neither trained nor dropped (in flight or buffered)."""
        return [gid for gid, e in self.entries.items() if e.status in ("issued", "scored")]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _move(self, group_id: int, status: str, frm: tuple[str, ...], event: str | None = None, **fields: Any) -> None:
        """Change a group's status (only along the allowed transitions), then record the event."""
        entry = self.entries.get(group_id)
        if entry is None:
            raise ValueError(f"group {group_id} was never issued")
        if entry.status not in frm:
            raise ValueError(f"group {group_id} cannot become {status}: it is already {entry.status}")
        entry.status = status  # type: ignore[assignment]
        for name, value in fields.items():
            setattr(entry, name, value)
        self._record(group_id, event or status)

    def _record(self, group_id: int, event: str) -> None:
        entry = self.entries[group_id]
        entry.history.append(event)
        if self._file is not None:
            row = {k: v for k, v in asdict(entry).items() if k != "history"}
            self._file.write(json.dumps({"event": event, **row}) + "\n")
            self._file.flush()
        self.lines += 1


def audit_ledger(rows: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a finished run's ledger events: a group that never ended, ended twice, or was
    dropped without a reason. Empty when every issued group was trained or dropped exactly once."""
    issued = {row["group_id"] for row in rows if row["event"] == "issued"}
    ends: dict[int, list[str]] = {}
    problems = []
    for row in rows:
        if row["event"] in ("trained", "dropped"):
            ends.setdefault(row["group_id"], []).append(row["event"])
            if row["event"] == "dropped" and not row.get("reason"):
                problems.append(f"group {row['group_id']} dropped without a reason")
    problems += [f"group {gid} was issued but never trained or dropped" for gid in sorted(issued - set(ends))]
    problems += [f"group {gid} ended {len(e)} times: {e}" for gid, e in sorted(ends.items()) if len(e) > 1]
    problems += [f"group {gid} ended but was never issued" for gid in sorted(set(ends) - issued)]
    return problems


def keep_first_lines(path: Path, lines: int) -> list[str]:
    """Cut a JSONL file back to its first `lines` lines; the rest go to `<name>.after-<lines>.jsonl`."""
    text = path.read_text().splitlines() if path.exists() else []
    if len(text) < lines:
        raise ValueError(f"{path} has {len(text)} lines, fewer than the {lines} the checkpoint recorded")
    kept, later = text[:lines], text[lines:]
    if later:
        path.with_name(f"{path.stem}.after-{lines}.jsonl").write_text("\n".join(later) + "\n")
    path.write_text("".join(line + "\n" for line in kept))
    return kept


@dataclass(frozen=True)
class FixedLag:
    """`async.fixed_lag`: step t trains the groups that policy version max(0, t - lag) sampled, so every group
    from step `lag` on trains exactly `lag` versions stale (steps 0 to `lag` train the initial policy's).

    Group ids are issued in order, a step's worth at a time: group g belongs to step g // prompts_per_step.
    Generation stays one step's worth per learner step, queued `lag` steps deep, with no model snapshot:
    version v samples step v + lag's groups (version 0 those of steps 0 to lag), and step v does not start
    before they have all gone out, since its update replaces version v on the generators. A group sampled
    again after its generator failed, or after a resume, takes the weights of that moment; the ledger shows
    its true lag.
    """

    lag: int
    prompts_per_step: int
    steps: int | None = None  # the run's length: no group is sampled for a step past it

    def step_of(self, group_id: int) -> int:
        return group_id // self.prompts_per_step

    def sampling_version(self, step: int) -> int:
        return max(0, step - self.lag)

    def may_issue(self, group_id: int, generator_version: int) -> bool:
        step = self.step_of(group_id)
        return (self.steps is None or step < self.steps) and generator_version == self.sampling_version(step)

    def owed_groups_issued(self, learner_version: int, next_group_id: int) -> bool:
        """Whether every group that `learner_version` samples has gone out (so the step may replace it)."""
        owed = learner_version + self.lag
        return (self.steps is not None and owed >= self.steps) or next_group_id >= (owed + 1) * self.prompts_per_step


def _why_left_out(failed: list[ScoredCompletion], responses: int) -> str:
    """The ledger's reason for the responses of a group left out of training."""
    episodes = sum(bool(c.get("episode_error")) for c in failed)
    reasons = []
    if episodes:
        reasons.append(
            f"{episodes} of {responses} episodes failed for their tools' sake, not the policy's "
            "(environment.train_failed_episodes: true trains them at reward 0)"
        )
    if len(failed) > episodes:
        first = next(c.get("score_error") for c in failed if not c.get("episode_error"))
        reasons.append(f"{len(failed) - episodes} of {responses} responses failed to score (the first: {first})")
    return "; ".join(reasons)


class FixedLagBatchLost(StableAsyncError, RuntimeError):
    """Under `async.fixed_lag`, every group of a step was dropped, and no later policy may sample them again."""


class RolloutBuffer:
    """FIFO of scored groups with lag-bounded admission.

    `can_issue` answers whether a new group sampled now (with the generator's weights version) would
    still be trainable when its turn comes: it is trained by the step that follows the groups ahead of
    it, at version `learner_version + busy + queued // prompts_per_step`.
    """

    def __init__(
        self,
        max_lag: int,
        prompts_per_step: int,
        stale_policy: Literal["wait", "drop"],
        ledger: Ledger,
        drop_uniform_groups: bool = False,
        train_failed_episodes: bool = False,
        fixed_lag: FixedLag | None = None,
    ) -> None:
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        if fixed_lag is not None and (fixed_lag.lag > max_lag or fixed_lag.prompts_per_step != prompts_per_step):
            raise ValueError(f"{fixed_lag} does not fit max_lag {max_lag} and {prompts_per_step} prompts per step")
        self.max_lag, self.prompts_per_step, self.stale_policy = max_lag, prompts_per_step, stale_policy
        self.ledger = ledger
        self.drop_uniform_groups = drop_uniform_groups
        self.train_failed_episodes = train_failed_episodes
        self.fixed_lag = fixed_lag
        self.ready: deque[ScoredGroup] = deque()
        self.in_flight_versions: dict[int, int] = {}  # group id -> the version it is being sampled with
        self.uniform_in_a_row = 0  # arrivals with uniform rewards since the last group kept

    @property
    def in_flight(self) -> int:
        """Groups issued (or issued again) and not yet back."""
        return len(self.in_flight_versions)

    def can_issue(
        self, learner_version: int, learner_busy: bool, generator_version: int, next_group_id: int = 0
    ) -> bool:
        """Whether a generator at `generator_version` may start one more group now (with a fixed lag: the
        group `next_group_id`)."""
        if self.fixed_lag is not None:
            return self.fixed_lag.may_issue(next_group_id, generator_version)
        queued = len(self.ready) + self.in_flight
        train_version = learner_version + int(learner_busy) + queued // self.prompts_per_step
        if self.stale_policy == "wait":
            return train_version - generator_version <= self.max_lag
        # drop: run ahead, but never hold more than the lag window could ever train
        return queued < self.prompts_per_step * (self.max_lag + 2)

    def _left_out(self, completion: ScoredCompletion) -> bool:
        """A response whose reward is no verdict on the policy: its verifier failed (the reward is a stand-in
        0), or its episode failed for a tool's sake (trained at 0 only with `train_failed_episodes`)."""
        if completion.get("episode_error"):
            return not self.train_failed_episodes
        return completion.get("score_error") is not None

    def issue(self, group_id: int, problem_id: str, version: int, generator_index: int) -> None:
        self.ledger.issued(group_id, problem_id, version, generator_index)
        self.in_flight_versions[group_id] = version

    def add(self, group: ScoredGroup, score_errors: int = 0) -> bool:
        """A generated and scored group arrives; with `drop_uniform_groups`, one with uniform rewards ends here.
        Returns whether the group was kept to train on."""
        self.in_flight_versions.pop(group.group_id, None)
        errors = [error for c in group.completions if (error := c.get("score_error"))]
        failed = [c for c in group.completions if self._left_out(c)]
        if failed:
            kept = [c for c in group.completions if not self._left_out(c)]
            why = _why_left_out(failed, len(group.completions))
            if len(kept) < min(2, len(group.completions)):  # a group-relative advantage needs two responses
                self.ledger.scored(group.group_id, score_errors, errors)
                self.ledger.dropped(group.group_id, f"{why}; too few responses left to train")
                return False
            self.ledger.scored(group.group_id, score_errors, errors, reason=f"{why}: left out of training")
            group = replace(group, completions=kept)
        else:
            self.ledger.scored(group.group_id, score_errors, errors)
        if self.drop_uniform_groups and group.uniform_rewards:
            self.uniform_in_a_row += 1
            self.ledger.dropped(
                group.group_id,
                f"uniform rewards: all {len(group.completions)} responses scored "
                f"{group.rewards[0]:g}, so every advantage is 0 (algorithm.drop_uniform_groups)",
            )
            return False
        self.uniform_in_a_row = 0
        self.ready.append(group)
        return True

    def reissue(self, group_id: int, version: int, generator_index: int, reason: str) -> None:
        """An in-flight group goes out again (its generator failed, or the run resumed): in flight with
        `version`."""
        self.ledger.reissued(group_id, version, generator_index, reason)
        self.in_flight_versions[group_id] = version

    def lost(self, group_id: int, reason: str) -> None:
        """A group that will never arrive (the run ended before it did)."""
        self.in_flight_versions.pop(group_id, None)
        self.ledger.dropped(group_id, reason)

    def take(self, learner_version: int, next_group_id: int = 0) -> list[ScoredGroup] | None:
        """The next `prompts_per_step` groups within the lag bound, oldest policy version first, or None if
        not enough yet.

        Generators finish out of order, so groups issued later can arrive before older ones still being
        sampled. Under `wait` a step does not start while a group in flight would be past the lag bound at
        the step after it: that group is trained by this step instead of going stale. Stale groups met on
        the way (under `drop`, or weights not delivered in time) are dropped and recorded.
        With a fixed lag: the step's own groups (`next_group_id`: the next new group's id), see `FixedLag`.
        """
        if self.fixed_lag is not None:
            return self._take_step(learner_version, self.fixed_lag, next_group_id)
        fresh: deque[ScoredGroup] = deque()
        for group in self.ready:  # generators finish out of order: a stale group may sit anywhere
            lag = learner_version - group.version_start
            if lag > self.max_lag:
                self.ledger.dropped(group.group_id, f"stale: lag {lag} > max_lag {self.max_lag}")
            else:
                fresh.append(group)
        self.ready = deque(sorted(fresh, key=lambda group: group.version_start))  # stable: arrival order within
        if len(self.ready) < self.prompts_per_step or self._straggler_due(learner_version):
            return None
        return [self.ready.popleft() for _ in range(self.prompts_per_step)]

    def _take_step(self, step: int, fixed: FixedLag, next_group_id: int) -> list[ScoredGroup] | None:
        """Step `step`'s groups, once none of them is in flight and the groups its weights owe have gone out;
        those dropped on arrival (failed episodes) leave it smaller."""
        if not fixed.owed_groups_issued(step, next_group_id):
            return None
        if any(fixed.step_of(group_id) == step for group_id in self.in_flight_versions):
            return None
        batch = [group for group in self.ready if fixed.step_of(group.group_id) == step]
        if not batch:
            raise FixedLagBatchLost(
                f"step {step + 1} has no prompt group left to train: all {self.prompts_per_step} were dropped "
                f"(the ledger says why), and async.fixed_lag {fixed.lag} cannot sample them again with version "
                f"{fixed.sampling_version(step)}; environment.train_failed_episodes: true keeps failed episodes"
            )
        self.ready = deque(group for group in self.ready if fixed.step_of(group.group_id) != step)
        return batch

    def _straggler_due(self, learner_version: int) -> bool:
        """Under `wait`: whether a step started now would leave a group still in flight past the lag bound. The
        steps after it take the oldest groups first, `prompts_per_step` each, so the k-th oldest group left (ready
        or in flight) trains k // prompts_per_step steps after the next; a group in flight that would miss the
        bound there, and could still make it if it arrived for this step, is waited for."""
        if self.stale_policy != "wait" or not self.in_flight_versions:
            return False
        left_ready = [(group.version_start, False) for group in list(self.ready)[self.prompts_per_step :]]
        left = sorted(left_ready + [(version, True) for version in self.in_flight_versions.values()])
        for position, (version, in_flight) in enumerate(left):
            trained_at = learner_version + 1 + position // self.prompts_per_step
            if in_flight and trained_at - version > self.max_lag >= learner_version - version:
                return True
        return False

    def mark_trained(self, groups: list[ScoredGroup], step_version: int) -> None:
        """`step_version`: the learner version the step trained at (its groups' lag is measured there)."""
        for group in groups:
            self.ledger.trained(
                group.group_id,
                step_version,
                step_version - group.version_start,
                [group.version_start, group.version_end],
            )
