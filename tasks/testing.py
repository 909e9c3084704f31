"""Misbehaving verifiers for the reward-worker tests (registered only when this module is imported)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from tasks.arithmetic import Arithmetic
from tasks.base import Problem, register
from tasks.config import ArithmeticConfig


@register("faulty-arithmetic")
class FaultyArithmetic(Arithmetic):
    """Arithmetic whose verifier misbehaves when the completion asks it to."""

    def problems(self, split: str, seed: int) -> Iterator[Problem]:
        return super().problems(split, seed)

    def score(self, problem: Problem, completion: str) -> float:
        if "HANG" in completion:
            time.sleep(3600)
        if "SLOW" in completion:
            time.sleep(0.4)
        if "DIE" in completion:
            os._exit(1)
        if "RAISE" in completion:
            raise RuntimeError("verifier bug")
        if "NAN" in completion:
            return float("nan")
        if "HOG" in completion:
            hog = bytearray(4 << 30)  # 4 GiB: beyond the memory limit
            return float(len(hog))
        return super().score(problem, completion)


@register("hanging-arithmetic")
class HangingArithmetic(Arithmetic):
    """Arithmetic whose verifier hangs on every third problem, whatever the model wrote (fault tests)."""

    def score(self, problem: Problem, completion: str) -> float:
        if int(problem.problem_id.rsplit("-", 1)[-1]) % 3 == 0:
            time.sleep(3600)
        return super().score(problem, completion)


# Longer than the per-completion timeout the tests give, well within the startup timeout.
SLOW_START_S = 1.5


@register("slow-start-arithmetic")
class SlowStartArithmetic(FaultyArithmetic):
    """Faulty arithmetic whose task takes SLOW_START_S to build, like a verifier with heavy imports."""

    def __init__(self, config: ArithmeticConfig) -> None:
        time.sleep(SLOW_START_S)
        super().__init__(config)


@register("broken-start-arithmetic")
class BrokenStartArithmetic(Arithmetic):
    """Arithmetic whose task cannot be built in a worker (a missing dependency, say)."""

    def __init__(self, config: ArithmeticConfig) -> None:
        raise ImportError("no module named 'verifier_dependency'")


class MisbehavingRewardModel:
    """A reward-model scorer for the actor tests: scores a completion by its length, hangs on HANG, kills its
    process on DIE; `fail_start` raises while loading, as a model that does not fit would."""

    def __init__(self, fail_start: bool = False) -> None:
        if fail_start:
            raise RuntimeError("CUDA out of memory while loading")

    def ready(self) -> bool:
        return True

    def score(self, conversations: list[tuple[list[dict[str, str]], str]]) -> list[object]:
        from tasks.scoring import ScoreResult

        completions = [completion for _, completion in conversations]
        if any("HANG" in c for c in completions):
            time.sleep(600)
        if any("DIE" in c for c in completions):
            os._exit(1)
        return [ScoreResult(float(len(c))) for c in completions]
