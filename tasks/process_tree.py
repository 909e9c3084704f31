"""A process and everything under it, read from /proc: what the sandbox needs to find a worker's real
interpreter and to kill a worker's whole tree, whatever group or session its children moved to. Linux only."""

from __future__ import annotations

import contextlib
import os
import signal


def children() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    return children


def descendants(pid: int) -> set[int]:
    """Every process under `pid`, however deep."""
    tree = children()
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


def kill_tree(pid: int) -> None:
    """Kill `pid` and every process under it, whatever group or session it moved to: stop them all first (a
    stopped process forks no more), until no new one appears, then kill them."""
    stopped: set[int] = set()
    for _ in range(50):
        tree = descendants(pid) - stopped
        if not tree:
            break
        for child in tree:
            send_signal(child, signal.SIGSTOP)
        stopped |= tree
    for child in stopped:
        send_signal(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    send_signal(pid, signal.SIGKILL)


def executable(pid: int) -> str | None:
    """The program `pid` runs, resolved (None when it is gone)."""
    try:
        return os.path.realpath(f"/proc/{pid}/exe")
    except OSError:
        return None
