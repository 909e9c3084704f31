"""Ray connection, placement and the actor wrappers of the plain learner and generator classes."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from actors.generator import Generator, GeneratorSpec, engine_env
from actors.streaming import StreamingGenerator
from algorithms import native
from algorithms.errors import StableAsyncError
from learner.batch import TrainBatch
from learner.rank import LearnerRank, LearnerSpec
from learner.weight_sync import CollectiveWeightSync, TensorSpec

PROJECT_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("stableasync")

# Environment every actor of a job gets: a shared cache of built ops, no noise (a generator adds its engine's).
ACTOR_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": str(PROJECT_ROOT),
}


def actor_env() -> dict[str, str]:
    env = dict(ACTOR_ENV)
    env["TORCH_EXTENSIONS_DIR"] = str(native.extensions_dir())  # DeepSpeed's op and the fused scans
    if os.environ.get("WANDB_API_KEY"):
        env["WANDB_API_KEY"] = os.environ["WANDB_API_KEY"]  # passed through, never written to the run dir
    return env


def connect(address: str | None, num_cpus: int | None, namespace: str) -> None:
    """Join the cluster at `address` (or the one a submitted Ray job runs in, from RAY_ADDRESS), or start a
    small local one (no dashboard, no prestarted workers)."""
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": actor_env()}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
        return
    ray.init(  # "local": a new cluster even if another one's address file is lying around
        address="local", num_cpus=num_cpus, include_dashboard=False, namespace=namespace, runtime_env=runtime_env,
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
    )


def cluster_resources() -> dict[str, float]:
    return dict(ray.cluster_resources())


@ray.remote(num_cpus=0)
def _missing(paths: list[str]) -> list[str]:
    return [path for path in paths if not Path(path).exists()]


def paths_missing_on_nodes(paths: list[str]) -> dict[str, list[str]]:
    """Ray node id -> those of `paths` (absolute, as the driver sees them) that node does not see; only
    nodes that miss any. A zero-CPU task runs on every alive node, none when the cluster has one."""
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    if len(nodes) < 2:
        return {}
    refs = [_missing.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(paths)
            for node in nodes]
    return {node: missing for node, missing in zip(nodes, ray.get(refs)) if missing}


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
        packed_nccl_broadcast_producer(weights, self.transfer, 0,
                                       post_iter_func=lambda item: item[1].to(self.device, wire, copy=True))
        return sum(torch.Size(s.shape).numel() * wire.itemsize for s in specs)

    def ready(self) -> int:
        return self.rank

    def process_id(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class GeneratorActor(Generator):
    """A generator as a Ray actor: calls run one at a time, in the order they were sent."""

    def ready(self) -> int:
        return self.index

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class StreamingGeneratorActor(StreamingGenerator):
    """A streaming generator as an async Ray actor: its calls run at once on the actor's event loop (a weight
    update among them), so the engine batches every group it was sent."""

    async def ready(self) -> int:
        return self.index

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class WeightGroupClosed(StableAsyncError, RuntimeError):
    """A generator must join a collective weight group after it formed (a restart): it cannot."""


class PlacementTimeout(StableAsyncError, RuntimeError):
    """The learner's placement group found no room in time; the message names the settings to change."""


class ObjectStorePublisher:
    """The default path: rank 0 puts the weights in the object store once; every generator reads them."""

    def __init__(self, learners: LearnerGroup, generators: dict[int, Any], dtype: str,
                 wait_for_loads: bool = False) -> None:
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
            try:
                ray.get(load)
            except RayActorError:  # it died: its failed generate call restarts it, and `restore` loads it
                pass


class CollectivePublisher:
    """Learner rank 0 broadcasts to every generator's engine workers: vLLM's nccl engine on GPUs, our
    stableasync_gloo engine (the same ranks and call order) on CPU.

    Rank 0 hosts the group on its own node; generator i's tensor-parallel workers take the ranks after
    those of generators 0..i-1. A broadcast starts only once every generator is ready to receive it, so no
    rank waits inside a collective (and its timeout) behind a long generate call: a request-batch generator
    once the calls it was given have ended (Ray runs its calls in order), a streaming one at once (it pauses
    its requests in flight for the broadcast).
    """

    def __init__(self, learners: LearnerGroup, generators: dict[int, Any], backend: str, dtype: str,
                 tensor_parallel_size: int = 1) -> None:
        self.learners, self.generators = learners, dict(generators)  # fixed membership
        rendezvous = learners.rendezvous_address()
        host, port = rendezvous.host, rendezvous.port
        world = 1 + tensor_parallel_size * len(self.generators)
        self.dtype = dtype
        # local shapes on rank 0: no collective
        self.update_info = TensorSpec.wire(ray.get(learners.ranks[0].publish_specs.remote(dtype)))
        ray.get([rank.join_weight_transfer.remote(host, port, world, backend) for rank in learners.ranks]
                + [g.join_weight_transfer.remote(host, port, 1 + i * tensor_parallel_size, world)
                   for i, g in enumerate(self.generators.values())])

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


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's store listens: an address of the node that hosts it, and a port free there."""

    host: str
    port: int
    node_id: str  # Ray's id of that node


