"""Workload clients: prompts, a router, and streaming requests against live replicas.

  Corpus(model_dir, seed)      words of the tiny model's vocabulary (one word = one token);
                               `text(n, rng)` is a prompt of exactly n tokens (+ BOS).
  complete(url, prompt, ...)   one streaming /v1/completions request; returns a Completion
                               with the generated token ids, TTFT and total time. The
                               request carries `kv_transfer_params.kvpool` (tag, load,
                               publish) and an optional cache_salt.
  Router(kind, replicas, seed) sticky / alternating / random (seeded) choice of replica
                               per (session, turn).
  Workloads (all seeded):
    shared_system_prompt     one system prompt, different questions
    common_prefix_tails      a common prefix (not block aligned) with different tails
    six_turn_sessions        sessions whose turns alternate replicas (the seed study's
                             setup), each turn's prompt = the whole conversation so far
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

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


class Corpus:
    def __init__(self, model_dir: Path):
        vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
        self.words = sorted(w for w, i in vocab.items() if i >= 4)

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """A prompt that tokenizes to exactly n_tokens words (BOS comes on top)."""
        return " ".join(rng.choice(self.words) for _ in range(n_tokens))


# The harness's client side of the history (Jepsen's invoke / ok / fail): set by a
# running Cluster to a HistoryWriter of the run, so the checkers can tell a request that
# ended from one that was lost.
RECORDER = None


def _record(phase: str, **fields: object) -> None:
    if RECORDER is not None:
        RECORDER.write("request", phase=phase, **fields)


def complete(url: str, prompt: str, *, tag: str, replica: str = "", max_tokens: int = 16,
             load: bool = True, publish: bool = True, cache_salt: str | None = None,
             publish_tokens: int | None = None, timeout_s: float = 600.0) -> Completion:
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
        "kv_transfer_params": {"kvpool": {"tag": tag, "load": load, "publish": publish}},
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    if publish_tokens is not None:
        body["kv_transfer_params"]["kvpool"]["publish_tokens"] = publish_tokens
    _record("invoke", tag=tag, replica=replica, max_tokens=max_tokens, load=load, publish=publish,
            cache_salt=cache_salt, publish_tokens=publish_tokens)
    t0 = time.monotonic()
    ttft = None
    token_ids: list[int] = []
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
    total = time.monotonic() - t0
    _record("ok", tag=tag, replica=replica, finish_reason=finish, tokens=len(token_ids), error=error,
            ttft_s=round(ttft if ttft is not None else total, 4), total_s=round(total, 3))
    return Completion(tag, replica, token_ids, "".join(text), finish, ttft if ttft is not None else total, total,
                      prompt_tokens, error)


class Router:
    KINDS = ("sticky", "alternating", "random")

    def __init__(self, kind: str, replicas: list[str], seed: int):
        if kind not in self.KINDS:
            raise ValueError(f"router kind {kind!r} not in {self.KINDS}")
        self.kind = kind
        self.replicas = list(replicas)
        self._rng = random.Random(f"router:{seed}")
        self._sticky: dict[str, str] = {}

    def pick(self, session: str, turn: int) -> str:
        if self.kind == "sticky":
            if session not in self._sticky:
                self._sticky[session] = self.replicas[len(self._sticky) % len(self.replicas)]
            return self._sticky[session]
        if self.kind == "alternating":
            start = self._sticky.setdefault(session, self.replicas[len(self._sticky) % len(self.replicas)])
            return self.replicas[(self.replicas.index(start) + turn) % len(self.replicas)]
        return self._rng.choice(self.replicas)


@dataclasses.dataclass(frozen=True)
class Turn:
    session: str
    turn: int
    prompt: str


def shared_system_prompt(corpus: Corpus, rng: random.Random, system_tokens: int, questions: int,
                         question_tokens: int = 40) -> list[Turn]:
    system = corpus.text(system_tokens, rng)
    return [Turn(f"q{i}", 0, system + " " + corpus.text(question_tokens, rng)) for i in range(questions)]


def common_prefix_tails(corpus: Corpus, rng: random.Random, prefix_tokens: int, tails: int,
                        tail_tokens: int = 200) -> list[Turn]:
    prefix = corpus.text(prefix_tokens, rng)
    return [Turn(f"t{i}", 0, prefix + " " + corpus.text(tail_tokens, rng)) for i in range(tails)]


def six_turn_session(corpus: Corpus, rng: random.Random, context_tokens: int, user_tokens: int = 64,
                     turns: int = 6) -> tuple[str, list[str]]:
    """The initial context and the user messages of one session; the prompt of turn t is
    the context, then for each earlier turn its user message and the model's answer."""
    return corpus.text(context_tokens, rng), [corpus.text(user_tokens, rng) for _ in range(turns)]
