"""The generators as Ray actors: placed, started and stopped."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.generator import Generator, GeneratorSpec, engine_env
from actors.streaming import StreamingGenerator
from cluster.run.ray_cluster import actor_env


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


def generator_bundles(spec: GeneratorSpec, cpus: float, node_resource: str | None = None) -> list[dict[str, float]]:
    """The placement group of a tensor-parallel generator: one GPU per engine rank, on one node; the actor
    and its CPUs in the first bundle. Empty for an engine on one device (the actor holds its resources)."""
    if spec.tensor_parallel_size == 1:
        return []
    first = {"CPU": cpus, "GPU": 1.0, **({node_resource: 1.0} if node_resource else {})}
    return [first] + [{"GPU": 1.0} for _ in range(spec.tensor_parallel_size - 1)]


# A tensor-parallel generator's placement group, by actor id: removed with the actor
_GENERATOR_PLACEMENTS: dict[str, Any] = {}


def start_generator(
    spec: GeneratorSpec,
    index: int,
    cpus: float,
    max_restarts: int = 0,
    name_prefix: str | None = None,
    node_resource: str | None = None,
) -> Any:
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
        placement = {
            "num_gpus": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            ),
        }
    actor: Any = (
        ray.remote(StreamingGeneratorActor if spec.streaming else GeneratorActor)
        .options(
            num_cpus=cpus,
            max_restarts=max_restarts,
            max_task_retries=0,
            **placement,
            name=f"{name_prefix}-generator-{index}" if name_prefix else None,
            runtime_env={"env_vars": {**actor_env(), **engine_env(spec), "OMP_NUM_THREADS": str(max(1, int(cpus)))}},
        )
        .remote(spec, index)
    )
    if group is not None:
        _GENERATOR_PLACEMENTS[actor._actor_id.hex()] = group
    return actor


def stop_generator(actor: Any) -> None:
    """Kill a generator and release its placement group, if it has one."""
    ray.kill(actor)
    group = _GENERATOR_PLACEMENTS.pop(actor._actor_id.hex(), None)
    if group is not None:
        remove_placement_group(group)
