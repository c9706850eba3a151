"""Where a GPU load's time goes: one engine load of N 27B-class blocks (the layout of
`kvgate bench gpu`) with every phase timed, next to a plain pinned copy of the same bytes.

Host phases (perf_counter): the acquire's round trip, the first copy's issue, load()'s
return, the wait for the engine stream. GPU phases (timing events recorded on the stream
each kernel or copy runs on, placed on the host's clock through an event recorded on an
idle GPU at the load's start): every chunk's host-to-device copy, sketch and scatter; the
copy engine's idle time between consecutive chunk copies; the tail from the last copy's
end to the last scatter's end. The engine is wrapped from outside (its instance
attributes), never changed.

  python scripts/gpu/load_timeline.py [--blocks 256,4096] [--reps 3] > timeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from kvgate.harness.bench.gpu import BLOCK_TOKENS, HEAD_SIZE, KV_HEADS, LAYERS, NS, PAGE, _Pool
from kvpool.gpu.config import CopyPath, TransferConfig
from kvpool.gpu.transfer import TransferEngine
from kvpool.pool.keys import block_hashes


def _timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class _Recorder:
    """Wraps one engine's copy, sketch and scatter calls with timing events."""

    def __init__(self, eng: TransferEngine):
        self.eng = eng
        self.spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {"h2d": [], "sketch": [], "scatter": []}
        self.host: dict[str, float] = {}
        for name, attr in (("h2d", "_h2d"), ("sketch", "_sketch_to_host"), ("scatter", "_scatter")):
            self._wrap(name, attr)
        acquire = eng.backend.acquire

        def timed_acquire(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            out = acquire(*a, **k)
            self.host["acquire_s"] = time.perf_counter() - t
            self.host["acquired_at"] = time.perf_counter()
            return out

        eng.backend.acquire = timed_acquire

    def _wrap(self, name: str, attr: str) -> None:
        fn = getattr(self.eng, attr)

        def wrapped(*a, **k):  # noqa: ANN002, ANN003, ANN202
            s, e = _timed_event(), _timed_event()
            stream = torch.cuda.current_stream()
            s.record(stream)
            if name == "h2d" and "first_issue_at" not in self.host:
                self.host["first_issue_at"] = time.perf_counter()
            out = fn(*a, **k)
            e.record(stream)
            self.spans[name].append((s, e))
            return out

        setattr(self.eng, attr, wrapped)

    def reset(self) -> None:
        for v in self.spans.values():
            v.clear()
        self.host.clear()


def _one_load(eng: TransferEngine, rec: _Recorder, tgt: list[int], hashes: list[bytes]) -> dict:
    rec.reset()
    torch.cuda.synchronize()
    base = _timed_event()
    t0 = time.perf_counter()
    base.record(torch.cuda.current_stream())
    h = eng.load(tgt, hashes)
    t_ret = time.perf_counter()
    eng.wait_for_load(h)
    torch.cuda.current_stream().synchronize()
    t_end = time.perf_counter()
    torch.cuda.synchronize()
    if h.loaded != len(tgt):
        raise RuntimeError(f"load installed {h.loaded} of {len(tgt)} blocks: {h}")

    def ms(ev: torch.cuda.Event) -> float:
        return base.elapsed_time(ev)

    spans = {k: [(ms(s), ms(e)) for s, e in v] for k, v in rec.spans.items()}
    h2d = spans["h2d"]
    gaps = [b[0] - a[1] for a, b in zip(h2d, h2d[1:])]
    last = max([e for _, e in spans["scatter"]] or [h2d[-1][1]])
    return {
        "total_ms": (t_end - t0) * 1e3,
        "acquire_ms": rec.host["acquire_s"] * 1e3,
        "acquired_to_first_issue_ms": (rec.host["first_issue_at"] - rec.host["acquired_at"]) * 1e3,
        "first_copy_start_ms": h2d[0][0],
        "copies_ms": sum(e - s for s, e in h2d),
        "copy_engine_idle_between_chunks_ms": sum(max(0.0, g) for g in gaps),
        "worst_gap_ms": max(gaps or [0.0]),
        "last_copy_end_ms": h2d[-1][1],
        "tail_after_last_copy_ms": last - h2d[-1][1],
        "host_return_ms": (t_ret - t0) * 1e3,
        "chunks": len(h2d),
        "sketch_ms_per_chunk": statistics.median([e - s for s, e in spans["sketch"]] or [0.0]),
        "scatter_ms_per_chunk": statistics.median([e - s for s, e in spans["scatter"]] or [0.0]),
        "copy_ms_per_chunk": statistics.median([e - s for s, e in h2d]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="256,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=128)
    args = ap.parse_args()
    sizes = [int(x) for x in args.blocks.split(",")]
    device = torch.device("cuda", torch.cuda.current_device())
    arena_blocks = max(sizes) + 64
    pool = _Pool(PAGE, arena_blocks, 8)
    out: dict = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "sizes": {}}
    try:
        ctl = pool.client("timeline")
        shape = (arena_blocks, 2, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE)
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        src = [torch.randint(-32768, 32767, shape, dtype=torch.int16, device=device, generator=gen).view(torch.bfloat16)
               for _ in range(LAYERS)]
        dst = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
        cfg = TransferConfig(path=CopyPath.TORCH, block_dim=0, chunk_bytes=args.chunk_mib * 2**20)
        eng_src = TransferEngine(ctl, NS, src, cfg)
        loader = pool.client("loader")
        eng_dst = TransferEngine(loader, NS, dst, cfg)
        rec = _Recorder(eng_dst)
        pinned = torch.empty(max(sizes) * PAGE, dtype=torch.uint8, pin_memory=True)
        gpu_buf = torch.empty(max(sizes) * PAGE, dtype=torch.uint8, device=device)
        rng = np.random.default_rng(0)
        chain = 1
        for n in sizes:
            rows = []
            plain = []
            for _ in range(args.reps):
                chain += 1
                hashes = block_hashes(range(chain * 1_000_000, chain * 1_000_000 + BLOCK_TOKENS * n), BLOCK_TOKENS)
                ids = [int(x) for x in rng.choice(arena_blocks, n, replace=False)]
                tgt = [int(x) for x in rng.choice(arena_blocks, n, replace=False)]
                eng_src.store(ids, hashes)
                eng_src.drain()
                torch.cuda.synchronize()
                t = time.perf_counter()
                gpu_buf[: n * PAGE].copy_(pinned[: n * PAGE], non_blocking=True)
                torch.cuda.synchronize()
                plain.append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                sk = torch.empty((n, PAGE // 16384, 16), dtype=torch.int32, pin_memory=True)
                pin_ms = (time.perf_counter() - t) * 1e3
                del sk
                row = _one_load(eng_dst, rec, tgt, hashes)
                row["pinned_sketch_alloc_ms"] = pin_ms
                rows.append(row)
                eng_dst.drain()
                ctl.evict(NS, hashes)
            med = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
            med["plain_h2d_ms"] = round(statistics.median(plain), 3)
            med["load_vs_plain_copy"] = round(med["plain_h2d_ms"] / med["total_ms"], 3)
            out["sizes"][str(n)] = med
            print(f"{n} blocks: {med}", file=sys.stderr, flush=True)
    finally:
        pool.stop()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
