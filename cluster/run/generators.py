"""The generator actors of a run and their faults.

A generator whose process dies is restarted by Ray (`generator.max_restarts`); the pool waits for it,
sends it the latest weights, and the loop issues its in-flight groups again (the ledger records each
reissue). Elastic jobs (`generator.max_generators`) follow the cluster instead: a generator is started on
every free unit of `cluster.generator_resource` (a node the autoscaler added) and joins once it has the
latest weights; one whose node went away leaves, and its in-flight groups go to the others.

Who holds which weights and which groups is the schedule's (`cluster/run/schedule.py`); the pool holds the
actors and talks to Ray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from actors.generator import GeneratedGroup, GenerationRequest
from algorithms.errors import StableAsyncError
from cluster.run.schedule import Call, Schedule

log = logging.getLogger("stableasync")
GENERATOR_RESTART_TIMEOUT_S = 600.0  # vLLM start on a busy node, model load included
SCALE_CHECK_S = 2.0  # how often an elastic job looks for free generator resources


class GeneratorLost(StableAsyncError, RuntimeError):
    """A generator died more often than generator.max_restarts allows, did not come back, or none is left."""


def generators_to_start(free_units: float, members: int, starting: int, max_generators: int) -> int:
    """How many generators an elastic job starts now. None while others are still starting: a unit Ray
    has not yet handed to a starting actor still looks free, and must not be counted twice."""
    if starting:
        return 0
    return max(0, min(int(free_units), max_generators - members))


class GeneratorPool:
    """Generator actors by index (`actors`, shared with the weight publisher), newcomers still starting, and
    what their faults do to the schedule. `restore_weights(index)` sends a (re)started generator the latest
    weights and returns their version."""

    def __init__(
        self,
        actors: dict[int, Any],
        schedule: Schedule[GenerationRequest, ray.ObjectRef],
        start_generator: Callable[[int], Any],
        restore_weights: Callable[[int], int],
        nodes: dict[str, str],
        resource: str | None,
        max_generators: int | None,
        max_restarts: int,
    ) -> None:
        self.actors = actors
        self.schedule = schedule
        self.start_generator = start_generator
        self.restore_weights = restore_weights
        self.nodes = nodes  # index (str) -> Ray node id, newcomers added as they join
        self.resource = resource
        self.max_generators = max_generators
        self.max_restarts = max_restarts
        self.starting: dict[ray.ObjectRef, tuple[int, Any]] = {}  # elastic newcomers: ready call -> (index, actor)
        self.next_index = max(actors, default=-1) + 1
        self.next_scale_check = 0.0
        self.alone_since: float | None = None
        self.joined = self.left = 0

    @property
    def elastic(self) -> bool:
        return self.max_generators is not None

    def every_actor(self) -> list[Any]:
        """Members and newcomers still starting, each once (to stop them all at the end)."""
        return [*self.actors.values(), *(actor for _, actor in self.starting.values())]

    # ---- Ray restarts in place -----------------------------------------------------------------------

    def failed(self, call: Call[GenerationRequest], error: BaseException) -> None:
        """A generate call failed because its generator died: an elastic member leaves, any other is waited
        for until Ray has restarted it, and its groups go out again."""
        index = call.index
        if index not in self.schedule.members:  # an elastic member that left with an earlier failed call
            self.schedule.leave(index, call.requests, f"generator {index} left during generation")
            return
        if self.elastic:
            self.leave(index, call.requests, f"generator {index} left during generation ({type(error).__name__})")
            return
        if call.incarnation_seen == self.schedule.members[index].restarts:  # else: another call of this death
            self.restarted(index, f"generator {index} died during generation ({type(error).__name__})")
        self.schedule.reissue(index, call.requests, f"generator {index} died during generation")

    def sampled_before_restart(self, call: Call[GenerationRequest], groups: list[GeneratedGroup]) -> bool:
        """Whether a call's generator was restarted while idle and sampled with its initial weights: then its
        groups went out again (a restart between calls shows only in the process id of its next result)."""
        member = self.schedule.members[call.index]
        if not groups or groups[0].incarnation == member.incarnation:
            return False
        if member.incarnation is not None:
            self.restarted(call.index, f"generator {call.index} was restarted between calls")
            if any(g.version_start < call.weights_version for g in groups):
                self.schedule.reissue(
                    call.index,
                    call.requests,
                    f"generator {call.index} sampled with its initial weights after a restart",
                )
                return True
        member.incarnation = groups[0].incarnation
        return False

    def restarted(self, index: int, reason: str) -> None:
        """Count a generator restart (fail the job past max_restarts) and give it the latest weights."""
        member = self.schedule.members[index]
        member.restarts += 1
        if member.restarts > self.max_restarts:
            raise GeneratorLost(
                f"{reason}; it has died {member.restarts} times, more than generator.max_restarts = {self.max_restarts}"
            )
        log.warning(
            "%s; restart %d of %d: waiting for it, then weights version %d, then its groups again",
            reason,
            member.restarts,
            self.max_restarts,
            self.schedule.version,
        )
        self._wait_until_back(index, reason)
        member.weights_version = self.restore_weights(index)
        member.incarnation = None  # learnt again from its next result

    def _wait_until_back(self, index: int, reason: str) -> None:
        """Block until Ray has restarted the generator (calls sent earlier fail as 'unavailable')."""
        deadline = time.monotonic() + GENERATOR_RESTART_TIMEOUT_S
        while True:
            try:
                ray.get(self.actors[index].ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except ActorDiedError as error:
                raise GeneratorLost(f"{reason}, and Ray could not restart it: {error}") from error
            except (RayActorError, GetTimeoutError) as error:
                if time.monotonic() > deadline:
                    raise GeneratorLost(
                        f"{reason}, and it was not back within {GENERATOR_RESTART_TIMEOUT_S:g} s"
                    ) from error
                time.sleep(0.5)

    # ---- elastic membership --------------------------------------------------------------------------

    def scale(self) -> None:
        """Start a generator on every free unit of the generator resource, up to generator.max_generators."""
        if self.max_generators is None or self.resource is None or time.monotonic() < self.next_scale_check:
            return
        self.next_scale_check = time.monotonic() + SCALE_CHECK_S
        free = ray.available_resources().get(self.resource, 0.0)
        for _ in range(generators_to_start(free, len(self.actors), len(self.starting), self.max_generators)):
            index, self.next_index = self.next_index, self.next_index + 1
            actor = self.start_generator(index)
            self.starting[actor.ready.remote()] = (index, actor)
            log.info("generator %d starting on a free %r unit", index, self.resource)

    def join(self, ref: ray.ObjectRef) -> None:
        """A started generator becomes a member once it holds the latest weights (sent before any request)."""
        index, actor = self.starting.pop(ref)
        try:
            ray.get(ref)
        except RayActorError as error:
            log.warning(
                "generator %d failed to start (%s); trying again when resources are free", index, type(error).__name__
            )
            return
        self.actors[index] = actor
        self.schedule.join(index, self.restore_weights(index))
        self.nodes[str(index)] = ray.get(actor.node_id.remote())
        self.joined += 1
        log.info(
            "generator %d joined with weights version %d (%d generators)",
            index,
            self.schedule.members[index].weights_version,
            len(self.actors),
        )

    def leave(self, index: int, requests: list[GenerationRequest], reason: str) -> None:
        """A generator that died (its node left) stops being a member; its groups wait for another one."""
        self.actors.pop(index, None)
        self.schedule.leave(index, requests, reason)
        self.left += 1
        log.warning(
            "%s; %d generators left, %d of its groups issued again to others", reason, len(self.actors), len(requests)
        )

    def wait_alone(self) -> None:
        """Every member left: wait for a node to come back, for a while, then give up."""
        self.alone_since = self.alone_since or time.monotonic()
        if time.monotonic() - self.alone_since > GENERATOR_RESTART_TIMEOUT_S:
            raise GeneratorLost(
                f"no generator for {GENERATOR_RESTART_TIMEOUT_S:g} s: no node offers a free "
                f"{self.resource!r} unit (cluster.generator_resource)"
            )
        time.sleep(SCALE_CHECK_S)
