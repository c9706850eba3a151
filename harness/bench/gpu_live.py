"""`kvgate bench gpu` part 2: live TTFT on one GPU, side by side in one run.

Replicas of a random-weight Llama (kvgate.fixtures.gpu_model: 16 layers, hidden 2048, 8 KV heads,
head 128, 64 KiB of KV per token) on the same GPU, vLLM 0.24, TRITON_ATTN, eager:
  A, B   kvpool's connector on one pool (pages of one 16-token block of every layer);
  S      the same connector with load_mode sync;
  C      vLLM's own OffloadingConnector with a CPU tier (--kv-offloading-size), prefix
         caching off, so its second request of a prompt can only hit the CPU tier;
  D      the same with prefix caching on, as A, B and S run, its GPU prefix cache reset
         before the hit (POST /reset_prefix_cache), so the hit comes from the CPU tier.
For each prefix length, per repetition, on a fresh seeded prompt (each measurement keyed
apart by cache_salt):
  cold_prefill_ms     TTFT on B, pool and prefix cache bypassed
  local_hit_ttft_ms   the same prompt again on B (B's own GPU prefix cache)
  remote_hit_ttft_ms  TTFT on B of the prompt A computed and published (kvgate)
  remote_sync_hit_ttft_ms  the same on S, whose connector loads synchronously (load_mode sync)
  peer_hit_ttft_ms    TTFT on C of the prompt C computed and offloaded before
  peer_cached_hit_ttft_ms  the same on D; each peer's own transfer counters over its hits
                      (`peer_loaded_bytes`, `peer_cached_loaded_bytes`) show what it loaded
With `tier` (the GPU tier, issue 33's targets), also:
  T, U   kvpool's connector on a GPU keeper's tier in device memory (`python -m kvpool keeper
         --backing vmm` on the same GPU, sized for every prefix the run publishes (tier_gib);
         `pool = "keeper:RUN_DIR"`): the GPU engine
         copies device to device from the keeper's buffer, every page's sketch checked.
  gpu_tier_hit_ttft_ms    TTFT on U of the prompt T computed and published into the tier
  gpu_tier_local_hit_ttft_ms  the same prompt again on U (its own GPU prefix cache)
  gpu_tier_remote_vs_local, gpu_tier_vs_peer, gpu_tier_vs_peer_cached: the ratios the issue
                      names (at most 1.05x the local hit; at most 0.5x OffloadingConnector's
                      CPU-tier hit)
Medians; ratios remote/peer and remote/local; `remote_phases_ms` and `local_phases_ms`:
where the remote and the local hit's TTFT go (kvgate bench live's phases). Every measured
request follows a small primer request on the same replica. `h2d_floor_ms`: the prefix's
bytes at a plain pinned host-to-device copy's rate measured in the same run
(`pinned_h2d_GBps`), the least a load from host memory adds to the local hit;
`floor_vs_local` is that bound as a ratio. Not a test: nothing is asserted.

  start_bench(report_dir, max_len, tier=False, tier_tokens=0) -> Cluster     builds the model, starts A, B, S, C, D
                      (and the keeper, T and U)
  measure(cluster, lengths, reps, deadline_s) -> dict
  start_bench(..., tier_only=True, tier_extra={...}) -> Cluster   C, the keeper, T, U and V only
  measure_tier(cluster, lengths, reps, deadline_s) -> dict   the tier's rows alone, both load modes
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate.fixtures.gpu_model import BENCH_SHAPE
from kvgate.harness.system.cluster import Cluster, ReplicaSpec
from kvgate.harness.bench.live import local_phases, median_phases, primer, remote_phases, timed
from kvgate.harness.scenarios.gpu_live import wait_published
from kvgate.harness.system.gpu import BLOCK_SIZE, gpu_args
from kvgate.harness.system.pool import PRODUCTION_TTL_ARGS
from kvgate.harness.client.http import complete
from kvgate.harness.workload.prompts import Corpus

KV_BYTES = 10 << 30  # per replica's GPU KV cache: a 64k prefix (4 GiB) stays cached
CPU_TIER_GIB = 8  # holds one repetition of 8k + 32k + 64k (6.5 GiB); older prefixes are evicted
CHUNK = 8192
# The keeper's device buffer: every prefix the bench publishes, within these. Seven replicas of
# 0.12 of an H200 (16.8 GiB each) leave about 20 GiB; the keeper must fit in it.
TIER_GIB_MIN, TIER_GIB_MAX = 4, 18
# With the tier alone (C, T, U, V: four replicas of about 12 GiB each), the keeper may take more;
# this bound fits an 80 GiB H100 too.
TIER_ONLY_GIB_MAX = 24
TIER_TOKEN = "tier-bench"
WARM_LOAD_TOKENS = 4096  # the tier replicas' warm-up load (measure_tier)
PEER_SETTLE_S = 1.5  # C's offload of a finished request is asynchronous; no completion signal is exposed


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tier_gib(tier_tokens: int, tier_only: bool = False) -> int:
    """GiB of the keeper's buffer for `tier_tokens` published (every repetition of every length:
    the keeper evicts nothing without a host pool, and a full tier answers NO_CAPACITY); a run
    asking for more than fits (TIER_GIB_MAX beside the seven replicas, TIER_ONLY_GIB_MAX beside
    the tier's four) is refused before anything starts."""
    need = -(-tier_tokens * BENCH_SHAPE.kv_bytes_per_token * 11 // 10 // (1 << 30))  # 10% for the pages' rounding
    most = TIER_ONLY_GIB_MAX if tier_only else TIER_GIB_MAX
    if need > most:
        raise ValueError(f"the GPU tier would need {need} GiB for {tier_tokens} tokens of prefixes; at most "
                         f"{most} GiB fit beside the bench replicas: fewer repetitions or lengths")
    return max(TIER_GIB_MIN, need)


def start_bench(report_dir: Path, max_len: int, tier: bool = False, tier_tokens: int = 0,
                tier_only: bool = False, tier_extra: dict | None = None) -> Cluster:
    """`tier_only`: C and the tier's replicas alone (T, U and V, a consumer with load_mode sync),
    for measure_tier. `tier_extra`: more connector settings of T, U and V (for example
    {"gpu_chunk_mib": 512, "gpu_sketch": "triton-dot"})."""
    from kvgate.fixtures.gpu_model import build_llama
    from kvgate.harness.system.keeper import KeeperProcess

    tier = tier or tier_only
    t0 = time.monotonic()
    model = build_llama(report_dir / "model", BENCH_SHAPE, seed=0)
    _say(f"bench gpu live: model built in {time.monotonic() - t0:.0f} s")
    page = BENCH_SHAPE.kv_bytes_per_token * BLOCK_SIZE
    n_len = max_len + 1024
    # A, B: the default load mode (asynchronous where the engine schedules asynchronously,
    # as vLLM 0.24 does on CUDA); S: the same connector with synchronous loads (the load runs
    # in the request's first step), its remote hit measured beside B's.
    ours = [ReplicaSpec(name, core=str(i), kv_bytes=KV_BYTES, max_model_len=n_len, max_num_batched_tokens=CHUNK,
                        extra_args=gpu_args(0.12), connector_extra=extra)
            for i, (name, extra) in enumerate((("A", ()), ("B", ()), ("S", (("load_mode", "sync"),))))]
    peer = ReplicaSpec("C", core="3", connector=False, kv_bytes=KV_BYTES, max_model_len=n_len,
                       max_num_batched_tokens=CHUNK,
                       extra_args=(*gpu_args(0.12), "--no-enable-prefix-caching", "--kv-offloading-size",
                                   str(CPU_TIER_GIB), "--kv-offloading-backend", "native"))
    # D: the same peer with the engine's prefix caching on, as A, B and S run: its GPU prefix
    # cache is reset (POST /reset_prefix_cache) before the hit, which then comes from the CPU
    # tier and pays what an engine that caches prefixes pays to take loaded blocks in.
    peer_cached = ReplicaSpec("D", core="4", connector=False, kv_bytes=KV_BYTES, max_model_len=n_len,
                              max_num_batched_tokens=CHUNK,
                              extra_args=(*gpu_args(0.12), "--kv-offloading-size", str(CPU_TIER_GIB),
                                          "--kv-offloading-backend", "native"))
    cluster = Cluster(model, report_dir, page_size=page, pool_pages=(8 << 30) // page,
                      pool_args=PRODUCTION_TTL_ARGS)  # the TTLs production runs with, named (long steps renew)
    tiered: list[ReplicaSpec] = []
    if tier:
        run_dir = report_dir / "keeper-run"
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        gib = tier_gib(tier_tokens or max_len, tier_only)
        cluster.companions.append(KeeperProcess(
            run_dir, "--gpu", "0", "--page-size", str(page), "--pages", str((gib << 30) // page),
            "--tenant", f"default={TIER_TOKEN}", "--maintenance-s", "0.5", backing="vmm"))
        extra = (("pool", f"keeper:{run_dir}"), ("token", TIER_TOKEN), *sorted((tier_extra or {}).items()))
        names = (("T", ()), ("U", ()), *((("V", (("load_mode", "sync"),)),) if tier_only else ()))
        tiered = [ReplicaSpec(name, core=str(5 + i), kv_bytes=KV_BYTES, max_model_len=n_len,
                              max_num_batched_tokens=CHUNK, extra_args=gpu_args(0.12),
                              connector_extra=(*extra, *more))
                  for i, (name, more) in enumerate(names)]
    try:
        cluster.start([peer, *tiered] if tier_only else [*ours, peer, peer_cached, *tiered], timeout=400.0)
    except BaseException:
        for companion in cluster.companions:
            companion.stop()
        raise
    _say(f"bench gpu live: {', '.join(cluster.replicas)} up after {time.monotonic() - t0:.0f} s")
    return cluster


def measure(cluster: Cluster, lengths: tuple[int, ...], reps: int, deadline_s: float) -> dict:
    t_end = time.monotonic() + deadline_s
    A, B, C, S, D = (cluster.replicas[n].url for n in ("A", "B", "C", "S", "D"))
    tier = "U" in cluster.replicas
    T, U = (cluster.replicas[n].url for n in ("T", "U")) if tier else ("", "")
    corpus = Corpus(cluster.model_dir)
    rng = random.Random("bench-gpu-live:20261129")
    for url, name in ((A, "A"), (B, "B"), (C, "C"), (S, "S"), (D, "D"), *(((T, "T"), (U, "U")) if tier else ())):
        complete(url, corpus.text(64, rng), tag=f"warmup-{name}", replica=name, max_tokens=2, load=False,
                 publish=False)
    prime = primer(corpus, rng)

    def hit(url: str, name: str, tag: str, prompt: str, phases: list[dict[str, float]], phase_of: Callable,
            **kwargs: Any) -> Any:
        return timed(url, name, tag, prompt, prime=prime, history_dir=cluster.history_dir, phases=phases,
                     phase_of=phase_of, **kwargs)

    h2d = pinned_h2d_GBps()
    rows = []
    for n in lengths:
        cold, local, remote, peer = [], [], [], []
        phases: list[dict[str, float]] = []
        lphases: list[dict[str, float]] = []
        remote_sync: list[float] = []
        sphases: list[dict[str, float]] = []
        peer_moved: list[dict[str, float]] = []  # the peer's own counters over its hit: what it loaded
        peer_cached: list[float] = []
        peer_cached_moved: list[dict[str, float]] = []
        tier_hit: list[float] = []
        tier_local: list[float] = []
        tphases: list[dict[str, float]] = []
        tlphases: list[dict[str, float]] = []
        for rep in range(reps):
            if time.monotonic() > t_end - 30:
                _say(f"bench gpu live: out of time before {n} tokens, rep {rep}")
                break
            prompt = corpus.text(n - 1, rng)  # + BOS = n tokens
            salt = f"bench-{n}-{rep}"
            prime(B, "B")
            c = complete(B, prompt, tag=f"cold-{n}-{rep}", replica="B", max_tokens=1, load=False, publish=False,
                         cache_salt=salt + "-cold")
            loc = hit(B, "B", f"local-{n}-{rep}", prompt, lphases, local_phases, load=False, publish=False,
                      cache_salt=salt + "-cold")
            complete(A, prompt, tag=f"pub-{n}-{rep}", replica="A", max_tokens=1, cache_salt=salt)
            wait_published(cluster.history_dir, "A", f"pub-{n}-{rep}", n // BLOCK_SIZE, timeout_s=60)
            rem = hit(B, "B", f"remote-{n}-{rep}", prompt, phases, remote_phases, cache_salt=salt)
            rsync = hit(S, "S", f"remote-sync-{n}-{rep}", prompt, sphases, remote_phases, cache_salt=salt)
            remote_sync.append(rsync.ttft_s * 1e3)
            ph, moved = _peer_hit(C, "C", prompt, f"{n}-{rep}", salt + "-peer", prime, reset=False)
            peer_moved.append(moved)
            phc, moved = _peer_hit(D, "D", prompt, f"{n}-{rep}", salt + "-peer-cached", prime, reset=True)
            peer_cached_moved.append(moved)
            peer_cached.append(phc.ttft_s * 1e3)
            if tier:  # T publishes into the keeper's device buffer, U loads device to device
                complete(T, prompt, tag=f"tierpub-{n}-{rep}", replica="T", max_tokens=1, cache_salt=salt + "-tier")
                wait_published(cluster.history_dir, "T", f"tierpub-{n}-{rep}", n // BLOCK_SIZE, timeout_s=60)
                th = hit(U, "U", f"tier-{n}-{rep}", prompt, tphases, remote_phases, cache_salt=salt + "-tier")
                tl = hit(U, "U", f"tier-local-{n}-{rep}", prompt, tlphases, local_phases, load=False,
                         publish=False, cache_salt=salt + "-tier")
                tier_hit.append(th.ttft_s * 1e3)
                tier_local.append(tl.ttft_s * 1e3)
                _say(f"  {n:>6} rep {rep}: GPU tier hit {tier_hit[-1]:.0f} ms, its local hit {tier_local[-1]:.0f} ms")
            cold.append(c.ttft_s * 1e3)
            local.append(loc.ttft_s * 1e3)
            remote.append(rem.ttft_s * 1e3)
            peer.append(ph.ttft_s * 1e3)
            _say(f"  {n:>6} rep {rep}: cold {cold[-1]:.0f} ms, local {local[-1]:.0f} ms, kvgate remote "
                 f"{remote[-1]:.0f} ms (sync loads {remote_sync[-1]:.0f} ms), OffloadingConnector CPU hit "
                 f"{peer[-1]:.0f} ms (prefix caching on: {peer_cached[-1]:.0f} ms)")
        if not cold:
            break
        loads = [r for r in _records(cluster, "load", "B") if str(r.get("tag", "")).startswith(f"remote-{n}-")]
        sync_loads = [r for r in _records(cluster, "load", "S")
                      if str(r.get("tag", "")).startswith(f"remote-sync-{n}-")]
        row = {"prefix_tokens": n, "runs": len(cold), "kv_bytes": n * BENCH_SHAPE.kv_bytes_per_token,
               "remote_blocks_loaded": sum(int(r["loaded"]) for r in loads),
               "remote_sync_blocks_loaded": sum(int(r["loaded"]) for r in sync_loads),
               "remote_blocks_expected": len(cold) * ((n - 1) // BLOCK_SIZE)}
        for name, values in (("cold_prefill_ms", cold), ("local_hit_ttft_ms", local),
                             ("remote_hit_ttft_ms", remote), ("remote_sync_hit_ttft_ms", remote_sync),
                             ("peer_hit_ttft_ms", peer), ("peer_cached_hit_ttft_ms", peer_cached)):
            row[name] = round(statistics.median(values), 1)
            row[f"{name}_all"] = [round(v, 1) for v in values]
        row["remote_lookup_via"] = [r.get("via", "lookup") for r in _records(cluster, "lookup", "B")
                                    if str(r.get("tag", "")).startswith(f"remote-{n}-")
                                    and r.get("outcome") == "remote_hit"]
        for key, moved in (("peer", peer_moved), ("peer_cached", peer_cached_moved)):
            if moved and all(moved):
                row[f"{key}_loaded_bytes"] = statistics.median(m.get("load_bytes", 0.0) for m in moved)
                row[f"{key}_load_seconds"] = round(statistics.median(m.get("load_seconds", 0.0) for m in moved), 4)
        row["remote_vs_peer_cached"] = round(row["remote_hit_ttft_ms"] / row["peer_cached_hit_ttft_ms"], 3)
        row["remote_sync_vs_peer_cached"] = round(row["remote_sync_hit_ttft_ms"] / row["peer_cached_hit_ttft_ms"], 3)
        row["remote_vs_peer"] = round(row["remote_hit_ttft_ms"] / row["peer_hit_ttft_ms"], 3)
        row["remote_vs_local"] = round(row["remote_hit_ttft_ms"] / row["local_hit_ttft_ms"], 3)
        if phases:  # where the remote hit's TTFT goes (medians), from its connector records
            row["remote_phases_ms"] = median_phases(phases)
        row["remote_sync_vs_local"] = round(row["remote_sync_hit_ttft_ms"] / row["local_hit_ttft_ms"], 3)
        row["remote_sync_vs_peer"] = round(row["remote_sync_hit_ttft_ms"] / row["peer_hit_ttft_ms"], 3)
        if sphases:
            row["remote_sync_phases_ms"] = median_phases(sphases)
        if lphases:
            row["local_phases_ms"] = median_phases(lphases)
        if tier_hit:
            tier_loads = [r for r in _records(cluster, "load", "U") if str(r.get("tag", "")).startswith(f"tier-{n}-")]
            row["gpu_tier_blocks_loaded"] = sum(int(r["loaded"]) for r in tier_loads)
            row["gpu_tier_blocks_expected"] = len(tier_hit) * ((n - 1) // BLOCK_SIZE)
            row["gpu_tier_hit_ttft_ms"] = round(statistics.median(tier_hit), 1)
            row["gpu_tier_hit_ttft_ms_all"] = [round(v, 1) for v in tier_hit]
            row["gpu_tier_local_hit_ttft_ms"] = round(statistics.median(tier_local), 1)
            row["gpu_tier_local_hit_ttft_ms_all"] = [round(v, 1) for v in tier_local]
            row["gpu_tier_remote_vs_local"] = round(row["gpu_tier_hit_ttft_ms"] / row["gpu_tier_local_hit_ttft_ms"], 3)
            row["gpu_tier_vs_peer"] = round(row["gpu_tier_hit_ttft_ms"] / row["peer_hit_ttft_ms"], 3)
            row["gpu_tier_vs_peer_cached"] = round(row["gpu_tier_hit_ttft_ms"] / row["peer_cached_hit_ttft_ms"], 3)
            row["gpu_tier_phases_ms"] = median_phases(tphases)
            if tlphases:
                row["gpu_tier_local_phases_ms"] = median_phases(tlphases)
        # The least any host-memory pool adds to the local hit: the prefix's bytes at the
        # pinned host-to-device rate measured in this run.
        floor_ms = row["kv_bytes"] / (h2d * 1e9) * 1e3
        row["h2d_floor_ms"] = round(floor_ms, 1)
        row["floor_vs_local"] = round((row["local_hit_ttft_ms"] + floor_ms) / row["local_hit_ttft_ms"], 3)
        rows.append(row)
    s = BENCH_SHAPE
    tiered = [r for r in rows if "gpu_tier_hit_ttft_ms" in r]
    tier_targets = {"gpu_tier_at_most_1.05x_local_at_every_length":
                    bool(tiered) and all(r["gpu_tier_remote_vs_local"] <= 1.05 for r in tiered),
                    "gpu_tier_at_most_0.5x_peer_at_every_length":
                    bool(tiered) and all(r["gpu_tier_vs_peer"] <= 0.5 for r in tiered),
                    "gpu_tier_every_block_loaded":
                    bool(tiered) and all(r["gpu_tier_blocks_loaded"] == r["gpu_tier_blocks_expected"]
                                         for r in tiered)} if tier else {}
    return {
        "model": f"random-weight Llama, {s.layers} layers, hidden {s.hidden}, {s.kv_heads} KV heads, head "
                 f"{s.head_dim}, bf16 ({s.kv_bytes_per_token // 1024} KiB of KV per token); block {BLOCK_SIZE}; "
                 f"chunk {CHUNK}; peer: OffloadingConnector, CPU tier {CPU_TIER_GIB} GiB, prefix caching off (C) "
                 f"and on with its GPU prefix cache reset before the hit (D)",
        "pinned_h2d_GBps": round(h2d, 2),
        "rows": rows,
        "targets": {"remote_no_slower_than_peer_at_every_length":
                    bool(rows) and all(r["remote_vs_peer"] <= 1.0 for r in rows),
                    "remote_no_slower_than_peer_cached_at_every_length":
                    bool(rows) and all(r["remote_vs_peer_cached"] <= 1.0 for r in rows),
                    "remote_at_most_1.2x_local_at_every_length":
                    bool(rows) and all(r["remote_vs_local"] <= 1.2 for r in rows),
                    "floor_at_most_1.2x_local_at_every_length":
                    bool(rows) and all(r["floor_vs_local"] <= 1.2 for r in rows), **tier_targets},
        **({"gpu_tier": "a GPU keeper's tier in device memory (CUDA VMM, sized for every prefix the run "
                        "publishes) on the same GPU; T publishes, U loads device to device"} if tier else {}),
    }


def measure_tier(cluster: Cluster, lengths: tuple[int, ...], reps: int, deadline_s: float) -> dict:
    """The GPU tier alone (start_bench(tier_only=True)): per length and repetition, a fresh
    seeded prompt that T computes and publishes into the keeper's device buffer; U (the
    default load mode: asynchronous on CUDA) and V (load_mode sync) each load it device to
    device and then hit it again in their own prefix cache; C, OffloadingConnector, computes
    and offloads it and hits its CPU tier. The ratios of issue 33 per load mode, and
    `gpu_tier_local_vs_peer`: the consumer's own local hit against C's CPU-tier hit, the least
    any tier's hit can be (it pays for everything a local hit pays for, and its load)."""
    t_end = time.monotonic() + deadline_s
    C, T, U, V = (cluster.replicas[n].url for n in ("C", "T", "U", "V"))
    corpus = Corpus(cluster.model_dir)
    rng = random.Random("bench-gpu-tier:20261205")
    for url, name in ((C, "C"), (T, "T"), (U, "U"), (V, "V")):
        complete(url, corpus.text(64, rng), tag=f"warmup-{name}", replica=name, max_tokens=2, load=False,
                 publish=False)
    prime = primer(corpus, rng)
    # One load each before any measured one: a replica's first load pays one-time costs (kernels
    # compiled for the first chunk shapes), which the rows would otherwise carry in their first
    # repetition; T publishes a prompt of WARM_LOAD_TOKENS, U and V load it.
    warm = corpus.text(WARM_LOAD_TOKENS - 1, rng)
    complete(T, warm, tag="tierwarm-pub", replica="T", max_tokens=1, cache_salt="tier-warm")
    wait_published(cluster.history_dir, "T", "tierwarm-pub", WARM_LOAD_TOKENS // BLOCK_SIZE, timeout_s=60)
    for url, name in ((U, "U"), (V, "V")):
        complete(url, warm, tag=f"tierwarm-{name}", replica=name, max_tokens=1, cache_salt="tier-warm")
    modes = (("", "U", U), ("sync_", "V", V))  # (key prefix, replica, url); tags say "sync-"
    rows = []
    for n in lengths:
        ttft: dict[str, list[float]] = {k: [] for m, _, _ in modes for k in (f"{m}hit", f"{m}local")}
        phases: dict[str, list[dict[str, float]]] = {k: [] for k in ttft}
        peer: list[float] = []
        peer_moved: list[dict[str, float]] = []
        for rep in range(reps):
            if time.monotonic() > t_end - 30:
                _say(f"bench gpu tier: out of time before {n} tokens, rep {rep}")
                break
            prompt = corpus.text(n - 1, rng)  # + BOS = n tokens
            salt = f"tier-{n}-{rep}"
            complete(T, prompt, tag=f"tierpub-{n}-{rep}", replica="T", max_tokens=1, cache_salt=salt)
            wait_published(cluster.history_dir, "T", f"tierpub-{n}-{rep}", n // BLOCK_SIZE, timeout_s=60)
            for m, name, url in modes:
                t = m.replace("_", "-")
                h = timed(url, name, f"tier-{t}{n}-{rep}", prompt, prime=prime, history_dir=cluster.history_dir,
                          phases=phases[f"{m}hit"], phase_of=remote_phases, cache_salt=salt)
                loc = timed(url, name, f"tierlocal-{t}{n}-{rep}", prompt, prime=prime,
                            history_dir=cluster.history_dir, phases=phases[f"{m}local"], phase_of=local_phases,
                            load=False, publish=False, cache_salt=salt)
                ttft[f"{m}hit"].append(h.ttft_s * 1e3)
                ttft[f"{m}local"].append(loc.ttft_s * 1e3)
            ph, moved = _peer_hit(C, "C", prompt, f"{n}-{rep}", salt + "-peer", prime, reset=False)
            peer.append(ph.ttft_s * 1e3)
            peer_moved.append(moved)
            _say(f"  {n:>6} rep {rep}: GPU tier hit {ttft['hit'][-1]:.0f} ms (local {ttft['local'][-1]:.0f} ms), "
                 f"sync loads {ttft['sync_hit'][-1]:.0f} ms (local {ttft['sync_local'][-1]:.0f} ms), "
                 f"OffloadingConnector CPU hit {peer[-1]:.0f} ms")
        if not peer:
            break
        row: dict[str, Any] = {"prefix_tokens": n, "runs": len(peer), "kv_bytes": n * BENCH_SHAPE.kv_bytes_per_token,
                               "peer_hit_ttft_ms": round(statistics.median(peer), 1),
                               "peer_hit_ttft_ms_all": [round(v, 1) for v in peer]}
        if all(peer_moved):
            row["peer_loaded_bytes"] = statistics.median(m.get("load_bytes", 0.0) for m in peer_moved)
            row["peer_load_seconds"] = round(statistics.median(m.get("load_seconds", 0.0) for m in peer_moved), 4)
        for m, name, _ in modes:
            loads = [r for r in _records(cluster, "load", name)
                     if str(r.get("tag", "")).startswith(f"tier-{m.replace('_', '-')}{n}-")]
            key = f"gpu_tier_{m}"
            row[f"{key}blocks_loaded"] = sum(int(r["loaded"]) for r in loads)
            row[f"{key}loads"] = len(loads)
            row[f"{key}direct_loads"] = sum(1 for r in loads if r.get("direct") is True)
            row[f"{key}staged_loads"] = sum(1 for r in loads if r.get("direct") is False)  # the rest installed nothing
            row[f"{key}blocks_expected"] = len(peer) * ((n - 1) // BLOCK_SIZE)
            for what, label in (("hit", "hit"), ("local", "local_hit")):
                values = ttft[f"{m}{what}"]
                row[f"{key}{label}_ttft_ms"] = round(statistics.median(values), 1)
                row[f"{key}{label}_ttft_ms_all"] = [round(v, 1) for v in values]
                if phases[f"{m}{what}"]:  # none where no request's records had them (a load that moved nothing)
                    row[f"{key}{'phases' if what == 'hit' else 'local_phases'}_ms"] = median_phases(phases[f"{m}{what}"])
            row[f"{key}remote_vs_local"] = round(row[f"{key}hit_ttft_ms"] / row[f"{key}local_hit_ttft_ms"], 3)
            row[f"{key}vs_peer"] = round(row[f"{key}hit_ttft_ms"] / row["peer_hit_ttft_ms"], 3)
            row[f"{key}local_vs_peer"] = round(row[f"{key}local_hit_ttft_ms"] / row["peer_hit_ttft_ms"], 3)
        rows.append(row)
    targets: dict[str, bool] = {}
    for m, _, _ in modes:
        key = f"gpu_tier_{m}"
        targets[f"{key}at_most_1.05x_local_at_every_length"] = bool(rows) and all(
            r[f"{key}remote_vs_local"] <= 1.05 for r in rows)
        targets[f"{key}at_most_0.5x_peer_at_every_length"] = bool(rows) and all(
            r[f"{key}vs_peer"] <= 0.5 for r in rows)
        targets[f"{key}every_block_loaded"] = bool(rows) and all(
            r[f"{key}blocks_loaded"] >= r[f"{key}blocks_expected"] for r in rows)
    s = BENCH_SHAPE
    return {
        "model": f"random-weight Llama, {s.layers} layers, hidden {s.hidden}, {s.kv_heads} KV heads, head "
                 f"{s.head_dim}, bf16 ({s.kv_bytes_per_token // 1024} KiB of KV per token); block {BLOCK_SIZE}; "
                 f"chunk {CHUNK}; peer: OffloadingConnector, CPU tier {CPU_TIER_GIB} GiB, prefix caching off (C)",
        "gpu_tier": "a GPU keeper's tier in device memory (CUDA VMM, sized for every prefix the run publishes) on "
                    "the same GPU; T publishes, U (asynchronous loads) and V (load_mode sync) load device to device",
        "tier_settings": {k: v for k, v in cluster.replicas["U"].spec.connector_extra if k != "token"},
        "rows": rows,
        "targets": targets,
    }


def _peer_hit(url: str, name: str, prompt: str, key: str, salt: str, prime, reset: bool):  # noqa: ANN001, ANN202
    """The peer computes and offloads the prompt, then serves it again from its CPU tier
    (`reset`: after its GPU prefix cache is emptied); its transfer counters over the hit."""
    import requests

    complete(url, prompt, tag=f"peer-pub-{key}", replica=name, max_tokens=1, cache_salt=salt)
    time.sleep(PEER_SETTLE_S)
    if reset:
        r = requests.post(f"{url}/reset_prefix_cache", timeout=60)
        r.raise_for_status()
    prime(url, name)
    before = peer_counters(url)
    hit = complete(url, prompt, tag=f"peer-hit-{key}", replica=name, max_tokens=1, cache_salt=salt)
    time.sleep(0.5)  # the counters travel with the engine's outputs: let the last step's arrive
    after = peer_counters(url)
    return hit, {k: after[k] - before[k] for k in after if k in before}


PEER_COUNTERS = {"vllm:kv_offload_load_bytes": "load_bytes", "vllm:kv_offload_load_time": "load_seconds"}


def peer_counters(url: str) -> dict[str, float]:
    """The OffloadingConnector's own transfer counters on the replica's /metrics (vLLM 0.24:
    bytes and seconds loaded from its CPU tier), summed over their labels; {} where absent."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        key = PEER_COUNTERS.get(fam.name)
        if key is not None:
            out[key] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out


def pinned_h2d_GBps(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """A plain pinned host-to-device copy's rate on this GPU (median of `reps`)."""
    import torch

    from kvgate.harness.bench.gpu import gpu_seconds

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    seconds = gpu_seconds(lambda: dst.copy_(src, non_blocking=True), reps)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / seconds / 1e9


def _records(cluster: Cluster, ev: str, replica: str) -> list[dict]:
    from kvgate.harness.checkers.history import records

    return records(cluster.history_dir, ev, replica=replica)
