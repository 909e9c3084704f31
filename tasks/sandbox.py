"""Sandboxed worker subprocesses: untrusted code (verifiers, reward functions, tools) runs isolated from the caller.

A worker builds its handler once (imports included, before any clock starts), then answers the items it is
sent one by one, each in a process of its own forked from the worker (`tasks/sandbox_worker.py`: what runs inside):

- process groups: the worker starts in a session of its own and each item in a process group of its own; when
  the item returns, its group is killed (a child it left behind dies with it), and when it hangs past the
  timeout the pool stops and kills the worker's whole process tree (`tasks/process_tree.py`) and starts another;
- environment: an allowlist (`PATH`, `LANG`, `HOME` and `TMPDIR` in the worker's private directory, and the
  variables `SandboxLimits.env` names), never the caller's;
- limits (`SandboxLimits`): address space over the start-up footprint, CPU seconds per item, processes, file
  size, open files, no core dumps; a root caller's worker drops to an unprivileged user of its own once its
  handler is built, so that the process limit holds (root ignores it);
- output: an item's file descriptors 1 and 2 are a pipe the worker reads, never the caller's log; an item that
  writes more than its limit is killed and fails;
- a private working directory, emptied after each item and removed with the worker;
- `isolation: namespaces` (`auto` where the machine allows it): the worker runs under `unshare` in network,
  mount and PID namespaces of its own (a user namespace too for a caller who is not root): no network but a
  loopback that is down, the whole filesystem read-only but the private directory, and the whole namespace
  killed with the worker.

An item whose process hangs or dies gets a failed result from the pool's caller; the caller itself never runs
the untrusted code. Only a worker that cannot start (its handler cannot be built, its namespaces cannot be
made, or it is not built within the startup timeout) raises: every item would fail alike. Subprocesses, not
threads: a hung thread cannot be killed, and signal-based timeouts (math-verify's) work only in a process's
main thread. `tasks.scoring.ScorePool` and `tasks.tools.ToolPool` are its two users; docs/security.md is the
threat model.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Pipe, wait
from typing import Any, Generic, Self, TypeVar

from algorithms.errors import StableAsyncError
from tasks.process_tree import descendants, executable, kill_tree
from tasks.sandbox_worker import (
    ISOLATIONS,
    STARTED,
    Handler,
    ItemFailed,
    SandboxLimits,
    StartFailed,
    WorkerSetup,
    really_root,
)

Result = TypeVar("Result")

log = logging.getLogger(__name__)

_OUTPUT_ERROR_CHARS = 2000  # of a worker's own stderr, quoted when it cannot start


class WorkerStartError(StableAsyncError, RuntimeError):
    """A sandboxed worker could not start: every item would fail alike, so the pool's call stops here."""


class SandboxUnavailable(StableAsyncError, RuntimeError):
    """`isolation: namespaces` was asked for on a machine where the namespaces cannot be made."""


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


# ---------------------------------------------------------------- namespaces: the command and the probe


def namespace_command() -> list[str]:
    """The `unshare` prefix a namespaced worker runs under: network, mount and PID namespaces (the whole
    namespace dies with its first process, which `--kill-child` ties to unshare's life), and a user namespace
    for a caller who is not root (root makes the others without it, then drops to a user of its own)."""
    user = [] if really_root() else ["--user", "--map-root-user"]
    return [
        "unshare",
        *user,
        "--net",
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--propagation",
        "private",
    ]


_PROBE = """
import os, socket, sys
sys.path[:0] = [sys.argv[1]]
from tasks.sandbox_worker import read_only_view
read_only_view(sys.argv[2])
try:
    open("/probe-write", "w")
    print("the filesystem stayed writable"); sys.exit(1)
except OSError:
    pass
open(os.path.join(sys.argv[2], "ok"), "w").write("1")
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
except OSError as error:
    if "refused" in str(error).lower():
        print("the network stayed reachable"); sys.exit(1)
print("ok")
"""


@functools.cache
def namespaces_unavailable() -> str | None:
    """None when a namespaced worker starts on this machine (tried once per process), else why not."""
    if sys.platform != "linux":
        return f"namespaces are Linux's ({sys.platform} here)"
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="stableasync-probe-") as workdir:
        try:
            done = subprocess.run(
                [*namespace_command(), sys.executable, "-I", "-c", _PROBE, root, workdir],
                capture_output=True,
                text=True,
                timeout=30,
                cwd=workdir,
                env={"PATH": os.environ.get("PATH", os.defpath)},
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"unshare did not run: {type(error).__name__}: {error}"
    if done.returncode != 0 or done.stdout.strip() != "ok":
        said = " ".join((done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""])[-1:])
        return f"unshare {' '.join(namespace_command()[1:])} failed (exit {done.returncode}): {said[:300]}"
    return None


