"""How a published policy version reaches the generators: through the object store, or a collective
broadcast from learner rank 0."""

from __future__ import annotations

import contextlib
from typing import Any

import ray
from ray.exceptions import RayActorError

from algorithms.errors import StableAsyncError
from cluster.run.learner_group import LearnerGroup
from learner.weight_sync import TensorSpec


class WeightGroupClosed(StableAsyncError, RuntimeError):
    """A generator must join a collective weight group after it formed (a restart): it cannot."""


class ObjectStorePublisher:
    """The default path: rank 0 puts the weights in the object store once; every generator reads them."""

    def __init__(
        self, learners: LearnerGroup, generators: dict[int, Any], dtype: str, wait_for_loads: bool = False
    ) -> None:
        self.learners, self.generators = learners, generators  # the driver's live map: members come and go
        self.dtype = dtype  # the generators' weights
        self.latest: tuple[ray.ObjectRef, int] | None = None
        # Streaming generators load at once, beside their calls in flight: wait for the loads, so that every
        # call sent after a publish samples with its weights. A blocking generator loads after its current
        # call and before the next one (Ray runs its calls in order): nothing to wait for.
        self.wait_for_loads = wait_for_loads

    def publish(self, version: int) -> None:
        weights = self.learners.publish(self.dtype)
        self.latest = (weights, version)
        self._loaded([generator.update_weights.remote(weights, version) for generator in self.generators.values()])

    def restore(self, index: int) -> int:
        """A restarted or newly joined generator gets the latest weights before anything else it is sent;
        their version."""
        assert self.latest is not None, "publish first"
        weights, version = self.latest
        self._loaded([self.generators[index].update_weights.remote(weights, version)])
        return version

    def _loaded(self, loads: list[ray.ObjectRef]) -> None:
        if not self.wait_for_loads:
            return
        for load in loads:
            with contextlib.suppress(
                RayActorError
            ):  # it died: its failed generate call restarts it, `restore` loads it
                ray.get(load)


class CollectivePublisher:
    """Learner rank 0 broadcasts to every generator's engine workers: vLLM's nccl engine on GPUs, our
    stableasync_gloo engine (the same ranks and call order) on CPU.

    Rank 0 hosts the group on its own node; generator i's tensor-parallel workers take the ranks after
    those of generators 0..i-1. A broadcast starts only once every generator is ready to receive it, so no
    rank waits inside a collective (and its timeout) behind a long generate call: a request-batch generator
    once the calls it was given have ended (Ray runs its calls in order), a streaming one at once (it pauses
    its requests in flight for the broadcast).
    """

    def __init__(
        self,
        learners: LearnerGroup,
        generators: dict[int, Any],
        backend: str,
        dtype: str,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.learners, self.generators = learners, dict(generators)  # fixed membership
        rendezvous = learners.rendezvous_address()
        host, port = rendezvous.host, rendezvous.port
        world = 1 + tensor_parallel_size * len(self.generators)
        self.dtype = dtype
        # local shapes on rank 0: no collective
        self.update_info = TensorSpec.wire(ray.get(learners.ranks[0].publish_specs.remote(dtype)))
        ray.get(
            [rank.join_weight_transfer.remote(host, port, world, backend) for rank in learners.ranks]
            + [
                g.join_weight_transfer.remote(host, port, 1 + i * tensor_parallel_size, world)
                for i, g in enumerate(self.generators.values())
            ]
        )

    def restore(self, index: int) -> int:
        raise WeightGroupClosed(
            f"generator {index} was restarted, but a collective weight group cannot take a new member; "
            "use async.weight_sync: object_store for jobs whose generators must survive restarts"
        )

    def publish(self, version: int) -> None:
        ray.get([g.ready.remote() for g in self.generators.values()])  # their earlier calls have ended
        sending = [rank.send_weights.remote(self.dtype) for rank in self.learners.ranks]
        receiving = [g.receive_weights.remote(self.update_info, version) for g in self.generators.values()]
        ray.get(sending + receiving)
