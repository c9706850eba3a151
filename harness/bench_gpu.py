"""`kvgate bench gpu`: the GPU transfer engine (kvpool.gpu_transfer) against a plain
pinned cudaMemcpy of the same bytes, measured in the same run, interleaved rep by rep.

  1. store and load of 16 to 4096 blocks of a 27B-class KV layout (64 layers, 8 KV heads,
     head size 128, bf16, 16-token blocks: 256 KiB of KV per token, 4 MiB per block, one
     block per pool page), next to `copy_` between a pinned host buffer
     (cudaHostAlloc) and the GPU of the same number of bytes.
       store: store() until the last commit: gather, device-to-host copies into the
              registered arena, XXH3-128 digests, the pool's re-verify, commit.
              (store_copy: until the copies alone completed.)
       load:  load() until the engine's stream holds the blocks: lease, digest check of
              every page, host-to-device copies, scatter; the lease's release follows
              in the background.
     Ratios are plain time / engine time over all transfers of 256 MiB and more (sums of
     the per-size medians); the worst size is reported too.
  2. the time to load the KV of 32k and 128k tokens of that model into the engine's
     KV tensors, next to the seed's 0.605 s TTFT at 128k (003_13ba88f9229fb28c.txt).
The pool daemon runs in its own process with `--pool-io-threads` verify threads; the
engine commits on `--lanes` connections. Progress goes to stderr; the last line printed
is one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness.pool_proc import DEFAULT_TENANT, unique_name
from kvpool.arena import Arena
from kvpool.keys import Namespace, block_hashes
from kvpool.server import PoolConfig, main_serve, read_address

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS, DTYPE_BYTES = 64, 8, 128, 16, 2
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_SIZE * DTYPE_BYTES  # K and V: 262144 = 256 KiB
PAGE = KV_BYTES_PER_TOKEN * BLOCK_TOKENS  # 4 MiB
SIZES = (16, 64, 256, 1024, 4096)
SEED_LOAD_S_128K = 0.605
NS = Namespace("bench-27b", "r1", "tok", "bfloat16", "cuda:N,2,B,H,D", BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_SIZE)


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
        from kvpool.client import PoolClient

        return PoolClient(self.unix, DEFAULT_TENANT, self.token, name=name, timeout_s=120.0)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        Arena.unlink(self.name)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _digest_ceiling(arena, pages: int, threads: int) -> dict[str, float]:  # noqa: ANN001
    """Page digests per second on this host with 1, 4, 8 and `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    from kvpool.digest import page_digest

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


def _shm_blocks(want: int) -> int:
    st = os.statvfs("/dev/shm")
    avail = st.f_bavail * st.f_frsize - 2 * 2**30  # leave room for the tests' and others' segments
    return max(16, min(want, avail // PAGE))


def run_bench(quick: bool = False, paths: tuple[str, ...] = ("torch", "driver"), reps: int = 3,
              max_blocks: int = 4096, lanes: int = 8, hash_threads: int = 8, io_threads: int = 8,
              chunk_mib: int = 128, commit_mib: int = 32, seed: int = 0) -> int:
    import torch

    from kvpool.gpu_transfer import CopyPath, TransferConfig, TransferEngine

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
        for path in paths:
            cfg = TransferConfig(path=CopyPath(path), block_dim=0, chunk_bytes=chunk_mib * 2**20,
                                 commit_bytes=commit_mib * 2**20, hash_threads=hash_threads)
            t0 = time.perf_counter()
            eng_src = TransferEngine(ctl, NS, src, cfg, lanes=lane_clients)
            eng_dst = TransferEngine(ctl, NS, dst, cfg, lanes=lane_clients)
            engines[path] = (eng_src, eng_dst)
            caps = eng_src.capabilities
            _say(f"[{path}] engine ready in {time.perf_counter() - t0:.1f} s: host memory {caps.host_memory.value}"
                 f"{' (' + caps.host_memory_reason + ')' if caps.host_memory_reason else ''}"
                 + (f", batched copies {caps.batched_copies} {caps.batched_reason}" if path == "driver" else ""))
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
        "store_vs_plain_copy>=0.9": sv is not None and sv >= 0.9,
        "load_s_27b_128k<=seed_0.605": result["load_s_27b_128k"] <= SEED_LOAD_S_128K,
    }
    print(json.dumps(result))
    return 0 if result["byte_exact"] else 1