@ray.remote
def _free_address() -> Rendezvous:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return Rendezvous(ray.util.get_node_ip_address(), sock.getsockname()[1],
                          ray.get_runtime_context().get_node_id())


def _failed(refs: list[ray.ObjectRef]) -> list[int]:
    """The positions (ranks) of the ended calls in `refs` that raised."""
    failed = []
    for rank, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - any error counts: the caller raises the first one
            failed.append(rank)
    return failed


class LearnerGroupBroken(StableAsyncError, RuntimeError):
    """A rank's call failed while other ranks stay inside it, waiting in a collective the failed rank left: the
    group's collectives are out of step, and only new ranks (a restart from a checkpoint) go on."""


class LearnerGroup:
    """R learner ranks in one placement group; every call goes to all ranks (they are collectives)."""

    rank_straggle_s = 60.0  # after one rank's call fails, how long the others may still take to end theirs

    def __init__(self, spec: LearnerSpec, num_ranks: int, cpus_per_rank: float, gpus_per_rank: float,
                 name_prefix: str | None = None, placement_timeout_s: float = 600.0,
                 node_resource: str | None = None) -> None:
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {}),
                  **({node_resource: 1.0} if node_resource else {})}
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
        master = self.rendezvous_address()
        remote_cls = ray.remote(LearnerActor)
        # Any, like the generators' handles: Ray types a handle as `ActorHandle[T] | type[T]`, whose methods
        # (undecorated by @ray.method) have no typed `.remote`
        self.ranks: list[Any] = [
            remote_cls.options(
                num_cpus=cpus_per_rank, num_gpus=gpus_per_rank, scheduling_strategy=self._in_bundle(rank),
                name=f"{name_prefix}-learner-{rank}" if name_prefix else None,
                runtime_env={"env_vars": {**actor_env(), "OMP_NUM_THREADS": str(max(1, int(cpus_per_rank)))}},
            ).remote(spec, rank, num_ranks, master.host, master.port)
            for rank in range(num_ranks)
        ]
        ray.get([r.ready.remote() for r in self.ranks])

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
                log.warning("learner rank(s) %s failed in %s; the error of rank %d follows", _failed(refs), call,
                            refs.index(done))
                raise
        return ray.get(refs)

    def load_checkpoint(self, directory: str, tag: str) -> int:
        return self.results([rank.load_checkpoint.remote(directory, tag) for rank in self.ranks], "load_checkpoint")[0]

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.placement)


def generator_bundles(spec: GeneratorSpec, cpus: float, node_resource: str | None = None) -> list[dict[str, float]]:
    """The placement group of a tensor-parallel generator: one GPU per engine rank, on one node; the actor
    and its CPUs in the first bundle. Empty for an engine on one device (the actor holds its resources)."""
    if spec.tensor_parallel_size == 1:
        return []
    first = {"CPU": cpus, "GPU": 1.0, **({node_resource: 1.0} if node_resource else {})}
    return [first] + [{"GPU": 1.0} for _ in range(spec.tensor_parallel_size - 1)]


# A tensor-parallel generator's placement group, by actor id: removed with the actor
_GENERATOR_PLACEMENTS: dict[str, Any] = {}


def start_generator(spec: GeneratorSpec, index: int, cpus: float, max_restarts: int = 0,
                    name_prefix: str | None = None, node_resource: str | None = None) -> Any:
    """Generator actor `{name_prefix}-generator-{index}`, placed on a node offering `node_resource` if given.

    Returns at once: the engine starts in the background (`ready.remote()` says when). Ray restarts a dead
    one up to `max_restarts` times, and its failed call raises (no task retries) so the driver reissues the
    groups with fresh weights. A tensor-parallel engine runs in a placement group of its GPUs that the
    actor's child tasks join, which is where vLLM's ray executor starts its workers."""
    bundles = generator_bundles(spec, cpus, node_resource)
    placement = {"num_gpus": spec.gpus, "resources": {node_resource: 1.0} if node_resource else {}}
    group = None
    if bundles:
        group = placement_group(bundles, strategy="STRICT_PACK")
        placement = {"num_gpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}
    actor: Any = ray.remote(StreamingGeneratorActor if spec.streaming else GeneratorActor).options(
        num_cpus=cpus, max_restarts=max_restarts, max_task_retries=0, **placement,
        name=f"{name_prefix}-generator-{index}" if name_prefix else None,
        runtime_env={"env_vars": {**actor_env(), **engine_env(spec), "OMP_NUM_THREADS": str(max(1, int(cpus)))}},
    ).remote(spec, index)
    if group is not None:
        _GENERATOR_PLACEMENTS[actor._actor_id.hex()] = group
    return actor


def stop_generator(actor: Any) -> None:
    """Kill a generator and release its placement group, if it has one."""
    ray.kill(actor)
    group = _GENERATOR_PLACEMENTS.pop(actor._actor_id.hex(), None)
    if group is not None:
        remove_placement_group(group)
