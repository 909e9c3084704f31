"""The asynchronous loop's decisions, without Ray: which generator samples which prompt groups, when a
learner step starts, and what a finished call, a finished step or a generator that dies, joins or leaves
changes.

The driver (`cluster/run/loop.py`) feeds it Ray's completions; the simulator
(`cluster/experiments/simulate.py`) feeds it the events of a simulated clock. Both issue, take and account
through these methods, so the simulator predicts the policy the driver runs, and tests drive it with fake
generators in milliseconds.

A call is known by the handle its sender returns (a Ray object ref, a simulated call); requests are the
caller's own records, of which the schedule reads only `group_id` and `problem_id`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from actors.buffer import RolloutBuffer, ScoredGroup
from algorithms.errors import StableAsyncError


class SchedulerStuck(StableAsyncError, RuntimeError):
    """Nothing to wait for: no generation admitted and no batch ready (a bug, not a fault)."""


class Request(Protocol):
    """What the schedule reads of a generation request."""

    @property
    def group_id(self) -> int: ...

    @property
    def problem_id(self) -> str: ...


R = TypeVar("R", bound=Request)
H = TypeVar("H", bound=Hashable)


@dataclass
class Call(Generic[R]):
    """One generate call in flight: which generator, the groups it was sent, the weights it samples with."""

    index: int
    requests: list[R]
    weights_version: int
    incarnation_seen: int = 0  # the member's restarts when it was sent: a later death already handled shows


@dataclass
class Member:
    """What the schedule knows of one generator besides its actor."""

    weights_version: int = 0  # the policy version its next call samples with
    incarnation: str | None = None  # its process, learnt from its first result after a (re)start
    restarts: int = 0


@dataclass
class Schedule(Generic[R, H]):
    """Admission under the lag bound, request building, batch taking and versions, for one run.

    `new_request(group_id, generator_index)` builds the request of a new group (drawing its problem);
    `send(call)` starts a generate call and returns its handle.
    """

    buffer: RolloutBuffer
    prompts_per_request: int
    new_request: Callable[[int, int], R]
    send: Callable[[Call[R]], H]
    calls_per_generator: int = 1  # generate calls one generator runs at once (a streaming engine: several)
    members: dict[int, Member] = field(default_factory=dict)  # generator index -> member
    version: int = 0  # learner optimizer steps taken
    next_group_id: int = 0
    calls: dict[H, Call[R]] = field(default_factory=dict)  # generate calls in flight, by handle
    orphans: list[tuple[R, str]] = field(default_factory=list)  # groups of generators that left, with why
    training: list[ScoredGroup] | None = None  # the groups of the learner step in flight
    departed_restarts: int = 0  # restarts of generators that have left the job

    @property
    def learner_busy(self) -> bool:
        return self.training is not None

    @property
    def generator_restarts(self) -> int:
        """Generator restarts over the run, of members and of generators that left."""
        return self.departed_restarts + sum(m.restarts for m in self.members.values())

    def calls_of(self, index: int) -> int:
        return sum(call.index == index for call in self.calls.values())

    # ---- generation ----------------------------------------------------------------------------------

    def issue(self) -> None:
        """Send every generator with room (fewer than `calls_per_generator` calls) a request's worth of groups
        per free call: orphans first, else new groups while the buffer admits them under the lag bound."""
        for index in list(self.members):
            free = self.calls_per_generator - self.calls_of(index)
            while free > 0 and self._send_one(index):
                free -= 1

    def _send_one(self, index: int) -> bool:
        """One call's worth of groups to generator `index`; False when there was nothing to send."""
        if self.orphans:  # groups of a generator that left go first, to whoever is free
            size = self.prompts_per_request
            adopted, self.orphans = self.orphans[:size], self.orphans[size:]
            for request, reason in adopted:
                self.buffer.reissue(request.group_id, self.members[index].weights_version, index, reason)
            self._send(index, [request for request, _ in adopted])
            return True
        requests: list[R] = []
        while len(requests) < self.prompts_per_request and self.buffer.can_issue(
            self.version, self.learner_busy, self.members[index].weights_version, self.next_group_id
        ):
            requests.append(self._new(index))
        if requests:
            self._send(index, requests)
        return bool(requests)

    def _new(self, index: int) -> R:
        group_id, self.next_group_id = self.next_group_id, self.next_group_id + 1
        request = self.new_request(group_id, index)
        self.buffer.issue(group_id, request.problem_id, self.members[index].weights_version, index)
        return request

    def _send(self, index: int, requests: list[R]) -> None:
        member = self.members[index]
        call = Call(index, requests, member.weights_version, member.restarts)
        self.calls[self.send(call)] = call

    def finished(self, handle: H) -> Call[R]:
        """The call of `handle` ended (with groups or an error): the generator is free again."""
        return self.calls.pop(handle)

    def reissue(self, index: int, requests: list[R], reason: str) -> None:
        """Send `requests` again to generator `index`, with the weights it holds now (the ledger says why)."""
        for request in requests:
            self.buffer.reissue(request.group_id, self.members[index].weights_version, index, reason)
        self._send(index, requests)

    def resume(self, requests: list[R], reason: str) -> None:
        """Groups in flight at a checkpoint go out again, a request's worth at a time, round the members."""
        indices = list(self.members)
        size = self.prompts_per_request
        for n, start in enumerate(range(0, len(requests), size)):
            chunk = requests[start : start + size]
            self.reissue(indices[n % len(indices)], chunk, reason)

    def in_flight(self) -> list[R]:
        """Every request issued and not yet back: in calls, and orphaned."""
        return [r for call in self.calls.values() for r in call.requests] + [r for r, _ in self.orphans]

    # ---- generator membership ------------------------------------------------------------------------

    def join(self, index: int, weights_version: int) -> None:
        """Generator `index` becomes a member, holding `weights_version`."""
        self.members[index] = Member(weights_version=weights_version)

    def leave(self, index: int, requests: list[R], reason: str) -> None:
        """Generator `index` stops being a member; the groups it held wait for another one."""
        self.departed_restarts += self.members.pop(index, Member()).restarts
        self.orphans += [(request, reason) for request in requests]

    # ---- learning ------------------------------------------------------------------------------------

    def take_batch(self) -> list[ScoredGroup] | None:
        """The next step's groups, when no step is in flight and the buffer holds a batch."""
        if self.training is not None:
            return None
        self.training = self.buffer.take(self.version, self.next_group_id)
        return self.training

    def step_done(self, skipped_reason: str | None = None) -> list[int]:
        """The step in flight ended: its groups are trained (or dropped, when the step was skipped), and the
        learner moves to the next version. Returns each trained response's lag."""
        groups = self.training or []
        if skipped_reason is None:
            self.buffer.mark_trained(groups, self.version)
        else:  # the weights did not move: these groups were not trained on
            for group in groups:
                self.buffer.ledger.dropped(group.group_id, skipped_reason)
        lags = [self.version - g.version_start for g in groups for _ in g.completions]
        self.training = None
        self.version += 1
        return lags

    def published(self) -> None:
        """Every generator samples its next call with the current version."""
        for member in self.members.values():
            member.weights_version = self.version

    # ---- the end -------------------------------------------------------------------------------------

    def end_unfinished(self, why: str) -> list[H]:
        """Record in the ledger that every group still generating, orphaned or buffered ends untrained (between
        learner steps: the groups of a step in flight end with it). Returns the handles of the calls still
        running (the caller may wait for them)."""
        handles = list(self.calls)
        for handle in handles:
            for request in self.calls.pop(handle).requests:
                self.buffer.lost(request.group_id, f"{why} before this group was trained")
        for request, reason in self.orphans:
            self.buffer.lost(request.group_id, f"{why} before this group was issued again ({reason})")
        self.orphans = []
        for group in self.buffer.ready:
            self.buffer.ledger.dropped(group.group_id, f"{why} before this group was trained")
        return handles
