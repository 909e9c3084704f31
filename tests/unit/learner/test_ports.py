"""A group's store port: free, below the ephemeral range (where outgoing connections take theirs), chosen without
touching the seeded `random` state, and the store's own error when another process holds it."""

from __future__ import annotations

import random
import socket
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from cluster.run.learner_group import address_was_taken
from learner import ports


def test_a_listenable_port_lies_between_rays_worker_ports_and_the_ephemeral_range_and_is_free():
    ephemeral_low, _ = ports.ephemeral_port_range()
    chosen = {ports.listenable_port() for _ in range(20)}
    assert all(ports.RAY_WORKER_PORTS_END < port < ephemeral_low for port in chosen), chosen
    assert len(chosen) > 1  # drawn, not the first free one: concurrent groups rarely meet
    for port in chosen:
        with socket.socket() as sock:
            sock.bind(("", port))


def test_choosing_a_port_leaves_the_seeded_random_state_alone():
    random.seed(7)
    expected = random.random()
    random.seed(7)
    ports.listenable_port()
    assert random.random() == expected


def test_without_room_below_the_ephemeral_range_the_os_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (1024, 65535))
    port = ports.listenable_port()
    assert 0 < port < 65536


def test_a_store_finding_its_port_taken_is_told_apart_from_other_failures():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports.listenable_port()))
        holder.listen()
        with pytest.raises(Exception) as taken:  # torch's DistNetworkError: the message is what a rank's death carries
            TCPStore("127.0.0.1", holder.getsockname()[1], 1, True, timedelta(seconds=5))
    assert address_was_taken(taken.value)
    assert not address_was_taken(RuntimeError("the model folder has no config.json"))
