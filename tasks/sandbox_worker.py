"""Inside a sandboxed worker (`tasks/sandbox.py` starts it): the records the pool and its workers exchange, and
what a worker does to itself before it answers anything: the read-only view of the filesystem in namespaces,
the unprivileged user it drops to, its limits, and each item run in a process group of its own with its output
captured through a pipe. Standard library only: it runs in a fresh interpreter started with `-I`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import pickle
import resource
import secrets
import select
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal, TypeVar

Handler = Callable[[Any], Any]  # one item in, its picklable result out; never raises for one item
Result = TypeVar("Result")
Isolation = Literal["none", "namespaces", "auto"]
ISOLATIONS: tuple[str, ...] = ("none", "namespaces", "auto")

log = logging.getLogger(__name__)

# A worker's first message once its handler is built: the per-item timeout starts only then, so a worker
# that is still importing (math-verify takes seconds on a busy machine) fails nothing.
STARTED = "started"
_OUTPUT_ERROR_CHARS = 2000  # of a worker's own stderr, quoted when it cannot start


@dataclass(frozen=True)
class SandboxLimits:
    """What untrusted code may use, per item (a verifier's score, a reward function's, a tool call).
    None leaves that limit off (the job schema gives each a default and refuses 0 and below)."""

    isolation: Isolation = "none"  # none | namespaces | auto (namespaces where they start, else none)
    env: tuple[str, ...] = ()  # the caller's environment variables passed on by name
    cpu_s: float | None = 60.0  # CPU seconds one item may use
    max_processes: int | None = 64  # processes and threads the worker's user may add (a fork bomb stops here)
    max_file_mb: int | None = 256  # size of any file one item writes
    max_open_files: int | None = 256
    max_output_chars: int | None = 65536  # bytes one item may write to its stdout and stderr


@dataclass(frozen=True)
class StartFailed:
    reason: str


@dataclass(frozen=True)
class ItemFailed:
    """An item whose process died, used up its CPU time or wrote too much: the pool's `failed(index, reason)`."""

    reason: str


@dataclass(frozen=True)
class WorkerSetup:
    build: Callable[..., Handler]
    args: tuple[Any, ...]
    memory_limit_mb: int | None
    limits: SandboxLimits
    namespaces: bool
    workdir: str
    build_dir: str  # the caller's working directory: a user's relative 'FILE.py:NAME' is found from there
    output_reason: str  # the pool's words for an item that wrote too much ({limit}) or died
    died_reason: str


def _initial_user_namespace() -> bool:
    """Whether this process is in the machine's own user namespace (its uid map is the identity)."""
    try:
        with open("/proc/self/uid_map") as uid_map:
            return uid_map.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def really_root() -> bool:
    """Root of the machine itself, not a user namespace's mapped root."""
    return os.getuid() == 0 and _initial_user_namespace()


_libc = None


def _syscall_libc() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


class _MountAttr(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 - ctypes reads the layout from this class attribute
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (syscalls from 424 on are unified)
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
_MS_BIND, _MS_REC = 4096, 16384


def read_only_view(workdir: str) -> None:
    """In a fresh mount namespace: every mount read-only (recursively, `mount_setattr`), `workdir` alone writable."""
    libc = _syscall_libc()
    _check(libc.mount(workdir.encode(), workdir.encode(), None, _MS_BIND | _MS_REC, None), f"bind {workdir}")
    read_only = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(
        libc.syscall(
            _SYS_MOUNT_SETATTR, _AT_FDCWD, b"/", _AT_RECURSIVE, ctypes.byref(read_only), ctypes.sizeof(read_only)
        ),
        "mount_setattr / read-only",
    )
    writable = _MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0)
    _check(
        libc.syscall(
            _SYS_MOUNT_SETATTR, _AT_FDCWD, workdir.encode(), 0, ctypes.byref(writable), ctypes.sizeof(writable)
        ),
        f"mount_setattr {workdir} writable",
    )


_PR_SET_CHILD_SUBREAPER, _PR_CAPBSET_DROP, _PR_SET_KEEPCAPS, _PR_SET_NO_NEW_PRIVS = 36, 24, 8, 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAP_DAC_READ_SEARCH = 2
_SANDBOX_UID_BASE = 2_000_000_000  # far above the ranges that users, containers and subordinate ids take


def _keep_capabilities(kept: int) -> None:
    """This process's capabilities become `kept` (a bit mask of the low 32) alone, and none can come back."""
    libc = _syscall_libc()
    for capability in range(64):
        if not kept >> capability & 1:
            libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)(kept, kept, 0, 0, 0, 0)  # effective, permitted, inheritable (low, then high)
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def _drop_privileges(workdir: str) -> str:
    """The worker gives up what the untrusted code must not have; returns what it did (for tests and logs).

    Root in the machine's own user namespace becomes a user of its own (a uid drawn above 2e9; nobody where
    that cannot be taken): the process limit then holds (root is exempt from it), and it can write only its
    own directory. It keeps the right to read and search every file (CAP_DAC_READ_SEARCH, no other), since a
    Python installed under root's home (pyenv) must still import. Root inside a user namespace of ours drops
    every capability, so that the code cannot undo the read-only mounts. No process gains privileges through
    exec (setuid programs) afterwards."""
    libc = _syscall_libc()
    done = "kept its user"
    if really_root():
        libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
        for uid in (_SANDBOX_UID_BASE + secrets.randbelow(100_000_000), 65534):
            try:
                os.chown(workdir, uid, uid)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            except OSError:
                continue
            _keep_capabilities(1 << _CAP_DAC_READ_SEARCH)
            done = f"runs as uid {uid}"
            break
    elif os.getuid() == 0:  # root of a user namespace we made
        _keep_capabilities(0)
        done = "dropped every capability"
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    return done