def resolve_isolation(isolation: str, setting: str = "sandbox.isolation") -> bool:
    """Whether workers run in namespaces: `namespaces` raises `SandboxUnavailable` (naming `setting`) where they
    cannot start; `auto` takes them where they can, and logs which it got."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"{setting}: unknown isolation {isolation!r}; one of {', '.join(ISOLATIONS)}")
    if isolation == "none":
        return False
    why = namespaces_unavailable()
    if isolation == "namespaces" and why is not None:
        raise SandboxUnavailable(
            f"{setting}: namespaces cannot start on this machine: {why} (docs/security.md; use auto or none)"
        )
    if isolation == "auto":
        _log_auto(why)
    return why is None


@functools.cache
def _log_auto(why: str | None) -> None:
    if why is None:
        log.info("sandbox.isolation auto: untrusted code runs in namespaces (no network, read-only filesystem)")
    else:
        log.warning(
            "sandbox.isolation auto: no namespaces here (%s); untrusted code runs with process limits "
            "alone, and can reach the network and every file the worker's user can",
            why,
        )


_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[2]); from tasks.sandbox_worker import worker_entry; "
    "worker_entry(int(sys.argv[1]))"
)


# ---------------------------------------------------------------- the caller's side


def sandbox_env(names: Sequence[str], home: str) -> dict[str, str]:
    """A worker's environment: PATH and LANG, HOME and TMPDIR in its private directory, and the variables named."""
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": home,
        "TMPDIR": home,
    }
    env.update({name: os.environ[name] for name in names if name in os.environ})
    return env


