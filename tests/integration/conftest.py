"""The local Ray cluster the whole-job tests share, one per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    ray = pytest.importorskip("ray")
    import os

    os.environ["STABLEASYNC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    ray.init(
        address="local",
        num_cpus=3,
        include_dashboard=False,
        namespace="stableasync-tests",
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        runtime_env={"env_vars": __import__("cluster.run.ray_cluster", fromlist=["actor_env"]).actor_env()},
    )
    yield
    ray.shutdown()
