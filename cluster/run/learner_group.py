"""The learner ranks as Ray actors, placed together, started with one rendezvous and called as one group."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from algorithms.errors import StableAsyncError
from cluster.run.ray_cluster import actor_env
from learner.batch import TrainBatch
from learner.ports import listenable_port
from learner.rank import LearnerRank, LearnerSpec
from learner.weight_sync import CollectiveWeightSync

log = logging.getLogger("stableasync")


class LearnerActor(LearnerRank):
    """A learner rank that publishes weights by either weight-sync path."""

    transfer: Any = None  # rank 0 of the weight group: vLLM's NCCL communicator, or our gloo one

    def publish(self, dtype: str) -> list[Any]:
        """Object store: every rank gathers (ZeRO-3); rank 0 returns [ObjectRef of its PackedWeights]."""
        packed = self.packed_weights_for_publish(dtype)
        return [ray.put(packed)] if packed is not None else []

    def join_weight_transfer(self, host: str, port: int, world_size: int, backend: str) -> None:
        """Rank 0 hosts the weight group at `host` (its own node) with the generators' engine workers."""
        if self.rank != 0:
            return
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            self.transfer = trainer_init({"master_address": host, "master_port": port, "world_size": world_size})
        else:
            self.transfer = CollectiveWeightSync(host, port, 0, world_size)

    def send_weights(self, dtype: str) -> int:
        """Every rank walks the weights in step (ZeRO-3 gathers each); rank 0 sends them cast to `dtype`, one
        bucket at a time. Returns the bytes rank 0 sent."""
        if self.transfer is None:
            self.follow_publish()
            return 0
        specs, weights = self.publish_specs(dtype), self.published_weights()
        if isinstance(self.transfer, CollectiveWeightSync):
            return self.transfer.send(specs, (tensor for _, tensor in weights))
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        wire = getattr(torch, dtype)
        packed_nccl_broadcast_producer(
            weights, self.transfer, 0, post_iter_func=lambda item: item[1].to(self.device, wire, copy=True)
        )
        return sum(torch.Size(s.shape).numel() * wire.itemsize for s in specs)

    def ready(self) -> int:
        return self.rank

    def process_id(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class PlacementTimeout(StableAsyncError, RuntimeError):
    """The learner's placement group found no room in time; the message names the settings to change."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's store listens: an address of the node that hosts it, and a port free there."""

    host: str
    port: int
    node_id: str  # Ray's id of that node


@ray.remote
def _free_address() -> Rendezvous:
    return Rendezvous(ray.util.get_node_ip_address(), listenable_port(), ray.get_runtime_context().get_node_id())


def address_was_taken(error: BaseException) -> bool:
    """Whether a rank died because its group's store found the rendezvous port taken by another process."""
    return "EADDRINUSE" in str(error) or "address already in use" in str(error).lower()


def _failed(refs: list[ray.ObjectRef]) -> list[int]:
    """The positions (ranks) of the ended calls in `refs` that raised."""
    failed = []
    for rank, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except Exception:
            failed.append(rank)
    return failed


class LearnerGroupBroken(StableAsyncError, RuntimeError):
    """A rank's call failed while other ranks stay inside it, waiting in a collective the failed rank left: the
    group's collectives are out of step, and only new ranks (a restart from a checkpoint) go on."""


class LearnerGroup:
    """R learner ranks in one placement group; every call goes to all ranks (they are collectives).

    The constructor reserves the ranks' placement and starts them loading; `wait_until_ready` blocks until they
    have, so a driver can start its generators in between and both load at once.
    """

    rank_straggle_s = 60.0  # after one rank's call fails, how long the others may still take to end theirs

    def __init__(
        self,
        spec: LearnerSpec,
        num_ranks: int,
        cpus_per_rank: float,
        gpus_per_rank: float,
        name_prefix: str | None = None,
        placement_timeout_s: float = 600.0,
        node_resource: str | None = None,
    ) -> None:
        bundle = {
            "CPU": cpus_per_rank,
            **({"GPU": gpus_per_rank} if gpus_per_rank else {}),
            **({node_resource: 1.0} if node_resource else {}),
        }
        bundles = [dict(bundle) for _ in range(num_ranks)]
        self.placement = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=placement_timeout_s)
        except GetTimeoutError:
            remove_placement_group(self.placement)
            raise PlacementTimeout(
                f"the learner's {num_ranks} rank(s) of {bundles[0]} could not be placed within "
                f"{placement_timeout_s:g} s; the cluster has {ray.available_resources()} free of "
                f"{ray.cluster_resources()} (learner.cpus_per_rank, learner.gpus_per_rank, learner.num_ranks, "
                "cluster.learner_resource)"
            ) from None
        self.spec, self.cpus_per_rank, self.gpus_per_rank = spec, cpus_per_rank, gpus_per_rank
        self.num_ranks, self.name_prefix = num_ranks, name_prefix
        self.ranks: list[Any] = self._start_ranks()

    def _start_ranks(self) -> list[Any]:
        """The ranks' actors, started loading at one fresh rendezvous address."""
        master = self.rendezvous_address()
        self.port = master.port
        remote_cls = ray.remote(LearnerActor)
        # Any, like the generators' handles: Ray types a handle as `ActorHandle[T] | type[T]`, whose methods
        # (undecorated by @ray.method) have no typed `.remote`
        return [
            remote_cls.options(
                num_cpus=self.cpus_per_rank,
                num_gpus=self.gpus_per_rank,
                scheduling_strategy=self._in_bundle(rank),
                name=f"{self.name_prefix}-learner-{rank}" if self.name_prefix else None,
                runtime_env={"env_vars": {**actor_env(), "OMP_NUM_THREADS": str(max(1, int(self.cpus_per_rank)))}},
            ).remote(self.spec, rank, self.num_ranks, master.host, master.port)
            for rank in range(self.num_ranks)
        ]

    rendezvous_tries = 3  # ranks started at a fresh port after another process took the port they were given

    def wait_until_ready(self) -> None:
        """Block until every rank has loaded its model and joined the group (a rank's load error raises here).

        The port is free when chosen but bound only once rank 0's process has started: should another process
        take it in between, the ranks start again at a fresh port, `rendezvous_tries` times in all."""
        for attempt in range(1, self.rendezvous_tries + 1):
            pending = [rank.ready.remote() for rank in self.ranks]
            try:
                while pending:  # the first failure at once, not after the other ranks' rendezvous timeout
                    (done,), pending = ray.wait(pending, num_returns=1)
                    ray.get(done)
                return
            except RayActorError as error:
                if attempt == self.rendezvous_tries or not address_was_taken(error):
                    raise
                log.warning(
                    "learner ranks' rendezvous port %d was taken; starting them again at another port", self.port
                )
                self._stop_ranks()
                self.ranks = self._start_ranks()

    def rendezvous_address(self) -> Rendezvous:
        """An IP address of rank 0's node and a port free there: where rank 0 can host a group's store."""
        return ray.get(_free_address.options(scheduling_strategy=self._in_bundle(0), num_cpus=0).remote())

    def _in_bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.placement, placement_group_bundle_index=index)

    def train_step(self, shards: list[TrainBatch]) -> list[ray.ObjectRef]:
        return [rank.train_step.remote(shard) for rank, shard in zip(self.ranks, shards)]

    def sft_step(self, shards: list[TrainBatch], learning_rate: float) -> dict[str, float]:
        refs = [rank.sft_step.remote(shard, learning_rate) for rank, shard in zip(self.ranks, shards)]
        return self.results(refs, "sft_step")[0]

    def load_reference(self, folder: str) -> None:
        """Every rank's KL reference from `folder` (a collective under ZeRO-3)."""
        self.results([rank.load_reference.remote(folder) for rank in self.ranks], "load_reference")

    def sequence_log_ratios(self) -> list[float]:
        """Rank 0's learner/behaviour sequence log-ratios of its latest step (its shard's rows, in order)."""
        return ray.get(self.ranks[0].sequence_log_ratios.remote())

    def publish(self, dtype: str) -> ray.ObjectRef:
        """The object-store reference of the full weights in `dtype` (all ranks take part in the gather)."""
        return self.results([rank.publish.remote(dtype) for rank in self.ranks], "publish")[0][0]

    def save_model(self, folder: str) -> None:
        """Rank 0 writes the policy as a Hugging Face model folder (every rank takes part under ZeRO-3)."""
        self.results([rank.save_model.remote(folder) for rank in self.ranks], "save_model")

    def save_checkpoint(self, directory: str, tag: str) -> None:
        """Every rank writes its part (ZeRO shards) under `directory` (shared storage across nodes)."""
        self.results([rank.save_checkpoint.remote(directory, tag) for rank in self.ranks], "save_checkpoint")

    def results(self, refs: list[ray.ObjectRef], call: str) -> list[Any]:
        """Every rank's result of a collective `call` (one ref per rank), or the first rank's error.

        A rank that raises (its own shard on a full disk, an out-of-memory batch) leaves the collectives
        of its call, and the other ranks wait in them until the process-group timeout (DeepSpeed's default:
        10 minutes, DEEPSPEED_TIMEOUT), then fail too: when they have not ended their call
        `rank_straggle_s` after a failure, `LearnerGroupBroken` says so instead of waiting that long.
        """
        pending = list(refs)
        while pending:
            (done,), pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done)
            except RayActorError:
                raise
            except Exception as error:
                _, waiting = ray.wait(pending, num_returns=len(pending), timeout=self.rank_straggle_s)
                if waiting:
                    stuck = sorted(refs.index(ref) for ref in waiting)
                    raise LearnerGroupBroken(
                        f"learner rank {refs.index(done)} failed in {call} ({type(error).__name__}: {error}) and "
                        f"rank(s) {stuck} had not ended theirs {self.rank_straggle_s:g} s later"
                    ) from error
                log.warning(
                    "learner rank(s) %s failed in %s; the error of rank %d follows",
                    _failed(refs),
                    call,
                    refs.index(done),
                )
                raise
        return ray.get(refs)

    def load_checkpoint(self, directory: str, tag: str) -> int:
        return self.results([rank.load_checkpoint.remote(directory, tag) for rank in self.ranks], "load_checkpoint")[0]

    def _stop_ranks(self) -> None:
        """Kill every rank and wait for their deaths, which free their names for new ranks."""
        for rank in self.ranks:
            ray.kill(rank)
        ray.wait([rank.ready.remote() for rank in self.ranks], num_returns=len(self.ranks))

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.placement)
