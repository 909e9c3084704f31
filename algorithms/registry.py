"""Stabilizers by name: `STABILIZERS` lists what a job may select; `get`, `build` and `from_config` resolve it."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# Importing the implementation modules registers them.
from algorithms import bapo, clipping, importance, m2po, vcpo  # noqa: F401
from algorithms.config import STABILIZER_CONFIGS
from algorithms.stabilizer import REGISTRY, Stabilizer

STABILIZERS: Mapping[str, type[Stabilizer]] = MappingProxyType(REGISTRY)
"""Registered stabilizer classes by name (iterating gives the names)."""

_missing = set(STABILIZER_CONFIGS) ^ set(REGISTRY)
if _missing:
    raise ImportError(f"stabilizer configs and implementations disagree on {sorted(_missing)}")


def get(name: str) -> type[Stabilizer]:
    """The stabilizer class registered as `name`; the error lists the valid names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown stabilizer {name!r}; registered: {', '.join(sorted(REGISTRY))}") from None


def build(name: str, **config: Any) -> Stabilizer:
    """Instantiate `name` with its typed config; unknown config keys raise TypeError naming them."""
    return get(name)(STABILIZER_CONFIGS[name](**config))


def from_config(name: str, config: Any | None) -> Stabilizer:
    """Instantiate `name` with its validated config dataclass as the job gave it (None: the defaults); a config
    of another stabilizer raises TypeError naming both."""
    return get(name)(config)
