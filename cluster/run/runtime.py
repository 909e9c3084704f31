"""Ray's side of a run, re-exported from the modules that hold it: the cluster connection and node checks
(`ray_cluster`), the learner group (`learner_group`), the weight publishers (`publishers`) and the generator
actors (`generator_actors`). Callers import from here."""

from cluster.run.generator_actors import (
    GeneratorActor,
    StreamingGeneratorActor,
    generator_bundles,
    start_generator,
    stop_generator,
)
from cluster.run.learner_group import LearnerActor, LearnerGroup, LearnerGroupBroken, PlacementTimeout, Rendezvous
from cluster.run.publishers import CollectivePublisher, ObjectStorePublisher, WeightGroupClosed
from cluster.run.ray_cluster import (
    ACTOR_ENV,
    PROJECT_ROOT,
    actor_env,
    cluster_resources,
    connect,
    paths_missing_on_nodes,
)

__all__ = [
    "ACTOR_ENV",
    "PROJECT_ROOT",
    "CollectivePublisher",
    "GeneratorActor",
    "LearnerActor",
    "LearnerGroup",
    "LearnerGroupBroken",
    "ObjectStorePublisher",
    "PlacementTimeout",
    "Rendezvous",
    "StreamingGeneratorActor",
    "WeightGroupClosed",
    "actor_env",
    "cluster_resources",
    "connect",
    "generator_bundles",
    "paths_missing_on_nodes",
    "start_generator",
    "stop_generator",
]
