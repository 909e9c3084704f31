"""A process and everything under it, read from /proc: what the sandbox needs to find a worker's real
interpreter and to kill a worker's whole tree, whatever group or session its children moved to. Linux only."""

from __future__ import annotations

import contextlib
import os
import signal
import time


def children(living_only: bool = False) -> dict[int, list[int]]:
    """Parent pid -> its children's pids, from /proc; `living_only` leaves out zombies (dead, not yet reaped)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if not (living_only and state in ("Z", "X")):
                children.setdefault(int(parent), []).append(int(entry))
    return children


def descendants(pid: int, living_only: bool = False) -> set[int]:
    """Every process under `pid`, however deep (without zombies when `living_only`)."""
    tree = children(living_only)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def send_signal(pid: int, sig: int) -> None:
    """`sig` to `pid`, unless it is gone or not ours."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_tree(pid: int, timeout_s: float = 5.0) -> set[int]:
    """Kill `pid` and every process under it, whatever group or session it moved to; returns the pids still
    alive under it after `timeout_s` (none, unless one is stuck in the kernel).

    `pid` is stopped first and killed last. Stopped, it starts nothing more; alive, it still adopts the
    orphans of what dies under it when it is a subreaper (the sandbox's workers are). So a child born while
    its parent was being killed (a fork in flight when the signal came) turns up under `pid` on the next pass,
    and is killed there, instead of escaping to init: passes repeat until nothing lives under `pid`."""
    send_signal(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    living = descendants(pid, living_only=True)
    while living and time.monotonic() < deadline:
        for child in living:
            send_signal(child, signal.SIGKILL)
        time.sleep(0.001)
        living = descendants(pid, living_only=True)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    send_signal(pid, signal.SIGKILL)
    return living


def executable(pid: int) -> str | None:
    """The program `pid` runs, resolved (None when it is gone)."""
    try:
        return os.path.realpath(f"/proc/{pid}/exe")
    except OSError:
        return None
