"""kvgate bench stall: how long each connector hook on vLLM's hot paths holds the engine
while the pool is stalled (its daemon stopped with SIGSTOP: connections accepted, nothing
answered), next to the same hooks against the healthy pool, in one run.

The connector's two roles run in this process against a real daemon process, driven as
vLLM's engine drives them (a hook answered None is asked again at the next step, 10 ms
later; get_finished is called at every step). Measured per hook: the longest single call
(what blocks the engine's loop) and, for lookups, how long the request waited for its
answer (what the request pays; the engine meanwhile runs the others). The baseline is the
same scheduler waiting for each lookup's answer in the call (`lookup_sync_s` past the
lookup's timeout): what every new request cost the engine before lookups left the call.

Output: one JSON object (stdout, and --out FILE): healthy / stalled / recovered phases,
each hook's worst call in seconds, the answers, and `ratio_worst_call_vs_blocking`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvgate.harness.system.pool import PoolProcess
from kvpool.client.transfer import publish
from kvpool.connector.params import BlockRun, ChainInputs, KVPoolMetadata
from kvpool.connector.settings import ConnectorSettings
from kvpool.connector.scheduler import KVPoolScheduler
from kvpool.connector.worker import KVPoolWorker

B = 16  # tokens per block
LAYERS, HEADS, HEAD = 2, 2, 64
PAGE = LAYERS * HEADS * B * 2 * HEAD * 2  # one block of every layer, bf16 K and V
STEP_S = 0.01


def _vllm_config(root: Path) -> SimpleNamespace:
    mc = SimpleNamespace(model=str(root), revision="bench", tokenizer=str(root), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: HEADS,
                         get_head_size=lambda: HEAD)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=B),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           device_config=SimpleNamespace(device_type="cpu"))


def _request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                           kv_transfer_params=None)


class _Timed:
    """Calls of one hook: the longest, and how many."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.calls = 0

    def __call__(self, fn, *args):  # noqa: ANN001, ANN002, ANN204
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.worst = max(self.worst, time.perf_counter() - t0)
            self.calls += 1

    def row(self) -> dict:
        return {"worst_call_s": round(self.worst, 4), "calls": self.calls}


