"""An HTTP check of kvpool's per-request parameters in front of vLLM's OpenAI server:
a request whose `kv_transfer_params` kvpool cannot take is answered 400, naming the
field, before it reaches the engine.

    vllm serve MODEL --middleware kvpool.http.check_kv_transfer_params ...

Without it the connector serves such a request without the pool (nothing loaded or
published) and writes `invalid_params` to the history: a malformed request never reaches a
scheduler hook as an exception either way. The check reads the body only of POSTs to the
generation endpoints; a body that is not a JSON object is left to vLLM's own validation.
"""

from __future__ import annotations

import json

from kvpool.connector import RequestParams

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


async def check_kv_transfer_params(request, call_next):  # noqa: ANN001, ANN201 - Starlette's http middleware
    if request.method != "POST" or request.url.path not in ENDPOINTS:
        return await call_next(request)
    body = await request.body()
    try:
        doc = json.loads(body)
    except ValueError:  # vLLM answers a malformed body itself
        return await call_next(request)
    if not isinstance(doc, dict) or "kv_transfer_params" not in doc:
        return await call_next(request)
    params = RequestParams.parse(doc["kv_transfer_params"])
    if params.error is None:
        return await call_next(request)
    from starlette.responses import JSONResponse

    return JSONResponse(status_code=400, content={"error": {
        "message": params.error, "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}})
