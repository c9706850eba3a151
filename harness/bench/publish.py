"""`kvgate bench publish`: does publishing slow the producer? One live replica (kvgate
connector, its own pool), one core, requests back to back with fresh prompts, in pairs:

  first   a prompt of N tokens, published (`publish: true`) or not (`publish: false`),
          alternating pair by pair, so both kinds see the same machine state;
  next    right after the first one's last token, another fresh prompt of N tokens that
          publishes nothing: its TTFT is what the producer's next request pays while the
          first one's blocks are still being copied and committed (or, in the baseline
          pairs, while nothing is).

Per length: medians and p95s of both TTFTs, publishing and not, and the ratios
`next_ttft_after_publish_vs_after_none` (the issue's figure: publishing must not slow the
next request) and `own_ttft_publish_vs_none` (what publishing costs the request itself),
plus how many blocks the published firsts committed (the work was done). Every prompt
is new (no local or pooled prefix): each request prefills all of its tokens. The last
line printed is one JSON object.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvgate.harness.client.http import complete
from kvgate.harness.system.cluster import Cluster, ReplicaSpec
from kvgate.harness.workload.prompts import Corpus

LENGTHS = (1024, 4096, 16384)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _committed(cluster: Cluster, tag: str) -> int:
    from kvgate.harness.checkers.history import records

    return sum(int(r.get("committed", 0)) for r in records(cluster.history_dir, "publish") if r.get("tag") == tag)


def run_bench(pairs: int = 8, lengths: tuple[int, ...] = LENGTHS, report_dir: Path | None = None,
              seed: int = 20261201) -> int:
    from kvgate.fixtures.tiny_model import build_tiny_model

    report_dir = report_dir or Path(tempfile.mkdtemp(prefix="kvgate-bench-publish-"))
    model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
    corpus = Corpus(model)
    max_len = max(lengths) + 1024
    cluster = Cluster(model, report_dir / "kvgate", page_size=128 * 1024, pool_pages=4096)
    _say("kvgate bench publish: starting replica A (kvgate connector) ...")
    cluster.start([ReplicaSpec("A", core="0", max_model_len=max_len, kv_bytes=1 << 30)])
    rng = random.Random(seed)
    rows = []
    try:
        url = cluster.replicas["A"].url
        complete(url, corpus.text(64, rng), tag="warmup", replica="A", max_tokens=1, publish=False, load=False)
        for n in lengths:
            got: dict[str, list[float]] = {"own_publish": [], "own_none": [], "next_publish": [], "next_none": []}
            committed = 0
            for p in range(pairs):
                publishing = p % 2 == 0
                kind = "publish" if publishing else "none"
                tag = f"first-{n}-{p}"
                first = complete(url, corpus.text(n - 1, rng), tag=tag, replica="A", max_tokens=1,
                                 publish=publishing, load=False)
                nxt = complete(url, corpus.text(n - 1, rng), tag=f"next-{n}-{p}", replica="A", max_tokens=1,
                               publish=False, load=False)
                got[f"own_{kind}"].append(first.ttft_s * 1e3)
                got[f"next_{kind}"].append(nxt.ttft_s * 1e3)
                if publishing:
                    deadline = time.monotonic() + 30
                    while (c := _committed(cluster, tag)) == 0 and time.monotonic() < deadline:
                        time.sleep(0.05)  # its store ends in the background; count it before the next pair
                    committed += c
            row: dict[str, object] = {"prompt_tokens": n, "pairs": pairs, "published_blocks_committed": committed}
            for key, values in got.items():
                row[f"{key}_ttft_ms"] = round(statistics.median(values), 1)
                row[f"{key}_ttft_ms_p95"] = round(_pct(values, 0.95), 1)
            row["next_ttft_after_publish_vs_after_none"] = round(row["next_publish_ttft_ms"] / row["next_none_ttft_ms"], 3)
            row["own_ttft_publish_vs_none"] = round(row["own_publish_ttft_ms"] / row["own_none_ttft_ms"], 3)
            _say(f"  {n:>6} tokens: next request {row['next_publish_ttft_ms']} ms after a publishing one, "
                 f"{row['next_none_ttft_ms']} ms after one that did not "
                 f"({row['next_ttft_after_publish_vs_after_none']}x); its own TTFT {row['own_publish_ttft_ms']} vs "
                 f"{row['own_none_ttft_ms']} ms ({row['own_ttft_publish_vs_none']}x); {committed} blocks committed")
            rows.append(row)
    finally:
        cluster.stop()
    result: dict[str, object] = {
        "rows": rows,
        "targets": {"next_request_not_slowed_by_publishing_1.1x": all(
            r["next_ttft_after_publish_vs_after_none"] <= 1.1 for r in rows)},
    }
    from kvgate.harness.provenance import provenance

    result["provenance"] = provenance()
    print(json.dumps(result))
    return 0
