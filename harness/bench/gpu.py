"""`kvgate bench gpu`: the GPU transfer engine (kvpool.gpu.transfer) against a plain
pinned cudaMemcpy of the same bytes, measured in the same run, interleaved rep by rep.

  1. store and load of 16 to 4096 blocks of a 27B-class KV layout (64 layers, 8 KV heads,
     head size 128, bf16, 16-token blocks: 256 KiB of KV per token, 4 MiB per block, one
     block per pool page), next to `copy_` between a pinned host buffer
     (cudaHostAlloc) and the GPU of the same number of bytes.
       store: store() until the last commit: gather, device-to-host copies into the
              registered arena, the digests, commit (store_copy: until the copies alone
              completed). Paths `torch` and `driver` digest on the GPU (kv-sketch-1:
              sketches on the kernel stream beside the copies, the host hashing 1/256 of
              the bytes, commits trusted and scrubbed at rest by the pool); `torch-xxh3`
              (the baseline in the same run) takes XXH3-128 on the host over the pages
              as copied and the pool re-verifies before commit.
       load:  load() until the engine's stream holds the blocks: lease, the digest check
              of every page (on the GPU, chunk by chunk, for sketched pages; on the host
              for xxh3-128), host-to-device copies, scatter; the lease's release follows
              in the background.
     Ratios are plain time / engine time over all transfers of 256 MiB and more (sums of
     the per-size medians); the worst size is reported too; `vs_host_digest`: each GPU-digest
     path's ratios over its xxh3-128 twin's (before and after, same run).
  2. the time to load the KV of 32k and 128k tokens of that model into the engine's
     KV tensors, next to the seed's 0.605 s TTFT at 128k (003_13ba88f9229fb28c.txt).
The pool daemon runs in its own process with `--pool-io-threads` verify threads; the
engine commits on `--lanes` connections. Progress goes to stderr; the last line printed
is one JSON object.

`kvgate bench gpu --gpus N` (run_concurrent) instead: N GPUs, one process each (its own
CUDA context, torch.cuda.set_device(rank)), all on ONE pool (one registered arena). Each
process stores its own blocks once (distinct chains), then, per size and repetition, with
every process lined up on a barrier before each timed step:
  alone       each GPU in turn, the others idle: a plain pinned H2D copy of the bytes
              (cudaHostAlloc'd buffer -> GPU, the GPU's own baseline of this run), then
              the engine's load of the same number of blocks from the pool;
  concurrent  all GPUs at once: the plain copies, then the engine's loads.
Per GPU: load_concurrent_vs_plain_copy = plain copy alone / engine load while every GPU
loads (and the same with the GPU loading alone). Aggregate: all GPUs' bytes over the span
from the first start to the last finish (CLOCK_MONOTONIC, shared by the processes),
against the sum of the GPUs' plain copies alone and against their plain copies run at
once. Headline figures over sizes of 256 MiB per GPU and more. Every process checks its
first concurrent load byte-exact against its source KV.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import queue as queue_mod
import secrets
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from kvgate.harness.system.pool import DEFAULT_TENANT, unique_name
from kvpool.pool.arena import memory_available
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import main_serve, read_address

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS, DTYPE_BYTES = 64, 8, 128, 16, 2
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_SIZE * DTYPE_BYTES  # K and V: 262144 = 256 KiB
PAGE = KV_BYTES_PER_TOKEN * BLOCK_TOKENS  # 4 MiB
SIZES = (16, 64, 256, 1024, 4096)
SEED_LOAD_S_128K = 0.605
NS = Namespace("bench-27b", "r1", "tok", "bfloat16", "cuda:N,2,B,H,D", BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_SIZE)


def gpu_seconds(fn, reps: int = 5) -> float:  # noqa: ANN001 - a callable enqueuing GPU work
    """`fn`'s time on the GPU, by CUDA events on the current stream: the median of `reps` runs,
    after one run and a device sync (the warm-up)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _serve(config: PoolConfig) -> None:
    sys.exit(main_serve(config))


