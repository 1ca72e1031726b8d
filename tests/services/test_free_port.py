"""`free_port` (services/broker.py): the port a test or `tandem up` hands a child to bind.

A CI run failed because a gateway's port, chosen by bind(0), was handed to an outgoing
connection before the gateway bound it. These check the properties that prevent it: the port is
outside the kernel's range for outgoing connections, free, and never handed out twice."""

from __future__ import annotations

import socket

from services import broker
from services.broker import free_port


def test_ports_are_below_the_kernels_range_for_outgoing_connections():
    low, _ = broker._ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(p < low for p in ports), (low, ports)


def test_a_port_is_never_handed_out_twice_and_each_one_binds():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if something holds it


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # make the walk start right at the held port (its offset from the lowest port)
        monkeypatch.setattr(broker, "_LOWEST_PORT", taken)
        monkeypatch.setattr(broker, "_ephemeral_range", lambda: (taken + 5000, 65535))
        monkeypatch.setattr(broker.os, "getpid", lambda: 0)
        monkeypatch.setattr(broker, "_HANDED_OUT", set())
        port = free_port()
        assert taken < port < taken + 5000  # the walk went past the held port to the next free one
