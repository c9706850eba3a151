"""kvgate.harness.client.engine_api against a stand-in server (http.server in a thread, a real
socket): the answers of `POST /reset_prefix_cache?reset_external=true` vLLM gives across
versions (0.24: 200 and no body; later: {"success": bool}) and the ones it must refuse."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvgate.harness.client import engine_api
from kvgate.harness.client.http import RequestFailed


def serve(bodies: list[bytes]):  # noqa: ANN201 - (server, url, asked)
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            asked.append(self.path)
            body = bodies[min(len(asked), len(bodies)) - 1]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", asked


@pytest.mark.parametrize("bodies,want", [
    ([b""], {"success": None, "reported": False, "tries": 1}),  # vLLM 0.24: no outcome
    ([json.dumps({"success": True}).encode()], {"success": True, "reported": True, "tries": 1}),
    ([json.dumps({"success": False}).encode(), json.dumps({"success": True}).encode()],
     {"success": True, "reported": True, "tries": 2}),  # asked again while it answers false
])
def test_reset_external_reads_each_versions_answer(bodies, want):
    server, url, asked = serve(bodies)
    try:
        got = engine_api.reset_external(url)
    finally:
        server.shutdown()
        server.server_close()
    assert {k: got[k] for k in want} == want
    assert asked[0] == "/reset_prefix_cache?reset_external=true"


@pytest.mark.parametrize("body", [b"<html>busy</html>", b"[true]"])
def test_reset_external_refuses_an_answer_it_cannot_read(body):
    server, url, _ = serve([body])
    try:
        with pytest.raises(RequestFailed):
            engine_api.reset_external(url)
    finally:
        server.shutdown()
        server.server_close()
