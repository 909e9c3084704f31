"""The driver's part of a checkpoint (`driver.json`): what the loop needs to go on where it stopped.

One dataclass, so the keys a checkpoint must hold, how they are written and how they are read back are
spelt once. The learner ranks' own state is saved beside it by DeepSpeed.
"""

from __future__ import annotations

import random
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from actors.buffer import ScoredGroup
from actors.generator import GenerationRequest
from algorithms.errors import StableAsyncError
from tasks.base import Problem


class UnreadableState(StableAsyncError, ValueError):
    """A checkpoint's driver.json lacks a key or holds one of the wrong shape."""


@dataclass
class InFlight:
    """A group issued and not yet back at the checkpoint, with its problem (to score it on resume)."""

    request: GenerationRequest
    problem: Problem


@dataclass
class DriverState:
    version: int  # learner optimizer steps taken
    next_group_id: int
    problems_drawn: int  # the train problems drawn so far (a resume draws them again to reach the same point)
    rng: list[Any]  # random.Random.getstate() as JSON: [version, internal state, gauss]
    ready: list[ScoredGroup]  # scored, buffered, not yet trained
    in_flight: list[InFlight]  # issued and not yet scored: issued again on resume
    rewards: list[float]  # each step's mean reward so far
    restarts: list[tuple[int, int]]  # (generator index, restarts so far)
    ledger_lines: int  # lines of ledger.jsonl, metrics.jsonl and samples.jsonl that the checkpoint covers
    metrics_lines: int
    samples_lines: int | None = None  # None in checkpoints written before samples were logged
    evaluating: list[int] = field(default_factory=list)  # policy versions still being evaluated

    @staticmethod
    def rng_state(rng: random.Random) -> list[Any]:
        version, internal, gauss = rng.getstate()
        return [version, list(internal), gauss]

    def restore_rng(self, rng: random.Random) -> None:
        version, internal, gauss = self.rng
        rng.setstate((version, tuple(internal), gauss))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DriverState:
        missing = sorted(name for name in REQUIRED_KEYS if name not in data)
        if missing:
            raise UnreadableState(f"driver.json lacks {missing}")
        try:
            known = {f.name for f in fields(cls)}
            values = {key: value for key, value in data.items() if key in known}
            values["ready"] = [ScoredGroup(**group) for group in data["ready"]]
            values["in_flight"] = [
                InFlight(_request(item["request"]), Problem(**item["problem"])) for item in data["in_flight"]
            ]
            values["restarts"] = [(int(index), int(count)) for index, count in data["restarts"]]
            return cls(**values)
        except (KeyError, TypeError, ValueError) as error:
            raise UnreadableState(f"driver.json does not read back: {type(error).__name__}: {error}") from error


def _request(written: dict[str, Any]) -> GenerationRequest:
    """A request as `to_json` wrote it (its problem as a dict, or none: older checkpoints have no such key)."""
    problem = written.get("problem")
    return GenerationRequest(**{**written, "problem": Problem(**problem) if problem else None})


# the keys every checkpoint holds; those with a default came later, and older checkpoints lack them
REQUIRED_KEYS = tuple(f.name for f in fields(DriverState) if f.default is MISSING and f.default_factory is MISSING)
