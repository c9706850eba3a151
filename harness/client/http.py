"""The one HTTP client of the harness: streaming completions with TTFT, and the replicas'
health and cache-reset endpoints.

  complete(url, prompt, ...)    one streaming /v1/completions request; returns a Completion
                                with the generated token ids and their log-probabilities,
                                TTFT and total time (Completion.same_output compares both). The
                                request carries `kv_transfer_params.kvpool` (tag, load,
                                publish, publish_tokens) and an optional cache_salt. Every
                                request is written to the run's history (RECORDER) as
                                invoke, then ok or fail (Jepsen's client side).
  abandon(url, prompt, until=...) the same request, sent and then left without reading its
                                answer as soon as `until` says (vLLM aborts it): a client that
                                goes away at a moment the caller controls.
  healthy(url)                  GET /health answered 200.
  reset_prefix_cache(url)       POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1), retried
                                while the engine is busy, within a bound.
Errors: RequestFailed (an HTTP error, a malformed stream, a connection that failed).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import requests


class RequestFailed(RuntimeError):
    """The replica answered with an HTTP error or a malformed stream."""


@dataclasses.dataclass(frozen=True)
class Completion:
    tag: str
    replica: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    ttft_s: float
    total_s: float
    prompt_tokens: int
    error: str | None = None  # the replica's error event, when the stream carried one
    logprobs: list[float | None] = dataclasses.field(default_factory=list)  # of each generated token

    def same_output(self, other: Completion) -> bool:
        """The same tokens with the same log-probabilities, to the last bit: where the KV a
        request attended to differs, the log-probabilities move even when greedy tokens
        do not (the tiny model's tokens barely depend on their context)."""
        return self.token_ids == other.token_ids and self.logprobs == other.logprobs


# The harness's client side of the history (Jepsen's invoke / ok / fail): set by a
# running Cluster to a HistoryWriter of the run, so the checkers can tell a request that
# ended from one that was lost.
RECORDER = None


def _record(phase: str, **fields: object) -> None:
    if RECORDER is not None:
        RECORDER.write("request", phase=phase, **fields)


def _body(prompt: str, *, tag: str, max_tokens: int = 16, load: bool = True, publish: bool = True,
          cache_salt: str | None = None, publish_tokens: int | None = None, raw_params: dict | None = None,
          model: str = "tiny") -> dict:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "return_token_ids": True, "logprobs": 1,
        "kv_transfer_params": {"kvpool": {"tag": tag, "load": load, "publish": publish}},
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    if publish_tokens is not None:
        body["kv_transfer_params"]["kvpool"]["publish_tokens"] = publish_tokens
    body["kv_transfer_params"]["kvpool"].update(raw_params or {})
    return body


def complete(url: str, prompt: str, *, tag: str, replica: str = "", max_tokens: int = 16,
             load: bool = True, publish: bool = True, cache_salt: str | None = None,
             publish_tokens: int | None = None, timeout_s: float = 600.0,
             raw_params: dict | None = None, model: str = "tiny") -> Completion:
    """`raw_params`: more kv_transfer_params.kvpool fields, sent as they are (a scenario's
    malformed input). `model`: the served model or one of its LoRA adapters."""
    body = _body(prompt, tag=tag, max_tokens=max_tokens, load=load, publish=publish, cache_salt=cache_salt,
                 publish_tokens=publish_tokens, raw_params=raw_params, model=model)
    _record("invoke", tag=tag, replica=replica, max_tokens=max_tokens, load=load, publish=publish,
            cache_salt=cache_salt, publish_tokens=publish_tokens)
    t0 = time.monotonic()
    ttft = None
    token_ids: list[int] = []
    logprobs: list[float | None] = []
    text: list[str] = []
    finish = None
    prompt_tokens = 0
    error = None
    try:
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                raise RequestFailed(f"{replica or url}: HTTP {r.status_code}: {r.text[:500]}")
            for raw in r.iter_lines():
                if not raw or not raw.startswith(b"data: "):
                    continue
                data = raw[6:]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the engine ended the request (e.g. policy "fail")
                    error = json.dumps(chunk["error"])[:500]
                    finish = "error"
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and ttft is None:
                        ttft = time.monotonic() - t0
                    token_ids.extend(ids)
                    logprobs.extend((choice.get("logprobs") or {}).get("token_logprobs") or [])
                    text.append(choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
                    prompt_tokens = len(choice.get("prompt_token_ids") or []) or prompt_tokens
    except requests.RequestException as exc:
        _record("fail", tag=tag, replica=replica, error=f"{type(exc).__name__}: {exc}"[:300],
                total_s=round(time.monotonic() - t0, 3))
        raise RequestFailed(f"{replica or url}: {type(exc).__name__}: {exc}") from exc
    except RequestFailed as exc:
        _record("fail", tag=tag, replica=replica, error=str(exc)[:300], total_s=round(time.monotonic() - t0, 3))
        raise
    if finish == "error" and error is None:  # vLLM 0.24 ends a failed request with this finish reason alone
        error = "finish_reason: error"
    elif finish is None and error is None:
        # A complete stream always ends with a finish reason: without one the engine ended the
        # request unfinished (vLLM 0.24 so ends one whose asynchronous load failed under policy fail).
        error = f"the stream ended without a finish_reason ({len(token_ids)} tokens)"
    total = time.monotonic() - t0
    _record("ok", tag=tag, replica=replica, finish_reason=finish, tokens=len(token_ids), error=error,
            ttft_s=round(ttft if ttft is not None else total, 4), total_s=round(total, 3))
    return Completion(tag, replica, token_ids, "".join(text), finish, ttft if ttft is not None else total, total,
                      prompt_tokens, error, logprobs)


def abandon(url: str, prompt: str, *, tag: str, replica: str = "", until: Callable[[float], str | None],
            limit_s: float, poll_s: float = 0.02, **params: Any) -> tuple[str, float]:
    """Send one completion request and go away without reading its answer: the connection is
    closed as soon as `until(seconds since the send)` names a reason, or after `limit_s`
    ("limit"), or when the whole answer is already there ("answered": nothing is aborted then).
    vLLM aborts a request whose client went away. Returns (the reason, the seconds at which the
    client left). The request's bytes are all sent before `until` is first asked;
    a server that refuses the connection raises RequestFailed."""
    import http.client
    import socket
    from urllib.parse import urlsplit

    body = json.dumps(_body(prompt, tag=tag, **params)).encode()
    _record("invoke", tag=tag, replica=replica, abandon=True)
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port or 80, timeout=30)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    except OSError as exc:
        conn.close()
        _record("fail", tag=tag, replica=replica, error=f"{type(exc).__name__}: {exc}"[:300])
        raise RequestFailed(f"{replica or url}: {type(exc).__name__}: {exc}") from exc
    why = None
    try:
        while why is None:
            elapsed = time.monotonic() - t0
            why = until(elapsed) or ("limit" if elapsed >= limit_s else None)
            if why is None and _answered(conn.sock):
                why = "answered"  # the whole answer is there: nothing left to abort
            if why is None:
                time.sleep(poll_s)
    finally:  # the client goes away however `until` ended
        left = time.monotonic() - t0
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # the server closed it first (it answered and hung up): nothing left to abort
                pass
        conn.close()
    _record("abandon", tag=tag, replica=replica, why=why, left_after_s=round(left, 3))
    return why, left


def _answered(sock) -> bool:  # noqa: ANN001
    """Whether the server's whole answer is waiting on the socket (peeked, not read): the
    stream's end, or an error status."""
    import select
    import socket

    if sock is None or not select.select([sock], [], [], 0)[0]:
        return False
    try:
        data = sock.recv(1 << 20, socket.MSG_PEEK)
    except OSError:
        return True  # reset by the server: it is done with the request
    return not data or b"data: [DONE]" in data or (data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 200"))


def http_status(url: str, body: object, timeout_s: float = 120.0) -> tuple[int, str]:
    """POST `body` (any JSON) to the replica's completions endpoint, as it is: (status, text)."""
    r = requests.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    return r.status_code, r.text[:2000]


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def reset_prefix_cache(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = requests.post(f"{url}/reset_prefix_cache", timeout=10)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except requests.RequestException as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    raise RequestFailed(f"{url}: reset_prefix_cache not accepted within {timeout_s}s ({last})")