class _Pool:
    """A pool daemon in its own process, with a chosen number of verify threads."""

    def __init__(self, page_size: int, num_pages: int, io_threads: int):
        self.name = unique_name("kvgb")
        self.token = secrets.token_hex(8)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        config = PoolConfig(name=self.name, page_size=page_size, num_pages=num_pages, run_dir=self.run_dir,
                            tenants={DEFAULT_TENANT: self.token}, tcp_host=None, io_threads=io_threads,
                            max_queue=256, reservation_ttl_s=600.0, lease_ttl_s=600.0)
        self.proc = mp.get_context("spawn").Process(target=_serve, args=(config,), name="kvgate-bench-pool")
        self.proc.start()
        deadline = time.monotonic() + 600
        while True:
            if not self.proc.is_alive():
                raise RuntimeError(f"the bench's pool daemon exited with {self.proc.exitcode}")
            try:
                address = read_address(self.run_dir, timeout=0.5)
                if address.get("pid") == self.proc.pid:
                    break
            except TimeoutError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the bench's pool daemon did not start within 600 s")
        self.unix = f"unix:{address['unix']}"

    def client(self, name: str):  # noqa: ANN201
        from kvpool.client.pool_client import PoolClient

        return PoolClient(self.unix, DEFAULT_TENANT, self.token, name=name, timeout_s=120.0)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _digest_ceiling(arena, pages: int, threads: int) -> dict[str, float]:  # noqa: ANN001
    """Page digests per second on this host with 1, 4, 8 and `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    from kvpool.pool.digest import page_digest

    views = [arena.page(i) for i in range(pages)]  # free pages: read, never written
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(page_digest, views))  # map them into this process first
    out = {}
    for n in sorted({1, 4, 8, threads}):
        with ThreadPoolExecutor(n) as ex:
            t0 = time.perf_counter()
            list(ex.map(page_digest, views))
            out[str(n)] = round(pages * PAGE / (time.perf_counter() - t0) / 1e9, 1)
    return out


def _kernel_times(src, dst, blocks: int, reps: int = 10) -> dict[str, object]:  # noqa: ANN001 - TransferEngines
    """GPU milliseconds per copy chunk of the kernels a sketched transfer adds (CUDA events,
    nothing else running): the gather into staging, the sketch, the scatter out of it."""
    import torch

    from kvpool.pool.digest import SKETCH_ROW

    n = src._chunk_pages
    ids = list(range(min(n, blocks)))
    stage = src._sk_store_stage[0]
    out = src._sk_store_dev[0]
    rows = len(ids) * src._sk_rows
    steps = {  # each on the stream the engine runs it on
        "gather": (src._store_k, lambda: src._gather(ids, stage, src._sk_store_scratch, src._sk_store_ring)),
        "sketch": (src._store_k, lambda: src._sketcher.sketch(stage[: len(ids)].view(rows, SKETCH_ROW), out=out[:rows])),
        "scatter": (dst._load_s, lambda: dst._scatter(ids, 0, dst._sk_load_stage[0], dst._sk_scatter_ring)),
    }
    times: dict[str, float] = {"graphs": src.capabilities.graphs}
    for name, (stream, fn) in steps.items():
        with torch.cuda.stream(stream):
            fn()  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(reps):
                fn()
            end.record(stream)
            end.synchronize()
            times[name] = round(start.elapsed_time(end) / reps, 3)
    torch.cuda.synchronize()
    return times


def _shm_blocks(want: int) -> int:
    avail = memory_available() - 8 * 2**30  # leave room for the pinned baseline, the tests and others
    return max(16, min(want, avail // PAGE))


def _path_config(name: str) -> tuple[str, str]:
    """'torch', 'driver', 'torch-xxh3', 'driver-xxh3' -> (copy path, digest kind)."""
    from kvpool.pool.digest import DigestKind

    path, _, kind = name.partition("-")
    if path not in ("torch", "driver") or kind not in ("", "xxh3", "sketch"):
        raise ValueError(f"unknown bench path {name!r}: torch or driver, optionally -xxh3 (host digests) or -sketch")
    return path, (DigestKind.XXH3 if kind == "xxh3" else DigestKind.SKETCH).value


def run_bench(quick: bool = False, paths: tuple[str, ...] = ("torch", "driver", "torch-xxh3"), reps: int = 3,
              max_blocks: int = 4096, lanes: int = 8, hash_threads: int = 8, io_threads: int = 8,
              chunk_mib: int = 128, commit_mib: int = 32, seed: int = 0) -> int:
    import torch

    from kvpool.gpu.config import CopyPath, TransferConfig
    from kvpool.gpu.transfer import TransferEngine

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA GPU on this machine: kvgate bench gpu needs one"}))
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    want = 2048 if quick else 8192  # 32k / 128k tokens
    reps = 2 if quick else reps
    arena_blocks = _shm_blocks(want)
    sizes = [n for n in SIZES if n <= min(max_blocks, arena_blocks, 1024 if quick else 4096)]
    _say(f"kvgate bench gpu: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; 27B-class KV: "
         f"{KV_BYTES_PER_TOKEN // 1024} KiB/token, {PAGE // 2**20} MiB per {BLOCK_TOKENS}-token block; arena "
         f"{arena_blocks} blocks ({arena_blocks * PAGE / 2**30:.0f} GiB); sizes {sizes} blocks; reps {reps}; "
         f"paths {list(paths)}; lanes {lanes}, digest threads {hash_threads}, pool verify threads {io_threads}")
    free, total = torch.cuda.mem_get_info(device)
    if 2 * arena_blocks * PAGE + max(sizes) * PAGE > free:
        arena_blocks = int((free - max(sizes) * PAGE - 4 * 2**30) // (2 * PAGE))
        _say(f"  GPU memory: {free / 2**30:.0f} GiB free; arena and KV cut to {arena_blocks} blocks")
    t_setup = time.perf_counter()
    pool = _Pool(PAGE, arena_blocks, io_threads)
    result: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "model": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE, "dtype": "bfloat16",
                  "block_tokens": BLOCK_TOKENS, "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "page_bytes": PAGE},
        "config": {"reps": reps, "lanes": lanes, "hash_threads": hash_threads, "pool_io_threads": io_threads,
                   "chunk_mib": chunk_mib, "commit_mib": commit_mib, "arena_blocks": arena_blocks, "seed": seed},
    }
    try:
        ctl = pool.client("bench")
        lane_clients = [ctl] + [pool.client(f"lane{i}") for i in range(1, lanes)]
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        shape = (arena_blocks, 2, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE)
        src = [torch.randint(-32768, 32767, shape, dtype=torch.int16, device=device, generator=gen).view(torch.bfloat16)
               for _ in range(LAYERS)]
        dst = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
        plain_bytes = max(sizes) * PAGE
        pinned = torch.empty(plain_bytes, dtype=torch.uint8, pin_memory=True)  # resident once allocated
        gpu_buf = torch.empty(plain_bytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        _say(f"  set-up (arena, KV tensors, {plain_bytes / 2**30:.0f} GiB pinned baseline buffer): "
             f"{time.perf_counter() - t_setup:.1f} s")
        rng = np.random.default_rng(seed)
        chains = iter(range(1, 1 << 30))
        result["host_digest_GBps"] = _digest_ceiling(ctl.arena, min(512, arena_blocks), hash_threads)
        _say(f"  host XXH3-128 over arena pages, no copy running: {result['host_digest_GBps']} GB/s by digest threads "
             f"(the load checks every page once; a store is digested twice: by the engine and the pool's re-verify)")

        def fresh_hashes(n: int) -> list[bytes]:
            base = next(chains) * 1_000_000
            return block_hashes(range(base, base + BLOCK_TOKENS * n), BLOCK_TOKENS)

        def timed(fn) -> float:  # noqa: ANN001
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        def same(ids: list[int], tgt: list[int]) -> bool:
            a = torch.tensor(ids, device=device)
            b = torch.tensor(tgt, device=device)
            return all(torch.equal(s.index_select(0, a).view(torch.int16), d.index_select(0, b).view(torch.int16))
                       for s, d in zip(src, dst))

        paths_out: dict[str, dict] = {}
        engines = {}
        for name in paths:
            path, digest = _path_config(name)
            cfg = TransferConfig(path=CopyPath(path), block_dim=0, chunk_bytes=chunk_mib * 2**20,
                                 commit_bytes=commit_mib * 2**20, hash_threads=hash_threads, digest=digest)
            path = name
            t0 = time.perf_counter()
            eng_src = TransferEngine(ctl, NS, src, cfg, lanes=lane_clients)
            eng_dst = TransferEngine(ctl, NS, dst, cfg, lanes=lane_clients)
            engines[path] = (eng_src, eng_dst)
            caps = eng_src.capabilities
            _say(f"[{path}] engine ready in {time.perf_counter() - t0:.1f} s: host memory {caps.host_memory.value}"
                 f"{' (' + caps.host_memory_reason + ')' if caps.host_memory_reason else ''}"
                 + (f", batched copies {caps.batched_copies} {caps.batched_reason}" if path == "driver" else ""))
            if eng_src._sketcher is not None and "kernels_ms_per_chunk" not in result:
                result["kernels_ms_per_chunk"] = _kernel_times(eng_src, eng_dst, min(arena_blocks, 512))
                _say(f"[{path}] GPU time per {chunk_mib} MiB chunk, alone on the GPU: "
                     f"{result['kernels_ms_per_chunk']} ms (the copy of a chunk at 55 GB/s: "
                     f"{chunk_mib * 2**20 / 55e9 * 1e3:.2f} ms)")
            rows: dict[str, dict] = {}
            for n in sizes:
                nbytes = n * PAGE
                s: dict[str, list[float]] = {k: [] for k in ("plain_d2h", "plain_h2d", "store", "store_copy", "load")}
                exact = True
                for r in range(reps):
                    ids = [int(x) for x in rng.choice(arena_blocks, n, replace=False)]
                    tgt = [int(x) for x in rng.choice(arena_blocks, n, replace=False)]
                    hashes = fresh_hashes(n)
                    s["plain_d2h"].append(timed(lambda: pinned[:nbytes].copy_(gpu_buf[:nbytes], non_blocking=True)))
                    s["plain_h2d"].append(timed(lambda: gpu_buf[:nbytes].copy_(pinned[:nbytes], non_blocking=True)))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    eng_src.store(ids, hashes)
                    copied = torch.cuda.Event()
                    copied.record(eng_src.store_stream)
                    copied.synchronize()
                    t1 = time.perf_counter()
                    outs = eng_src.drain()
                    t2 = time.perf_counter()
                    committed = sum(o.committed for o in outs)
                    if committed != n:
                        raise RuntimeError(f"[{path}] store of {n} blocks committed {committed}: {outs}")
                    s["store_copy"].append(t1 - t0)
                    s["store"].append(t2 - t0)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    h = eng_dst.load(tgt, hashes)
                    eng_dst.wait_for_load(h)
                    torch.cuda.current_stream(device).synchronize()
                    s["load"].append(time.perf_counter() - t0)
                    if h.loaded != n:
                        raise RuntimeError(f"[{path}] load of {n} blocks installed {h.loaded}: {h}")
                    eng_dst.drain()
                    if r == 0:
                        exact = exact and same(ids, tgt)
                    ctl.evict(NS, hashes)
                m = {k: _median(v) for k, v in s.items()}
                rows[str(n)] = {
                    "blocks": n, "MiB": nbytes // 2**20, "byte_exact": exact,
                    "plain_d2h_GBps": round(nbytes / m["plain_d2h"] / 1e9, 2),
                    "plain_h2d_GBps": round(nbytes / m["plain_h2d"] / 1e9, 2),
                    "store_GBps": round(nbytes / m["store"] / 1e9, 2),
                    "store_copy_GBps": round(nbytes / m["store_copy"] / 1e9, 2),
                    "load_GBps": round(nbytes / m["load"] / 1e9, 2),
                    "store_vs_plain_copy": round(m["plain_d2h"] / m["store"], 3),
                    "store_copy_vs_plain_copy": round(m["plain_d2h"] / m["store_copy"], 3),
                    "load_vs_plain_copy": round(m["plain_h2d"] / m["load"], 3),
                    "median_s": {k: round(v, 6) for k, v in m.items()},
                }
                row = rows[str(n)]
                _say(f"[{path}] {n:>5} blocks ({nbytes / 2**20:>6.0f} MiB): plain D2H {row['plain_d2h_GBps']:>6} GB/s, "
                     f"store {row['store_GBps']:>6} GB/s ({row['store_vs_plain_copy']}x; copies alone "
                     f"{row['store_copy_vs_plain_copy']}x) | plain H2D {row['plain_h2d_GBps']:>6} GB/s, load "
                     f"{row['load_GBps']:>6} GB/s ({row['load_vs_plain_copy']}x){'' if exact else '  BYTES DIFFER'}")
            big = [rows[str(n)] for n in sizes if n * PAGE >= 256 * 2**20]

            def agg(plain: str, engine: str) -> float | None:
                if not big:
                    return None
                return round(sum(r["median_s"][plain] for r in big) / sum(r["median_s"][engine] for r in big), 3)

            paths_out[path] = {
                "digest": digest,
                "capabilities": {k: str(v) for k, v in dataclasses.asdict(caps).items()},
                "sizes": rows,
                "load_vs_plain_copy": agg("plain_h2d", "load"),
                "store_vs_plain_copy": agg("plain_d2h", "store"),
                "store_copy_vs_plain_copy": agg("plain_d2h", "store_copy"),
                "load_vs_plain_copy_min": min((r["load_vs_plain_copy"] for r in big), default=None),
                "store_vs_plain_copy_min": min((r["store_vs_plain_copy"] for r in big), default=None),
                "byte_exact": all(r["byte_exact"] for r in rows.values()),
            }

        # -- 2. the 27B-class model's KV at 32k and 128k tokens --------------------------------------------
        path = paths[0]
        eng_src, eng_dst = engines[path]
        blocks_128k = 131072 // BLOCK_TOKENS
        blocks_32k = 32768 // BLOCK_TOKENS
        n_all = min(blocks_128k, arena_blocks)
        prompt = fresh_hashes(n_all)
        t0 = time.perf_counter()
        eng_src.store(range(n_all), prompt)
        outs = eng_src.drain()
        store_s = time.perf_counter() - t0
        if sum(o.committed for o in outs) != n_all:
            raise RuntimeError(f"27B store committed {sum(o.committed for o in outs)} of {n_all}: {outs}")
        _say(f"[{path}] 27B-class KV of {n_all * BLOCK_TOKENS} tokens ({n_all * PAGE / 2**30:.0f} GiB) stored in "
             f"{store_s:.3f} s")
        loads: dict[int, list[float]] = {blocks_32k: [], n_all: []}
        for _ in range(reps):
            for n in loads:
                if n > n_all:
                    continue
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = eng_dst.load(range(n), prompt[:n])
                eng_dst.wait_for_load(h)
                torch.cuda.current_stream(device).synchronize()
                loads[n].append(time.perf_counter() - t0)
                if h.loaded != n:
                    raise RuntimeError(f"27B load of {n} blocks installed {h.loaded}: {h}")
                eng_dst.drain()
        exact = same(list(range(n_all)), list(range(n_all)))
        t32 = _median(loads[blocks_32k]) if loads.get(blocks_32k) else None
        t_all = _median(loads[n_all])
        scaled = n_all < blocks_128k
        t128 = t_all * blocks_128k / n_all
        _say(f"[{path}] load 32k tokens: {t32 if t32 is None else round(t32, 3)} s; 128k tokens: {t128:.3f} s"
             f"{' (scaled from ' + str(n_all) + ' blocks: the arena is smaller)' if scaled else ''}; "
             f"seed's TTFT at 128k: {SEED_LOAD_S_128K} s; byte-exact: {exact}")
        for eng_src, eng_dst in engines.values():
            eng_src.close()
            eng_dst.close()
        for c in lane_clients:
            c.close()
    finally:
        pool.stop()

    head = paths_out[paths[0]]
    result.update({
        "paths": paths_out,
        "load_vs_plain_copy": head["load_vs_plain_copy"],
        "store_vs_plain_copy": head["store_vs_plain_copy"],
        "store_copy_vs_plain_copy": head["store_copy_vs_plain_copy"],
        "load_vs_plain_copy_min": head["load_vs_plain_copy_min"],
        "store_vs_plain_copy_min": head["store_vs_plain_copy_min"],
        "headline_path": paths[0],
        "load_s_27b_32k": None if t32 is None else round(t32, 4),
        "load_s_27b_128k": round(t128, 4),
        "load_27b_128k_method": f"scaled from {n_all} blocks" if scaled else "measured",
        "store_s_27b_128k": round(store_s * blocks_128k / n_all, 4),
        "seed_load_s_128k": SEED_LOAD_S_128K,
        "byte_exact": all(p["byte_exact"] for p in paths_out.values()) and exact,
    })
    lv, sv = result["load_vs_plain_copy"], result["store_vs_plain_copy"]
    result["targets"] = {
        "load_vs_plain_copy>=0.9": lv is not None and lv >= 0.9,
        "store_vs_plain_copy>=0.85": sv is not None and sv >= 0.85,
        "load_s_27b_128k<=0.70": result["load_s_27b_128k"] <= 0.70,
    }
    # Before and after, in this run: each path against its host-digest (xxh3-128) twin.
    result["vs_host_digest"] = {
        name: {"load": round(paths_out[name]["load_vs_plain_copy"] / paths_out[base]["load_vs_plain_copy"], 3),
               "store": round(paths_out[name]["store_vs_plain_copy"] / paths_out[base]["store_vs_plain_copy"], 3)}
        for name in paths_out for base in [name.partition("-")[0] + "-xxh3"]
        if base in paths_out and name != base and paths_out[name]["load_vs_plain_copy"]
        and paths_out[base]["load_vs_plain_copy"]
    }
    from kvgate.harness.provenance import provenance

    result["provenance"] = provenance()
    print(json.dumps(result))
    return 0 if result["byte_exact"] else 1


# -- N GPUs loading from one pool at once ------------------------------------------------------


class ConcurrentBenchError(RuntimeError):
    """A process of the concurrent bench failed, or did not answer in time."""


BARRIER_S = 120.0  # a process that waits longer at a step gives up (BrokenBarrierError)


def _concurrent_body(rank: int, gpus: int, unix: str, token: str, sizes: tuple[int, ...], reps: int, lanes: int,
                     hash_threads: int, chunk_mib: int, commit_mib: int, seed: int, path: str, barrier) -> dict:  # noqa: ANN001
    import torch

    from kvpool.client.pool_client import PoolClient
    from kvpool.gpu.config import CopyPath, TransferConfig
    from kvpool.gpu.transfer import TransferEngine

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    nmax = max(sizes)
    t_setup = time.monotonic()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1000 + rank)
    shape = (nmax, 2, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE)
    src = [torch.randint(-32768, 32767, shape, dtype=torch.int16, device=device, generator=gen).view(torch.bfloat16)
           for _ in range(LAYERS)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
    pinned = torch.empty(nmax * PAGE, dtype=torch.uint8, pin_memory=True)
    gpu_buf = torch.empty(nmax * PAGE, dtype=torch.uint8, device=device)
    clients = [PoolClient(unix, DEFAULT_TENANT, token, name=f"gpu{rank}-lane{i}", timeout_s=120.0)
               for i in range(lanes)]
    cfg = TransferConfig(path=CopyPath(path), block_dim=0, chunk_bytes=chunk_mib * 2**20,
                         commit_bytes=commit_mib * 2**20, hash_threads=hash_threads)
    eng_src = TransferEngine(clients[0], NS, src, cfg, lanes=clients)
    eng_dst = TransferEngine(clients[0], NS, dst, cfg, lanes=clients)
    try:
        base = (rank + 1) * 1_000_000_000  # a chain of this process's own
        hashes = block_hashes(range(base, base + BLOCK_TOKENS * nmax), BLOCK_TOKENS)
        torch.cuda.synchronize(device)
        t0 = time.monotonic()
        eng_src.store(range(nmax), hashes)
        outs = eng_src.drain()
        store_s = time.monotonic() - t0
        committed = sum(o.committed for o in outs)
        if committed != nmax:
            raise ConcurrentBenchError(f"GPU {rank}: store of {nmax} blocks committed {committed}: {outs}")
        setup_s = time.monotonic() - t_setup

        def plain(n: int) -> None:
            gpu_buf[: n * PAGE].copy_(pinned[: n * PAGE], non_blocking=True)
            torch.cuda.synchronize(device)

        def load(n: int) -> None:
            h = eng_dst.load(range(n), hashes[:n])
            eng_dst.wait_for_load(h)
            torch.cuda.current_stream(device).synchronize()
            if h.loaded != n:
                raise ConcurrentBenchError(f"GPU {rank}: load of {n} blocks installed {h.loaded}: {h}")

        def step(active: bool, fn, n: int) -> tuple[float, float] | None:  # noqa: ANN001
            torch.cuda.synchronize(device)
            barrier.wait(BARRIER_S)
            out = None
            if active:
                t0 = time.monotonic()
                fn(n)
                out = (t0, time.monotonic())
                if fn is load:
                    eng_dst.drain()  # the leases' release, outside the timing
            barrier.wait(BARRIER_S)
            return out

        res: dict[str, dict] = {}
        for n in sizes:
            d: dict = {k: [] for k in ("alone_plain", "alone_load", "concurrent_plain", "concurrent_load")}
            exact = None
            for r in range(reps):
                for g in range(gpus):
                    t = step(rank == g, plain, n)
                    if t:
                        d["alone_plain"].append(t)
                for g in range(gpus):
                    t = step(rank == g, load, n)
                    if t:
                        d["alone_load"].append(t)
                d["concurrent_plain"].append(step(True, plain, n))
                if r == 0:
                    for layer in dst:
                        layer[:n].zero_()
                d["concurrent_load"].append(step(True, load, n))
                if r == 0:
                    exact = all(torch.equal(a[:n].view(torch.int16), b[:n].view(torch.int16)) for a, b in zip(src, dst))
            d["byte_exact"] = exact
            res[str(n)] = d
        return {"rank": rank, "gpu": torch.cuda.get_device_name(device), "setup_s": round(setup_s, 2),
                "store_s": round(store_s, 3), "host_memory": str(eng_src.capabilities.host_memory.value),
                "sizes": res}
    finally:
        eng_src.close()
        eng_dst.close()
        for c in clients:
            c.close()


def _concurrent_worker(rank: int, results_q, barrier, *args) -> None:  # noqa: ANN001
    try:
        results_q.put(("ok", rank, _concurrent_body(rank, *args, barrier)))
    except BaseException as exc:  # reported to the parent, which raises ConcurrentBenchError
        results_q.put(("error", rank, "".join(traceback.format_exception(exc))[-4000:]))
        barrier.abort()  # the other processes stop waiting
        sys.exit(1)


def summarize_concurrent(results: dict[int, dict], sizes: tuple[int, ...], gpus: int) -> dict:
    """Per-size rows, per-GPU ratios and the aggregate from the processes' (start, end) times."""
    rows = {}
    for n in sizes:
        nbytes = n * PAGE
        per_gpu = []
        for rank in range(gpus):
            d = results[rank]["sizes"][str(n)]
            med = {k: _median([t1 - t0 for t0, t1 in d[k]])
                   for k in ("alone_plain", "alone_load", "concurrent_plain", "concurrent_load")}
            per_gpu.append({
                "gpu": rank, "byte_exact": d["byte_exact"],
                "plain_h2d_alone_GBps": round(nbytes / med["alone_plain"] / 1e9, 2),
                "load_alone_GBps": round(nbytes / med["alone_load"] / 1e9, 2),
                "plain_h2d_concurrent_GBps": round(nbytes / med["concurrent_plain"] / 1e9, 2),
                "load_concurrent_GBps": round(nbytes / med["concurrent_load"] / 1e9, 2),
                "load_alone_vs_plain_copy": round(med["alone_plain"] / med["alone_load"], 3),
                "load_concurrent_vs_plain_copy": round(med["alone_plain"] / med["concurrent_load"], 3),
                "median_s": {k: round(v, 6) for k, v in med.items()},
            })
        spans = {}
        for k in ("concurrent_plain", "concurrent_load"):
            reps = len(results[0]["sizes"][str(n)][k])
            spans[k] = _median([max(results[g]["sizes"][str(n)][k][r][1] for g in range(gpus))
                                - min(results[g]["sizes"][str(n)][k][r][0] for g in range(gpus)) for r in range(reps)])
        agg_load = gpus * nbytes / spans["concurrent_load"] / 1e9
        agg_plain = gpus * nbytes / spans["concurrent_plain"] / 1e9
        sum_alone = sum(g["plain_h2d_alone_GBps"] for g in per_gpu)
        rows[str(n)] = {
            "blocks_per_gpu": n, "MiB_per_gpu": nbytes // 2**20, "per_gpu": per_gpu,
            "aggregate_load_GBps": round(agg_load, 2), "aggregate_plain_concurrent_GBps": round(agg_plain, 2),
            "sum_plain_alone_GBps": round(sum_alone, 2),
            "aggregate_load_vs_sum_plain_copy": round(agg_load / sum_alone, 3),
            "aggregate_load_vs_concurrent_plain_copy": round(agg_load / agg_plain, 3),
            "median_span_s": {k: round(v, 6) for k, v in spans.items()},
        }
    big = [rows[str(n)] for n in sizes if n * PAGE >= 256 * 2**20] or [rows[str(max(sizes))]]
    big_bytes = sum(r["MiB_per_gpu"] * 2**20 for r in big)

    def per_gpu_ratio(rank: int, key: str) -> float:
        return round(sum(r["per_gpu"][rank]["median_s"]["alone_plain"] for r in big)
                     / sum(r["per_gpu"][rank]["median_s"][key] for r in big), 3)

    plain_by_gpu = {str(g): round(big_bytes / sum(r["per_gpu"][g]["median_s"]["alone_plain"] for r in big) / 1e9, 2)
                    for g in range(gpus)}
    agg = gpus * big_bytes / sum(r["median_span_s"]["concurrent_load"] for r in big) / 1e9
    agg_plain = gpus * big_bytes / sum(r["median_span_s"]["concurrent_plain"] for r in big) / 1e9
    return {
        "rows": rows,
        "headline_sizes_blocks_per_gpu": [r["blocks_per_gpu"] for r in big],
        "load_concurrent_vs_plain_copy_by_gpu": {str(g): per_gpu_ratio(g, "concurrent_load") for g in range(gpus)},
        "load_alone_vs_plain_copy_by_gpu": {str(g): per_gpu_ratio(g, "alone_load") for g in range(gpus)},
        "plain_copy_alone_GBps_by_gpu": plain_by_gpu,
        "aggregate_load_GBps": round(agg, 2),
        "aggregate_plain_concurrent_GBps": round(agg_plain, 2),
        "aggregate_load_vs_sum_plain_copy": round(agg / sum(plain_by_gpu.values()), 3),
        "aggregate_load_vs_concurrent_plain_copy": round(agg / agg_plain, 3),
        "byte_exact": all(g["byte_exact"] is True for r in rows.values() for g in r["per_gpu"]),
    }