def _lookups(sched: KVPoolScheduler, prompts: list[list[int]], tag: str) -> dict:
    """Each prompt as a new request, asked as vLLM asks (None: again at the next step)."""
    timed = _Timed()
    answers, waits = [], []
    for i, tokens in enumerate(prompts):
        req = _request(f"{tag}-{i}", tokens)
        t0 = time.perf_counter()
        while True:
            ext, _ = timed(sched.get_num_new_matched_tokens, req, 0)
            if ext is not None:
                break
            time.sleep(STEP_S)
        waits.append(round(time.perf_counter() - t0, 4))
        answers.append(ext // B)
        sched.request_finished(req, [])
    return {**timed.row(), "hit_blocks": answers, "request_waited_s": waits}


def _worker_hooks(worker: KVPoolWorker, hashes: list[bytes], rid: str, first_free: int) -> dict:
    """One step in which one request loads 4 blocks and another stores 4 it computed, then
    the storing request finishes: start_load_kv + wait_for_layer_load, wait_for_save,
    get_finished until it is reported; and a preempted request's drain in a later step's
    start_load_kv."""
    load = BlockRun(rid, rid, 0, list(range(first_free, first_free + 4)), hashes[:4])
    store = BlockRun(f"{rid}-s", rid, 4, list(range(first_free + 4, first_free + 8)), hashes[4:8])
    meta = KVPoolMetadata(loads=[load], stores=[store])
    out = {}
    t = _Timed()
    t(worker.start_load_kv, meta)
    t(worker.wait_for_load)
    out["load (start_load_kv + wait_for_layer_load)"] = t.row()
    t = _Timed()
    t(worker.save, meta)
    out["wait_for_save"] = t.row()
    failed = worker.take_failed()
    t = _Timed()
    done, t0 = t(worker.finished_sending, {store.req_id}), time.perf_counter()
    while store.req_id not in done and time.perf_counter() - t0 < 120:
        time.sleep(STEP_S)
        done |= t(worker.finished_sending, set())
    out["get_finished"] = {**t.row(), "reported_after_s": round(time.perf_counter() - t0, 4)}
    out["blocks_failed"] = len(failed)
    # A request preempted with a store in flight: the next step's start_load_kv waits for it
    # (its blocks are free: the next forward may write them).
    pre = BlockRun(f"{rid}-p", rid, 8, [first_free + 8], hashes[8:9])
    worker.save(KVPoolMetadata(stores=[pre]))
    t = _Timed()
    t(worker.start_load_kv, KVPoolMetadata(drain=[pre.req_id]))
    out["preempted drain (start_load_kv)"] = t.row()
    worker.finished_sending({pre.req_id})
    return out


def run_stall(settings: dict | None = None, requests: int = 5, root: Path | None = None) -> dict:
    """The measurement; `settings` override the connector's defaults (a test shortens them)."""
    import tempfile

    import torch

    root = root or Path(tempfile.mkdtemp(prefix="kvgate-stall-"))
    (root / "pool").mkdir(parents=True, exist_ok=True)
    pool = PoolProcess.start(page_size=PAGE, num_pages=512, run_dir=root / "pool")
    result: dict = {"settings": {}, "phases": {}}
    try:
        base = dict(pool=pool.unix, token=pool.token, history_dir=str(root / "history"), replica="bench")
        base.update(settings or {})
        cs = ConnectorSettings(**base)
        result["settings"] = {k: getattr(cs, k) for k in ("timeout_s", "load_deadline_s", "lookup_timeout_s",
                                                            "lookup_sync_s", "lookup_poll_s", "lookup_wait_pending_s",
                                                            "pool_backoff_s")}
        config = _vllm_config(root)
        sched = KVPoolScheduler(config, cs)
        blocking = KVPoolScheduler(config, ConnectorSettings(**{**base, "replica": "blocking",
                                                                 "lookup_sync_s": 60.0, "pool_backoff_s": 0.0}))
        worker = KVPoolWorker(config, cs)
        worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(64, HEADS, B, 2 * HEAD,
                                                                                   dtype=torch.bfloat16)
                                   for i in range(LAYERS)})
        rng = np.random.default_rng(0)

        def prompt(seed: int) -> list[int]:
            return [int(x) for x in np.random.default_rng(seed).integers(0, 30000, 12 * B + 1)]

        def pooled(seed: int) -> tuple[list[int], list[bytes]]:
            tokens = prompt(seed)
            hashes = ChainInputs().hashes(tokens, B)  # the keys the scheduler computes for a plain request
            with pool.client(name="producer") as c:
                publish(c, sched.ns, hashes[:6], [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(6)])
            return tokens, hashes

        def phase(name: str, seed: int) -> None:
            tokens, hashes = pooled(seed)
            others = [prompt(seed * 100 + i) for i in range(requests - 1)]
            result["phases"][name] = {"get_num_new_matched_tokens": _lookups(sched, [tokens, *others], name),
                                      **_worker_hooks(worker, hashes, name, 0)}

        phase("healthy", 1)
        tokens, hashes = pooled(2)  # published before the stall: a lookup would hit
        os.kill(pool.proc.pid, signal.SIGSTOP)
        t_stall = time.monotonic()
        try:
            stalled = {"get_num_new_matched_tokens": _lookups(sched, [tokens] + [prompt(200 + i)
                                                                        for i in range(requests - 1)], "stalled")}
            stalled["blocking baseline: get_num_new_matched_tokens"] = _lookups(
                blocking, [prompt(300 + i) for i in range(min(requests, 3))], "blocking")
            stalled.update(_worker_hooks(worker, hashes, "stalled", 16))
        finally:
            os.kill(pool.proc.pid, signal.SIGCONT)
        stalled["stall_s"] = round(time.monotonic() - t_stall, 2)
        result["phases"]["stalled"] = stalled
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the scheduler's pause after the timeout runs out
            ext = _lookups(sched, [tokens], "probe")["hit_blocks"][0]
            if ext:
                break
            time.sleep(0.25)
        result["phases"]["recovered"] = {"get_num_new_matched_tokens": _lookups(sched, [tokens], "recovered")}
        worst = result["phases"]["stalled"]["get_num_new_matched_tokens"]["worst_call_s"]
        base_worst = result["phases"]["stalled"]["blocking baseline: get_num_new_matched_tokens"]["worst_call_s"]
        result["ratio_worst_call_vs_blocking"] = round(worst / base_worst, 4) if base_worst else None
    finally:
        pool.stop()
        pool.cleanup()
    return result


def main(out: Path | None = None) -> int:
    from kvgate.harness.provenance import provenance

    result = {**run_stall(), "command": "kvgate bench stall", "provenance": provenance()}
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
