"""kvpool.connector.http's check of kv_transfer_params in front of an OpenAI-style server: a request
whose kvpool section the connector would refuse is answered 400 naming the field, before
any handler runs; every other request (no params, good params, another endpoint, a body
that is not JSON) reaches the handler unchanged."""

from __future__ import annotations

import pytest

fastapi = pytest.importorskip("fastapi")  # vLLM's server is a FastAPI app
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from kvpool.connector.http import check_kv_transfer_params  # noqa: E402

REACHED: list[object] = []


async def handler(request: Request) -> JSONResponse:
    body = await request.body()
    REACHED.append(body)
    return JSONResponse({"ok": True})


@pytest.fixture
def client():
    app = FastAPI()
    app.post("/v1/completions")(handler)
    app.post("/v1/embeddings")(handler)
    app.middleware("http")(check_kv_transfer_params)  # as vLLM's --middleware adds a coroutine function
    REACHED.clear()
    return TestClient(app)


@pytest.mark.parametrize("params, field", [({"kvpool": {"publish_tokens": "x"}}, "publish_tokens"),
                                           ({"kvpool": "on"}, "kvpool must be an object"),
                                           ({"kvpool": {"load": 1}}, "load must be true or false"),
                                           ({"kvpool": {"nope": 1}}, "unknown field 'nope'"),
                                           ([1, 2], "kv_transfer_params must be an object"),
                                           ({"other": {"x": [0, 2**64]}}, "kv_transfer_params.other.x[1]: an integer"),
                                           ({"kvpool": {"tag": -(2**63) - 1}}, "kv_transfer_params.kvpool.tag")])
def test_a_bad_kvpool_section_is_refused_before_the_handler(client, params, field):
    r = client.post("/v1/completions", json={"prompt": "x", "kv_transfer_params": params})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "kv_transfer_params" and REACHED == []


@pytest.mark.parametrize("body", [{"prompt": "x"}, {"prompt": "x", "kv_transfer_params": {"kvpool": {"tag": "t"}}},
                                  {"prompt": "x", "kv_transfer_params": {"other": {"a": 2**64 - 1, "b": -(2**63)}}},
                                  "not json {"])
def test_everything_else_reaches_the_handler_unchanged(client, body):
    raw = body.encode() if isinstance(body, str) else None
    r = client.post("/v1/completions", content=raw) if raw else client.post("/v1/completions", json=body)
    assert r.status_code == 200 and len(REACHED) == 1
    assert client.post("/v1/embeddings", json={"kv_transfer_params": {"kvpool": "on"}}).status_code == 200
