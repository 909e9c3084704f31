"""Ports for a process group's store: free to listen on, and likely still free when a rank binds them."""

from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS_END = 19999  # Ray's default max_worker_port: its workers listen on 10002 .. 19999


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the OS hands to outgoing connections and to bind(0) (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as lines:
            low, high = (int(word) for word in lines.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def listenable_port(tries: int = 64) -> int:
    """A port free to listen on now, chosen between Ray's worker ports and the ephemeral range.

    A rank binds it seconds later (after its process starts). A port from bind(0) lies in the ephemeral range,
    where any outgoing connection of this node (Ray's, vLLM's: many) may take it in the meantime; below that
    range only a process binding that very port can."""
    ephemeral_low, _ = ephemeral_port_range()
    candidates = range(RAY_WORKER_PORTS_END + 1, ephemeral_low)
    # the system's entropy, not the seeded module state: processes seeded alike must not pick alike
    for port in random.SystemRandom().sample(candidates, k=min(tries, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the ephemeral range on this node
        sock.bind(("", 0))
        return sock.getsockname()[1]
