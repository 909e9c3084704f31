"""Joining or starting the Ray cluster, the environment every actor of a job gets, and what the nodes see."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from algorithms import native

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Environment every actor of a job gets: a shared cache of built ops, no noise (a generator adds its engine's).
ACTOR_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(PROJECT_ROOT)}
# ... and, unless logging.engine_logs, engines that say only what went wrong: vLLM's start-up alone is 40 lines
QUIET_ENGINES = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore",
}


def quiet_engines_here() -> None:
    """The same quiet for engines this process runs itself (`stableasync evaluate`); a variable already set wins.
    Its interpreter and torch have started, so their warnings are quieted here too, not by the variables."""
    for name, value in QUIET_ENGINES.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("vllm", "torch._library"):
        logging.getLogger(name).setLevel(logging.ERROR)


def actor_env() -> dict[str, str]:
    env = dict(ACTOR_ENV)
    env["TORCH_EXTENSIONS_DIR"] = str(native.extensions_dir())  # DeepSpeed's op and the fused scans
    if os.environ.get("WANDB_API_KEY"):
        env["WANDB_API_KEY"] = os.environ["WANDB_API_KEY"]  # passed through, never written to the run dir
    return env


def connect(address: str | None, num_cpus: int | None, namespace: str, engine_logs: bool = True) -> None:
    """Join the cluster at `address` (or the one a submitted Ray job runs in, from RAY_ADDRESS), or start a
    small local one (no dashboard, no prestarted workers). Without `engine_logs` every actor's engines are quiet
    (each actor's own env_vars are merged over these, key by key); the actors' lines carry no colour codes when
    the console is not a terminal."""
    if ray.is_initialized():
        return
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    runtime_env = {"env_vars": {**actor_env(), **({} if engine_logs else QUIET_ENGINES)}}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
        return
    ray.init(  # "local": a new cluster even if another one's address file is lying around
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace=namespace,
        runtime_env=runtime_env,
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
    refs = [
        _missing.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(paths)
        for node in nodes
    ]
    return {node: missing for node, missing in zip(nodes, ray.get(refs)) if missing}