def run_concurrent(gpus: int, sizes: tuple[int, ...] = (64, 256, 1024), reps: int = 3, lanes: int = 8,
                   hash_threads: int = 8, io_threads: int = 8, chunk_mib: int = 128, commit_mib: int = 32,
                   seed: int = 0, path: str = "torch", timeout_s: float = 540.0) -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA GPU on this machine: kvgate bench gpu --gpus needs one"}))
        return 2
    visible = torch.cuda.device_count()
    if gpus < 1 or gpus > visible:
        print(json.dumps({"error": f"--gpus {gpus}: {visible} GPU(s) visible"}))
        return 2
    if not sizes:
        raise ValueError("no transfer sizes")
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    want = gpus * max(sizes) + 16
    if _shm_blocks(want) < want:
        raise ConcurrentBenchError(f"memory holds {_shm_blocks(want)} pages of {PAGE >> 20} MiB; the concurrent "
                                   f"bench needs {want} ({want * PAGE / 2**30:.1f} GiB)")
    _say(f"kvgate bench gpu --gpus {gpus}: {', '.join(names)}; one pool of {want} pages ({want * PAGE / 2**30:.1f} GiB);"
         f" sizes {list(sizes)} blocks per GPU ({[n * PAGE >> 20 for n in sizes]} MiB); reps {reps}; path {path}; "
         f"lanes {lanes}, digest threads {hash_threads} per GPU")
    t0 = time.monotonic()
    pool = _Pool(PAGE, want, io_threads)
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    barrier = ctx.Barrier(gpus)
    procs = [ctx.Process(target=_concurrent_worker, name=f"kvgate-bench-gpu{r}",
                         args=(r, results_q, barrier, gpus, pool.unix, pool.token, tuple(sizes), reps, lanes, hash_threads,
                               chunk_mib, commit_mib, seed, path))
             for r in range(gpus)]
    results: dict[int, dict] = {}
    errors: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        silent_since: dict[int, float] = {}
        while len(results) + len(errors) < gpus:
            try:
                kind, rank, payload = results_q.get(timeout=2.0)
            except queue_mod.Empty:  # check the processes and the clock
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if not p.is_alive() and r not in results and r not in errors:
                        silent_since.setdefault(r, now)
                # a process that died without a word (its last message had 5 s to arrive): stop the others
                gone = [r for r, t in silent_since.items() if now - t > 5 and r not in results and r not in errors]
                if gone:
                    barrier.abort()
                    raise ConcurrentBenchError(f"bench process(es) {gone} exited without a result (exit codes "
                                               f"{[procs[r].exitcode for r in gone]})") from None
                if now > deadline:
                    barrier.abort()
                    raise ConcurrentBenchError(f"no result from {gpus - len(results) - len(errors)} bench "
                                               f"process(es) within {timeout_s} s") from None
                continue
            (results if kind == "ok" else errors)[rank] = payload
            if kind == "ok":
                _say(f"  GPU {rank}: done (set-up {payload['setup_s']} s, store of {max(sizes)} blocks "
                     f"{payload['store_s']} s, host memory {payload['host_memory']})")
        if errors:
            raise ConcurrentBenchError("; ".join(f"GPU {r}: {e}" for r, e in sorted(errors.items())))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
                p.join(10)
        pool.stop()
    summary = summarize_concurrent(results, tuple(sizes), gpus)
    for n in sizes:
        row = summary["rows"][str(n)]
        per = "; ".join(f"GPU {g['gpu']}: plain {g['plain_h2d_alone_GBps']} GB/s, load alone {g['load_alone_GBps']}, "
                        f"load concurrent {g['load_concurrent_GBps']} ({g['load_concurrent_vs_plain_copy']}x)"
                        for g in row["per_gpu"])
        _say(f"  {n:>5} blocks/GPU ({row['MiB_per_gpu']} MiB): {per} | aggregate load {row['aggregate_load_GBps']} GB/s "
             f"vs plain at once {row['aggregate_plain_concurrent_GBps']} ({row['aggregate_load_vs_concurrent_plain_copy']}"
             f"x), vs the sum of plain alone {row['sum_plain_alone_GBps']} ({row['aggregate_load_vs_sum_plain_copy']}x)")
    out = {
        "gpus": gpus, "gpu_names": names, "torch": torch.__version__,
        "model": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE, "dtype": "bfloat16",
                  "block_tokens": BLOCK_TOKENS, "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "page_bytes": PAGE},
        "config": {"sizes_blocks_per_gpu": list(sizes), "reps": reps, "lanes": lanes, "hash_threads": hash_threads,
                   "pool_io_threads": io_threads, "chunk_mib": chunk_mib, "commit_mib": commit_mib, "seed": seed,
                   "path": path, "pool_pages": want},
        "per_process": {str(r): {k: v for k, v in res.items() if k != "sizes"} for r, res in sorted(results.items())},
        "wall_s": round(time.monotonic() - t0, 1),
        **summary,
    }
    from kvgate.harness.provenance import provenance

    out["provenance"] = provenance()
    print(json.dumps(out))
    return 0 if out["byte_exact"] else 1
