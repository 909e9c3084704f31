"""Reward workers: verifiers run in subprocesses with a timeout and an optional memory limit.

A verifier that raises, hangs, exhausts memory, dies or returns a non-finite value marks that sample
failed (reward 0.0 and the reason) and never stops the caller. Only a worker that cannot start (its
task cannot be built, or is not built within the startup timeout) raises: every sample would fail
alike. Subprocesses, not threads: math-verify's own timeout is signal-based and works only in a
process's main thread, and a hung thread cannot be killed.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from algorithms.errors import StableAsyncError
from tasks.base import Problem, Task, build_task


@dataclass(frozen=True)
class ScoreResult:
    reward: float
    error: str | None = None
    # composite rewards (`tasks.rewards.CompositeScorer`): each component's score by its kind, the failed ones left out
    components: dict[str, float] = field(default_factory=dict)


def checked_score(task: Task, problem: Problem, completion: str) -> ScoreResult:
    """Score one completion, turning every verifier failure into a failed result."""
    try:
        reward = task.score(problem, completion)
    except MemoryError:
        return ScoreResult(0.0, "verifier ran out of memory")
    except Exception as error:  # noqa: BLE001 - any verifier bug is a failed sample, not a dead job
        return ScoreResult(0.0, f"raised {type(error).__name__}: {error}"[:300])
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return ScoreResult(0.0, f"non-numeric reward {type(reward).__name__}")
    if not math.isfinite(reward):
        return ScoreResult(0.0, f"non-finite reward {reward}")
    return ScoreResult(float(reward))


def score_inline(task: Task, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
    """In-process scoring with the same failure handling (no timeout): for tests and trusted tasks."""
    return [checked_score(task, p, c) for p, c in zip(problems, completions, strict=True)]


# A worker's first message once its task is built: the per-completion timeout starts only then, so
# a worker that is still importing (math-verify takes seconds on a busy machine) fails nothing.
_STARTED = "started"


@dataclass(frozen=True)
class _StartFailed:
    reason: str


class RewardWorkerError(StableAsyncError, RuntimeError):
    """A reward worker could not start: every completion would fail alike, so scoring stops here."""


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started inside ignore SIGINT for life (an ignored signal stays ignored across exec).

    A terminal's Ctrl-C reaches every process of its foreground group: the driver decides how a run stops
    (`cluster.run.stopping`), and verifier workers that died of it would fail the completions they held,
    print tracebacks and be replaced one spawn at a time while the run stops. (The local Ray cluster's
    services block SIGINT themselves.) A Ctrl-C during the start is ignored, the caller's own too; only
    the main thread can set signal handlers, elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _address_space_bytes() -> int:
    """This process's address space now (VmSize), or 0 where /proc cannot say."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _limit_address_space(headroom_bytes: int) -> None:
    """Cap the address space at what the worker holds now plus `headroom_bytes`. On top of the start-up
    footprint, not absolute: a spawned worker re-imports the parent's main module, and a CUDA torch
    there alone maps gigabytes the verifier never touches."""
    import resource

    limit = _address_space_bytes() + headroom_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _worker_main(conn: Connection, task_name: str, task_config: Any, memory_limit_mb: int | None,
                 extra_modules: tuple[str, ...]) -> None:
    try:
        for module in extra_modules:
            importlib.import_module(module)
        task = build_task(task_name, task_config)
        if memory_limit_mb is not None:
            _limit_address_space(memory_limit_mb << 20)
    except BaseException as error:  # noqa: BLE001 - reported to the pool, which names it
        conn.send(_StartFailed(f"{type(error).__name__}: {error}"[:300]))
        return
    conn.send(_STARTED)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        for problem, completion in message:
            conn.send(checked_score(task, problem, completion))


