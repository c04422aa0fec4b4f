"""tahnode.tools.swarm.free_port: the ports the harness and the demo give their coordinators are free,
and below the kernel's ephemeral range, where no socket bound to port 0 can take them meanwhile."""

from __future__ import annotations

import socket

from tahnode.tools import swarm


def test_free_ports_are_free_and_below_the_ephemeral_range():
    low, high = swarm.ephemeral_ports()
    assert 1024 <= low < high
    ports = [swarm.free_port() for _ in range(50)]
    assert all(swarm.FIRST_CHOSEN_PORT <= port < low for port in ports)
    assert len(set(ports)) > 40  # drawn at random: two harnesses at once seldom pick the same
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binds


def test_a_taken_port_is_never_given_and_a_range_without_room_falls_back_to_an_ephemeral_port(monkeypatch):
    first = swarm.FIRST_CHOSEN_PORT
    monkeypatch.setattr(swarm, "ephemeral_ports", lambda: (first + 100, 60999))
    taken = []
    try:
        for port in range(first, first + 100):  # every port it may draw (one another process holds is taken too)
            s = socket.socket()
            taken.append(s)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        port = swarm.free_port()
    finally:
        for s in taken:
            s.close()
    assert not first <= port < first + 100 and port >= 1024  # none of them: one from the kernel's range
    monkeypatch.setattr(swarm, "ephemeral_ports", lambda: (first + 10, 60999))  # no room below the range
    assert not first <= swarm.free_port() < first + 10
