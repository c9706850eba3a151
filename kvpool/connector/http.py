"""An HTTP check of kvpool's per-request parameters in front of vLLM's OpenAI server:
a request whose `kv_transfer_params` kvpool cannot take is answered 400, naming the
field, before it reaches the engine.

    vllm serve MODEL --middleware kvpool.connector.http.check_kv_transfer_params ...

Without it the connector serves such a request without the pool (nothing loaded or
published) and writes `invalid_params` to the history: a malformed request never reaches a
scheduler hook as an exception either way. It also answers 400 to `kv_transfer_params`
holding an integer the engine cannot carry (msgpack's 64-bit range: vLLM's front end fails
to send such a request to its engine core and answers 500). The check reads the body only
of POSTs to the generation endpoints; a body that is not a JSON object is left to vLLM's
own validation.
"""

from __future__ import annotations

import json

from kvpool.connector.params import RequestParams

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
INT_RANGE = (-(2**63), 2**64 - 1)  # what msgpack carries between vLLM's front end and its engine core


def unencodable(value: object, path: str = "kv_transfer_params") -> str | None:
    """The path of the first integer in `value` outside INT_RANGE, if any."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return path if not INT_RANGE[0] <= value <= INT_RANGE[1] else None
    if isinstance(value, dict):
        items = ((f"{path}.{k}", v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub, v in items:
        found = unencodable(v, sub)
        if found is not None:
            return found
    return None


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
    error = RequestParams.parse(doc["kv_transfer_params"]).error
    wide = unencodable(doc["kv_transfer_params"])
    if wide is not None:
        error = f"{wide}: an integer outside the 64-bit range the engine can carry"
    if error is None:
        return await call_next(request)
    from starlette.responses import JSONResponse

    return JSONResponse(status_code=400, content={"error": {
        "message": error, "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}})
