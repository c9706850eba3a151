"""Medians over several runs of the GPU live bench (`kvgate gpu-live --bench`), pooled per
prefix length from each run's per-repetition TTFTs, with the ratios and the host-to-device
floor computed again from the pooled medians. Prints one JSON object.

    python scripts/gpu/pool_runs.py RESULT.json [RESULT.json ...] > pooled.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KINDS = ("cold_prefill_ms", "local_hit_ttft_ms", "remote_hit_ttft_ms", "remote_sync_hit_ttft_ms",
         "peer_hit_ttft_ms", "peer_cached_hit_ttft_ms")
RATIOS = (("remote_vs_peer", "remote_hit_ttft_ms", "peer_hit_ttft_ms"),
          ("remote_vs_peer_cached", "remote_hit_ttft_ms", "peer_cached_hit_ttft_ms"),
          ("remote_vs_local", "remote_hit_ttft_ms", "local_hit_ttft_ms"),
          ("remote_sync_vs_peer", "remote_sync_hit_ttft_ms", "peer_hit_ttft_ms"),
          ("remote_sync_vs_peer_cached", "remote_sync_hit_ttft_ms", "peer_cached_hit_ttft_ms"),
          ("remote_sync_vs_local", "remote_sync_hit_ttft_ms", "local_hit_ttft_ms"))


def pool(results: list[dict]) -> dict:
    benches = [r["bench"] for r in results]
    h2d = statistics.median(b["pinned_h2d_GBps"] for b in benches)
    by_len: dict[int, list[dict]] = {}
    for b in benches:
        for row in b["rows"]:
            by_len.setdefault(row["prefix_tokens"], []).append(row)
    rows = []
    for n, same in sorted(by_len.items()):
        out: dict = {"prefix_tokens": n, "runs": sum(r["runs"] for r in same), "kv_bytes": same[0]["kv_bytes"]}
        for kind in KINDS:
            values = [v for r in same for v in r.get(f"{kind}_all", [])]
            if values:
                out[kind] = round(statistics.median(values), 1)
        for name, a, b in RATIOS:
            if a in out and b in out:
                out[name] = round(out[a] / out[b], 3)
        floor = out["kv_bytes"] / (h2d * 1e9) * 1e3
        out["h2d_floor_ms"] = round(floor, 1)
        out["floor_vs_local"] = round((out["local_hit_ttft_ms"] + floor) / out["local_hit_ttft_ms"], 3)
        rows.append(out)
    return {"pinned_h2d_GBps": round(h2d, 2), "rows": rows,
            "provenance": [r["env"].get("provenance") for r in results]}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(pool([json.loads(Path(p).read_text()) for p in argv]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