def _address_space_bytes() -> int:
    """This process's address space now (VmSize), or 0 where /proc cannot say."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _user_tasks(uid: int) -> int:
    """Processes and threads of `uid` that /proc shows: RLIMIT_NPROC counts them all."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields.get("Threads", "1"))
            except (OSError, KeyError, ValueError):
                continue
    return count


def _set_limits(memory_limit_mb: int | None, limits: SandboxLimits) -> None:
    """The worker's limits, which every item inherits (CPU time is set per item: it counts from zero there).
    The address space caps what the worker holds now plus `memory_limit_mb`: on top of the start-up
    footprint, not absolute, since a CUDA torch imported for a verifier alone maps gigabytes it never touches.
    The process limit counts the user's processes now plus `max_processes`."""

    def cap(kind: int, value: int) -> None:
        hard = resource.getrlimit(kind)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    if limits.max_file_mb is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, kills nothing
        cap(resource.RLIMIT_FSIZE, limits.max_file_mb << 20)
    if limits.max_open_files is not None:
        cap(resource.RLIMIT_NOFILE, limits.max_open_files)
    if limits.max_processes is not None:
        cap(resource.RLIMIT_NPROC, _user_tasks(os.getuid()) + limits.max_processes)
    if memory_limit_mb is not None:
        cap(resource.RLIMIT_AS, _address_space_bytes() + (memory_limit_mb << 20))


def _empty(directory: str) -> None:
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass


def _died_reason(status: int, limits: SandboxLimits, died: str) -> str:
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
        return f"used more than {limits.cpu_s:g} CPU seconds (sandbox cpu_s)"
    return died


def _reap_group(pgid: int) -> None:
    """Kill what is left of process group `pgid` and reap it: its members reparent to the worker (a subreaper),
    and each zombie would count against the process limit of the items to come."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        try:
            reaped = os.waitpid(-pgid, os.WNOHANG)[0]  # one member at a time, until none is left
        except ChildProcessError:  # members left whose parent is not the worker yet: they are on their way
            reaped = 0
        if not reaped:
            time.sleep(0.001)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:  # orphans that left the group, reparented here
            pass


def _complete(chunks: list[bytes]) -> bool:
    """Whether the chunks hold a whole framed result (its length in 8 bytes, then the pickle)."""
    data = b"".join(chunks[:1]) if len(chunks) == 1 else b"".join(chunks)
    return len(data) >= 8 and len(data) >= 8 + int.from_bytes(data[:8], "little")


# long: a forked child's whole life, fork to reaping, so every pipe it opens is closed in one finally
def _run_item(handle: Handler, item: Any, setup: WorkerSetup) -> Any:
    """One item in a process forked from the worker, in a process group of its own that is killed when it
    returns; its stdout and stderr are a pipe read here and cut at `max_output_chars`."""
    limits = setup.limits
    out_read, out_write = os.pipe()
    result_read, result_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the item's process
        try:
            os.setpgid(0, 0)
            os.close(out_read)
            os.close(result_read)
            os.dup2(out_write, 1)
            os.dup2(out_write, 2)
            os.close(out_write)
            if limits.cpu_s is not None:
                seconds = max(1, math.ceil(limits.cpu_s))
                resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
            data = pickle.dumps(handle(item))
            view = memoryview(len(data).to_bytes(8, "little") + data)  # framed: its children hold the pipe too
            while view:
                view = view[os.write(result_write, view) :]
        finally:
            os._exit(0)
    os.close(out_write)
    os.close(result_write)
    cap = limits.max_output_chars
    chunks: list[bytes] = []
    written = 0
    open_fds = {out_read, result_read}
    try:
        while result_read in open_fds and not _complete(chunks):  # its stdout (a child's too) may outlive it
            ready, _, _ = select.select(sorted(open_fds), [], [])
            if out_read in ready:
                chunk = os.read(out_read, 1 << 16)
                written += len(chunk)
                if not chunk:  # it closed its stdout and stderr: the result alone is read from here on
                    open_fds.discard(out_read)
                    os.close(out_read)
                elif cap is not None and written > cap:
                    break
            if result_read in ready:
                chunk = os.read(result_read, 1 << 16)
                if chunk:
                    chunks.append(chunk)
                else:
                    open_fds.discard(result_read)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        _reap_group(pid)
        if out_read in open_fds:
            os.set_blocking(out_read, False)
            with contextlib.suppress(BlockingIOError):
                while cap is None or written <= cap:
                    chunk = os.read(out_read, 1 << 16)
                    if not chunk:
                        break
                    written += len(chunk)
        for fd in open_fds:
            os.close(fd)
        _empty(setup.workdir)
    if cap is not None and written > cap:
        return ItemFailed(setup.output_reason.format(limit=cap))
    if not _complete(chunks):
        return ItemFailed(_died_reason(status, limits, setup.died_reason))
    try:
        return pickle.loads(b"".join(chunks)[8:])
    except Exception:
        return ItemFailed(_died_reason(status, limits, setup.died_reason))


def worker_entry(fd: int) -> None:
    """A worker's main: set up, build the handler, then answer items until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    setup: WorkerSetup = conn.recv()
    try:
        if setup.namespaces:
            read_only_view(setup.workdir)
        with contextlib.suppress(OSError):
            os.chdir(setup.build_dir)
        handle = setup.build(*setup.args)
        os.chdir(setup.workdir)
        _syscall_libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans come here, to be killed
        _drop_privileges(setup.workdir)
        _set_limits(setup.memory_limit_mb, setup.limits)
    except BaseException as error:
        conn.send(StartFailed(f"{type(error).__name__}: {error}"[:300]))
        return
    conn.send(STARTED)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        for item in message:
            conn.send(_run_item(handle, item, setup))
