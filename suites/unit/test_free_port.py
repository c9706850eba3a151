"""kvgate.harness.system.cluster.free_port never hands out a port twice in one process: the
kernel may bind two sockets in a row to the same ephemeral port, and two replicas told one port
leave the second without a server while the first answers its health checks and its requests
(a fresh-clone make test: replicas A and C both on :45859, C's requests served by A)."""

from __future__ import annotations

import kvgate.harness.system.cluster as cluster


class _Sock:
    ports = [45859, 45859, 45859, 45860]

    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, addr) -> None:  # noqa: ANN001
        self.port = _Sock.ports.pop(0)

    def getsockname(self):  # noqa: ANN201
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_gives_again_is_not_handed_out_twice(monkeypatch):
    monkeypatch.setattr(cluster, "_HANDED", set())
    monkeypatch.setattr(cluster.socket, "socket", lambda *a, **k: _Sock())
    assert [cluster.free_port(), cluster.free_port()] == [45859, 45860]


def test_real_ports_are_distinct_and_bindable():
    import socket

    ports = [cluster.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
