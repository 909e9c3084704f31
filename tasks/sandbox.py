"""Sandboxed worker subprocesses: untrusted code (verifiers, tools) run with a per-item timeout and a memory limit.

A worker builds its handler once (imports included, before any clock starts), then answers the items it is
sent one by one. An item whose worker hangs past the timeout or dies gets a failed result from the pool's
caller and the worker is killed and replaced; the caller itself never runs the untrusted code. Only a worker
that cannot start (its handler cannot be built, or is not built within the startup timeout) raises: every
item would fail alike. Subprocesses, not threads: a hung thread cannot be killed, and signal-based timeouts
(math-verify's) work only in a process's main thread. `tasks.scoring.ScorePool` and `tasks.tools.ToolPool`
are its two users.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, Self, TypeVar

from algorithms.errors import StableAsyncError

Handler = Callable[[Any], Any]  # one item in, its picklable result out; never raises for one item
Result = TypeVar("Result")

# A worker's first message once its handler is built: the per-item timeout starts only then, so a worker
# that is still importing (math-verify takes seconds on a busy machine) fails nothing.
_STARTED = "started"


@dataclass(frozen=True)
class _StartFailed:
    reason: str


class WorkerStartError(StableAsyncError, RuntimeError):
    """A sandboxed worker could not start: every item would fail alike, so the pool's call stops here."""


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


def _worker_main(conn: Connection, build: Callable[..., Handler], args: tuple[Any, ...],
                 memory_limit_mb: int | None) -> None:
    try:
        handle = build(*args)
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
        for item in message:
            conn.send(handle(item))


class _Worker:
    def __init__(self, context: Any, args: tuple[Any, ...], startup_timeout_s: float) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, *args), daemon=True)
        with children_ignore_sigint():
            self.process.start()
        child.close()
        self.started = False
        self.start_deadline = time.monotonic() + startup_timeout_s

    def take_started(self, message: Any, describe: str, error: type[Exception]) -> None:
        """Read the worker's first message: it has started, or raise why it could not."""
        if isinstance(message, _StartFailed):
            raise error(f"{describe} failed to start: {message.reason}")
        if message != _STARTED:
            raise error(f"{describe} sent {message!r} before starting")
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


class WorkerPool(Generic[Result]):
    """`workers` spawned subprocesses, each running `build(*args)`'s handler on one item at a time under
    `timeout_s` apiece.

    A worker's clock starts once it has built its handler: starting (imports included) may take up to
    `startup_timeout_s`, and a worker that cannot start raises `start_error` with `describe` (who the
    worker is) and the reason. `memory_limit_mb` is the address space a worker may add to what it holds
    once started. `build` must be a module-level function (spawn pickles it by name).
    """

    start_error: type[Exception] = WorkerStartError
    timeout_reason = "timeout after {timeout_s:g} s"
    died_reason = "worker died (killed or out of memory)"

    def __init__(self, build: Callable[..., Handler], args: tuple[Any, ...], workers: int, timeout_s: float,
                 memory_limit_mb: int | None, startup_timeout_s: float, describe: str, startup_setting: str) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._describe, self._startup_setting = describe, startup_setting
        self._context = multiprocessing.get_context("spawn")
        self._args = (build, args, memory_limit_mb)
        self._workers = [self._start_worker() for _ in range(workers)]

    def run_items(self, items: Sequence[Any], failed: Callable[[int, str], Result]) -> list[Result]:
        """Each item's result in order; `failed(index, reason)` is the result of an item whose worker hung
        or died (that worker is replaced).

        Each worker gets a batch in one message and answers item by item: one message per batch, not per
        item, keeps the caller's share of a CPU small. The timeout still holds per item: the item at the
        head of a worker's batch must answer within `timeout_s` of the previous answer, and when it does not
        (or the worker dies) only that item fails and the rest of the batch goes back to the queue.
        """
        results: list[Result | None] = [None] * len(items)
        todo = deque(range(len(items)))
        in_flight: dict[int, deque[int]] = {}  # worker slot -> its items, head being run now
        head_deadline: dict[int, float] = {}

        def fail_head(slot: int, batch: deque[int], reason: str) -> None:
            """The head item fails (its worker is replaced); the rest go back to the front of the queue."""
            index = batch.popleft()
            self._replace(slot)
            results[index] = failed(index, reason)
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
                if self._send(slot, [items[i] for i in batch]):
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
                                worker.take_started(message, self._describe, self.start_error)
                            head_deadline[slot] = time.monotonic() + self.timeout_s
                    except (EOFError, OSError):
                        fail_head(slot, batch, self.died_reason)
                elif time.monotonic() >= deadline(slot):
                    if not worker.started:
                        raise self.start_error(f"{self._describe} did not start within {self.startup_timeout_s:g} s "
                                               f"({self._startup_setting})")
                    fail_head(slot, batch, self.timeout_reason.format(timeout_s=self.timeout_s))
                if not batch:
                    del in_flight[slot], head_deadline[slot]
        return results  # type: ignore[return-value]

    def _send(self, slot: int, items: list[Any]) -> bool:
        try:
            self._workers[slot].conn.send(items)
            return True
        except (BrokenPipeError, OSError):
            return False

    def _replace(self, slot: int) -> None:
        """Kill the worker in `slot` (hung or dead) and start another in its place."""
        self._workers[slot].kill()
        self._workers[slot] = self._start_worker()

    def _start_worker(self) -> _Worker:
        return _Worker(self._context, self._args, self.startup_timeout_s)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