class _Worker:
    def __init__(self, context: Any, args: tuple[Any, ...], startup_timeout_s: float) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, *args), daemon=True)
        with children_ignore_sigint():
            self.process.start()
        child.close()
        self.started = False
        self.start_deadline = time.monotonic() + startup_timeout_s

    def take_started(self, message: Any, task_name: str) -> None:
        """Read the worker's first message: it has started, or raise why it could not."""
        if isinstance(message, _StartFailed):
            raise RewardWorkerError(f"reward worker for task {task_name!r} failed to start: {message.reason}")
        if message != _STARTED:
            raise RewardWorkerError(f"reward worker for task {task_name!r} sent {message!r} before starting")
        self.started = True

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=1)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class ScorePool:
    """`max_workers` verifier subprocesses, each scoring one completion at a time under `timeout_s` apiece.

    A worker's clock starts once it has built its task: starting (imports included) may take up to
    `startup_timeout_s`, and a worker that cannot start raises `RewardWorkerError` naming the task.
    `memory_limit_mb` is the address space a worker may add to what it holds once started.
    """

    def __init__(self, task_name: str, task_config: Any, max_workers: int = 1, timeout_s: float = 5.0,
                 memory_limit_mb: int | None = None, extra_modules: tuple[str, ...] = (),
                 startup_timeout_s: float = 120.0) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._task_name = task_name
        self._context = multiprocessing.get_context("spawn")
        self._args = (task_name, task_config, memory_limit_mb, tuple(extra_modules))
        self._workers = [self._start_worker() for _ in range(max_workers)]
        self.failures = 0

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
        """Score in order; each worker gets a batch in one message and answers item by item.

        One message per batch, not per completion, keeps the caller's share of a CPU small. The
        timeout still holds per completion: the item at the head of a worker's batch must answer
        within `timeout_s` of the previous answer, and when it does not (or the worker dies) only that
        item fails and the rest of the batch goes back to the queue.
        """
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        results: list[ScoreResult | None] = [None] * len(problems)
        todo = deque(range(len(problems)))
        in_flight: dict[int, deque[int]] = {}  # worker slot -> its items, head being scored now
        head_deadline: dict[int, float] = {}

        def fail_head(slot: int, batch: deque[int], reason: str) -> None:
            """The head item fails (its worker is replaced); the rest go back to the front of the queue."""
            results[batch.popleft()] = self._fail(slot, reason)
            todo.extendleft(reversed(batch))
            batch.clear()

        def deadline(slot: int) -> float:
            worker = self._workers[slot]
            return head_deadline[slot] if worker.started else worker.start_deadline

        while todo or in_flight:
            idle = [slot for slot in range(len(self._workers)) if slot not in in_flight]
            for position, slot in enumerate(idle):
                if not todo:
                    break
                size = math.ceil(len(todo) / (len(idle) - position))
                batch = deque(todo.popleft() for _ in range(size))
                if self._send(slot, [(problems[i], completions[i]) for i in batch]):
                    in_flight[slot] = batch
                    head_deadline[slot] = time.monotonic() + self.timeout_s
                else:
                    fail_head(slot, batch, "worker died")
            if not in_flight:
                continue
            remaining = max(0.0, min(deadline(slot) for slot in in_flight) - time.monotonic())
            ready = set(wait([self._workers[slot].conn for slot in in_flight], timeout=remaining))
            for slot in list(in_flight):
                batch = in_flight[slot]
                worker = self._workers[slot]
                if worker.conn in ready:
                    try:
                        while worker.conn.poll() and batch:
                            message = worker.conn.recv()
                            if worker.started:
                                results[batch.popleft()] = message
                            else:
                                worker.take_started(message, self._task_name)
                            head_deadline[slot] = time.monotonic() + self.timeout_s
                    except (EOFError, OSError):
                        fail_head(slot, batch, "worker died (killed or out of memory)")
                elif time.monotonic() >= deadline(slot):
                    if not worker.started:
                        raise RewardWorkerError(f"reward worker for task {self._task_name!r} did not start "
                                                f"within {self.startup_timeout_s:g} s (ScorePool startup_timeout_s)")
                    fail_head(slot, batch, f"timeout after {self.timeout_s:g} s")
                if not batch:
                    del in_flight[slot], head_deadline[slot]
        self.failures += sum(r.error is not None for r in results if r is not None)
        return results  # type: ignore[return-value]

    def _send(self, slot: int, items: list[tuple[Problem, str]]) -> bool:
        try:
            self._workers[slot].conn.send(items)
            return True
        except (BrokenPipeError, OSError):
            return False

    def _fail(self, slot: int, reason: str) -> ScoreResult:
        """Replace the worker in `slot` (hung or dead) and report the sample as failed."""
        self._workers[slot].kill()
        self._workers[slot] = self._start_worker()
        return ScoreResult(0.0, reason)

    def _start_worker(self) -> _Worker:
        return _Worker(self._context, self._args, self.startup_timeout_s)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> ScorePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
