"""kvgate.harness.client.http.abandon: the whole request reaches the server before the client
is asked whether to leave, and the client then closes its connection (what vLLM reads as an
abort) at the moment its `until` names, or at its limit; a refused connection is a
RequestFailed."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from kvgate.harness.client.http import RequestFailed, abandon


class _Server:
    """Accepts one connection, reads one HTTP request, never answers; records the body and
    whether the client hung up."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.body: dict | None = None
        self.hung_up = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += conn.recv(65536)
        self.body = json.loads(rest)
        conn.settimeout(10)
        if conn.recv(1) == b"":
            self.hung_up.set()
        conn.close()


def test_the_client_leaves_when_until_says_after_the_request_was_sent():
    srv = _Server()
    asked: list[float] = []

    def until(elapsed: float) -> str | None:
        asked.append(elapsed)
        return "now" if len(asked) >= 3 else None

    why, left = abandon(f"http://127.0.0.1:{srv.port}", "a prompt", tag="t1", until=until, limit_s=30,
                        poll_s=0.01)
    assert why == "now" and left < 5
    assert srv.hung_up.wait(5)
    assert srv.body["prompt"] == "a prompt" and srv.body["kv_transfer_params"]["kvpool"]["tag"] == "t1"


def test_the_client_leaves_at_its_limit():
    srv = _Server()
    why, left = abandon(f"http://127.0.0.1:{srv.port}", "p", tag="t2", until=lambda e: None, limit_s=0.2,
                        poll_s=0.01)
    assert why == "limit" and left >= 0.2
    assert srv.hung_up.wait(5)


def test_a_refused_connection_is_a_request_failure():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(RequestFailed):
        abandon(f"http://127.0.0.1:{port}", "p", tag="t3", until=lambda e: "x", limit_s=1)


def test_an_answer_already_there_ends_the_wait():
    """A server that answered (the stream's end) before `until` said anything: the client
    stops waiting at once and says so."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]

    def serve() -> None:
        conn, _ = sock.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: {}\n\ndata: [DONE]\n\n")
        conn.recv(1)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    why, left = abandon(f"http://127.0.0.1:{port}", "p", tag="t4", until=lambda e: None, limit_s=30, poll_s=0.01)
    assert why == "answered" and left < 10
