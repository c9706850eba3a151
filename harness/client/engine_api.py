"""vLLM's server endpoints besides completions that the conformance scenarios drive (a
server started with VLLM_SERVER_DEV_MODE=1 for the development ones, and with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for the adapters'):

  reset_external(url)              POST /reset_prefix_cache?reset_external=true: the local
                                   prefix cache and the connector's (vLLM's reset_cache),
                                   asked again while the answer is {"success": false} (held
                                   blocks, a connector that asks to retry), within a bound. A
                                   server that answers 200 with no body (vLLM 0.24: it reports
                                   no outcome) is asked once: success None, reported False.
  reload_weights(url, path)        POST /collective_rpc reload_weights(weights_path=...):
                                   the workers load other weights in place (a weight update:
                                   the served model's name and files do not change).
  load_adapter / unload_adapter    POST /v1/load_lora_adapter, /v1/unload_lora_adapter.
  prompt_logprobs(url, prompt)     one non-streaming completion asking for prompt_logprobs.
Errors: RequestFailed (an HTTP error, a connection that failed, an answer that says no).
"""

from __future__ import annotations

import dataclasses
import time

import requests

from kvgate.harness.client import http
from kvgate.harness.client.http import RequestFailed


def _post(url: str, path: str, timeout_s: float, **kw: object) -> requests.Response:
    try:
        return requests.post(f"{url}{path}", timeout=timeout_s, **kw)
    except requests.RequestException as exc:
        raise RequestFailed(f"{url}{path}: {type(exc).__name__}: {exc}") from exc


def reset_external(url: str, timeout_s: float = 60.0) -> dict:
    """{"success": the last answer, "tries": how many, "seconds": ..., "answers": the distinct
    answers}: asked again every 0.2 s while it answers success false, until `timeout_s`."""
    t0 = time.monotonic()
    tries, answers = 0, []
    while True:
        tries += 1
        r = _post(url, "/reset_prefix_cache", 30.0, params={"reset_external": "true"})
        if r.status_code != 200:
            raise RequestFailed(f"{url}: reset_prefix_cache?reset_external=true: HTTP {r.status_code}: {r.text[:300]}")
        if not r.content.strip():  # vLLM 0.24: 200 and nothing else, whatever the reset did
            return {"success": None, "reported": False, "tries": tries, "seconds": round(time.monotonic() - t0, 2),
                    "answers": []}
        try:
            body = r.json()
        except ValueError as exc:
            raise RequestFailed(f"{url}: reset_prefix_cache?reset_external=true answered what is not JSON: "
                                f"{r.text[:300]!r}") from exc
        if not isinstance(body, dict):
            raise RequestFailed(f"{url}: reset_prefix_cache?reset_external=true answered {body!r}, not an object")
        if body not in answers:
            answers.append(body)
        if body.get("success") or time.monotonic() - t0 > timeout_s:
            return {"success": bool(body.get("success")), "reported": True, "tries": tries,
                    "seconds": round(time.monotonic() - t0, 2), "answers": answers}
        time.sleep(0.2)


def reload_weights(url: str, weights_path: str, timeout_s: float = 300.0) -> None:
    r = _post(url, "/collective_rpc", timeout_s,
              json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}})
    if r.status_code != 200:
        raise RequestFailed(f"{url}: reload_weights from {weights_path}: HTTP {r.status_code}: {r.text[:300]}")


def load_adapter(url: str, name: str, path: str, *, inplace: bool = False, timeout_s: float = 120.0) -> None:
    r = _post(url, "/v1/load_lora_adapter", timeout_s,
              json={"lora_name": name, "lora_path": str(path), "load_inplace": inplace})
    if r.status_code != 200:
        raise RequestFailed(f"{url}: load_lora_adapter {name} from {path}: HTTP {r.status_code}: {r.text[:300]}")


def unload_adapter(url: str, name: str, timeout_s: float = 120.0) -> None:
    r = _post(url, "/v1/unload_lora_adapter", timeout_s, json={"lora_name": name})
    if r.status_code != 200:
        raise RequestFailed(f"{url}: unload_lora_adapter {name}: HTTP {r.status_code}: {r.text[:300]}")


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    tag: str
    replica: str
    prompt_tokens: int  # the engine's count (usage.prompt_tokens)
    entries: list  # one per prompt token: None (the first) or {token id: {logprob, rank, ...}}
    token_ids: list[int]  # the generated tokens
    logprobs: list  # of each generated token

    def computed(self) -> int:
        """Prompt positions the answer gives a log-probability for (all but the first, when
        the whole prompt was computed)."""
        return sum(1 for e in self.entries if e)


def prompt_logprobs(url: str, prompt: str, *, tag: str, replica: str = "", max_tokens: int = 4,
                    cache_salt: str | None = None, timeout_s: float = 600.0) -> PromptLogprobs:
    """A completion with prompt_logprobs=1 (vLLM then sets skip_reading_prefix_cache on it),
    its kvpool tag in kv_transfer_params as every harness request carries one."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "prompt_logprobs": 1, "logprobs": 1, "return_token_ids": True,
            "kv_transfer_params": {"kvpool": {"tag": tag}}}
    if cache_salt:
        body["cache_salt"] = cache_salt
    if http.RECORDER is not None:
        http.RECORDER.write("request", phase="invoke", tag=tag, replica=replica, prompt_logprobs=1, cache_salt=cache_salt)
    t0 = time.monotonic()
    try:
        r = _post(url, "/v1/completions", timeout_s, json=body)
        if r.status_code != 200:
            raise RequestFailed(f"{replica or url}: prompt_logprobs: HTTP {r.status_code}: {r.text[:500]}")
    except RequestFailed as exc:
        if http.RECORDER is not None:
            http.RECORDER.write("request", phase="fail", tag=tag, replica=replica, error=str(exc)[:300],
                                total_s=round(time.monotonic() - t0, 3))
        raise
    doc = r.json()
    choice = doc["choices"][0]
    out = PromptLogprobs(tag, replica, int(doc.get("usage", {}).get("prompt_tokens") or 0),
                         list(choice.get("prompt_logprobs") or []), list(choice.get("token_ids") or []),
                         list((choice.get("logprobs") or {}).get("token_logprobs") or []))
    if http.RECORDER is not None:
        http.RECORDER.write("request", phase="ok", tag=tag, replica=replica, tokens=len(out.token_ids),
                            finish_reason=choice.get("finish_reason"), prompt_logprobs=len(out.entries),
                            total_s=round(time.monotonic() - t0, 3))
    return out