class _Worker:
    def __init__(self, setup: WorkerSetup, startup_timeout_s: float) -> None:
        self.conn, child = Pipe()
        self.workdir = setup.workdir
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - kept open for the worker's life: its own stderr (unshare's complaints, say): quoted if it fails to start
        prefix = namespace_command() if setup.namespaces else []
        paths = [path or os.getcwd() for path in sys.path]
        try:
            with children_ignore_sigint():
                self.process = subprocess.Popen(
                    [*prefix, sys.executable, "-I", "-c", _BOOT, str(child.fileno()), json.dumps(paths)],
                    stdin=subprocess.DEVNULL,
                    stdout=self.log,
                    stderr=self.log,
                    pass_fds=(child.fileno(),),
                    cwd=setup.workdir,
                    env=sandbox_env(setup.limits.env, setup.workdir),
                    start_new_session=True,
                )
        finally:
            child.close()
        self.conn.send(setup)
        self.started = False
        self.start_deadline = time.monotonic() + startup_timeout_s

    @property
    def worker_pid(self) -> int:
        """The pid of the worker's Python process (under unshare, unshare's child's child)."""
        tree = descendants(self.process.pid)
        pythons = [pid for pid in sorted(tree) if executable(pid) == os.path.realpath(sys.executable)]
        return pythons[0] if pythons else self.process.pid

    def output(self) -> str:
        self.log.seek(0)
        said = self.log.read(1 << 16).decode(errors="replace").strip()
        return said[-_OUTPUT_ERROR_CHARS:]

    def take_started(self, message: Any, describe: str, error: type[Exception]) -> None:
        """Read the worker's first message: it has started, or raise why it could not."""
        if isinstance(message, StartFailed):
            raise error(f"{describe} failed to start: {message.reason}")
        if message != STARTED:
            raise error(f"{describe} sent {message!r} before starting")
        self.started = True

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=1)
        self.kill()

    def kill(self) -> None:
        left = kill_tree(self.process.pid)
        if left:
            log.warning("sandbox worker %d: processes %s under it outlived SIGKILL", self.process.pid, sorted(left))
        self.process.wait()
        self.conn.close()
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class WorkerPool(Generic[Result]):
    """`workers` sandboxed subprocesses, each running `build(*args)`'s handler on one item at a time under
    `timeout_s` apiece, within `limits` (`SandboxLimits`).

    A worker's clock starts once it has built its handler: starting (imports included) may take up to
    `startup_timeout_s`, and a worker that cannot start raises `start_error` with `describe` (who the
    worker is) and the reason. `memory_limit_mb` is the address space a worker may add to what it holds
    once started. `build` must be a module-level function (it is pickled by name). Callers in several
    threads run at once, each on the workers that are free (at least one).
    """

    start_error: type[Exception] = WorkerStartError
    timeout_reason = "timeout after {timeout_s:g} s"
    died_reason = "worker died (killed or out of memory)"
    output_reason = "wrote more than {limit} bytes to stdout/stderr (sandbox max_output_chars)"

    def __init__(
        self,
        build: Callable[..., Handler],
        args: tuple[Any, ...],
        workers: int,
        timeout_s: float,
        memory_limit_mb: int | None,
        startup_timeout_s: float,
        describe: str,
        startup_setting: str,
        limits: SandboxLimits | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.limits = limits or SandboxLimits()
        self._describe, self._startup_setting = describe, startup_setting
        try:
            namespaces = resolve_isolation(self.limits.isolation)
        except SandboxUnavailable as error:
            raise self.start_error(f"{describe}: {error}") from None
        self.isolation = "namespaces" if namespaces else "none"
        self._setup = functools.partial(
            WorkerSetup,
            build,
            tuple(args),
            memory_limit_mb,
            self.limits,
            namespaces,
            build_dir=os.getcwd(),
            output_reason=self.output_reason,
            died_reason=self.died_reason,
        )
        self._workers = [self._start_worker() for _ in range(workers)]
        self._free = threading.Condition()
        self._idle = list(range(workers))

    def run_items(self, items: Sequence[Any], failed: Callable[[int, str], Result]) -> list[Result]:
        """Each item's result in order; `failed(index, reason)` is the result of an item whose process hung,
        died or wrote too much (a hung one's worker is replaced).

        The call takes the workers that are free (waiting for one when none is): another thread's call runs on
        the others meanwhile. Each worker gets a batch in one message and answers item by item: one message per
        batch, not per item, keeps the caller's share of a CPU small. The timeout still holds per item: the
        item at the head of a worker's batch must answer within `timeout_s` of the previous answer, and when it
        does not (or the worker dies) only that item fails and the rest of the batch goes back to the queue.
        """
        if not items:
            return []
        with self._free:
            while not self._idle:
                self._free.wait()
            taken = min(len(items), len(self._idle))
            mine, self._idle = self._idle[:taken], self._idle[taken:]
        try:
            return self._run_on(mine, items, failed)
        finally:
            with self._free:
                self._idle += mine
                self._free.notify_all()

    # long: one event loop over the workers: sending, deadlines and failures share its queues
    def _run_on(self, slots: list[int], items: Sequence[Any], failed: Callable[[int, str], Result]) -> list[Result]:
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
            idle = [slot for slot in slots if slot not in in_flight]
            for position, slot in enumerate(idle):
                if not todo:
                    break
                size = math.ceil(len(todo) / (len(idle) - position))
                batch = deque(todo.popleft() for _ in range(size))
                if self._send(slot, [items[i] for i in batch]):
                    in_flight[slot] = batch
                    head_deadline[slot] = time.monotonic() + self.timeout_s
                else:
                    fail_head(slot, batch, self.died_reason)
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
                            if not worker.started:
                                worker.take_started(message, self._describe, self.start_error)
                            elif isinstance(message, ItemFailed):
                                index = batch.popleft()
                                results[index] = failed(index, message.reason)
                            else:
                                results[batch.popleft()] = message
                            head_deadline[slot] = time.monotonic() + self.timeout_s
                    except (EOFError, OSError):
                        if not worker.started:
                            said = worker.output()
                            raise self.start_error(
                                f"{self._describe} failed to start: it exited "
                                f"{worker.process.poll()}" + (f": {said}" if said else "")
                            ) from None
                        fail_head(slot, batch, self.died_reason)
                elif time.monotonic() >= deadline(slot):
                    if not worker.started:
                        raise self.start_error(
                            f"{self._describe} did not start within {self.startup_timeout_s:g} s "
                            f"({self._startup_setting})"
                        )
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
        """Kill the worker in `slot` (hung or dead) and its whole process tree, and start another in its place."""
        self._workers[slot].kill()
        self._workers[slot] = self._start_worker()

    def _start_worker(self) -> _Worker:
        workdir = tempfile.mkdtemp(prefix="stableasync-sandbox-")
        return _Worker(self._setup(workdir=workdir), self.startup_timeout_s)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
