"""The GPU tier's load of a long prefix, through the keeper as an operator runs it: `python -m
kvpool keeper --backing vmm` in its own process, a producer and a consumer in spawned processes
reaching it through TierClient over its sockets (kvgate.harness.scenarios.gpu_keeper_socket).
The producer publishes N pages of one 27B-class KV block each (16 tokens x 160 KiB = 2.5 MiB:
Mistral Small 3.1 24B's 40 layers x 8 KV heads x 128 x 2 bytes x K and V); the consumer loads
them `--repeats` times (acquire in one frame, one gather from the tier into its own tensor, the
host waits for it, release), then checks every byte and every page's GPU sketch against the
committed digest. The baseline, in the same process and run: a plain device-to-device copy of
the same bytes.

    scripts/gpu/reports.sh OUT tierload     (32k, 64k, 128k and 256k; TIER_LOAD_TOKENS="..." for others)
    PYTHONPATH=/tmp/site:$PWD KVGATE_PROVENANCE=stamp python3 scripts/gpu/tier_load_bench.py OUT.json \
        [--tokens 128000] [--repeats 5]

On the GPU host, KVGATE_PROVENANCE=stamp (reports.sh sets it) makes the JSON's provenance the
stamp's (.provenance.json, verified against the carried tree), not the copy's own git.

What it is not: the connector's load into vLLM's paged KV cache (a scatter per layer, not one
gather; kvpool's connector does not load from the GPU tier yet), nor a served request's TTFT.
JSON keys name the tier: gpu_tier_load_s_27b_<k>k (median), gpu_tier_load_vs_raw_copy, and the
phases. Exit status 1 when a byte or a digest differs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from kvgate.harness.provenance import provenance  # noqa: E402
from kvgate.harness.scenarios import gpu_keeper_socket as S  # noqa: E402

BLOCK_TOKENS = 16
KV_PER_TOKEN = 163840  # Mistral Small 3.1 24B (kvgate.fixtures.arch_model): 40 x 8 x 128 x 2 x 2 bytes
SEED003_ON_128K_S = 0.605  # the seed's cross-replica TTFT at 128k (host pool)
TARGET_S = 0.05  # the GPU tier's target for 128k tokens of 27B-class KV
TOKEN = "tier-load-bench"
KEEPER_START_S = 120.0


def ask(conn, *cmd, timeout: float = 600):  # noqa: ANN001, ANN002, ANN201
    conn.send(cmd)
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer to {cmd[0]} within {timeout}s")
    reply = conn.recv()
    if reply[0] != "ok":
        raise RuntimeError(f"{cmd[0]}: {reply}")
    return reply[1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokens", type=int, default=128000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=3)
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.tokens < BLOCK_TOKENS:
        ap.error(f"--repeats must be at least 1 and --tokens at least {BLOCK_TOKENS}")
    page = BLOCK_TOKENS * KV_PER_TOKEN
    n = a.tokens // BLOCK_TOKENS
    pages = n + 64
    run_dir = Path(tempfile.mkdtemp(prefix="tier-load-")) / "keeper"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    t0 = time.perf_counter()
    keeper = subprocess.Popen([sys.executable, "-m", "kvpool", "keeper", "--gpu", "0", "--backing", "vmm",
                               "--run-dir", str(run_dir), "--page-size", str(page), "--pages", str(pages),
                               "--tenant", f"default={TOKEN}", "--lease-ttl", "600", "--reservation-ttl", "600"],
                              env=env, stderr=subprocess.PIPE, text=True)
    address = run_dir / "keeper-address.json"
    while not address.exists():
        if keeper.poll() is not None:
            raise SystemExit(f"the keeper exited {keeper.returncode}: {keeper.stderr.read()[-2000:]}")
        if time.perf_counter() - t0 > KEEPER_START_S:
            keeper.kill()
            raise SystemExit(f"the keeper wrote no address within {KEEPER_START_S} s")
        time.sleep(0.1)
    keeper_up_s = time.perf_counter() - t0
    sock = json.loads(address.read_text())["socket"]
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    result: dict = {"provenance": provenance(), "tokens": a.tokens, "pages": n, "page_bytes": page,
                    "bytes": n * page, "keeper_up_s": round(keeper_up_s, 2), "repeats": a.repeats}
    try:
        for _ in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=S.socket_replica, args=(child, sock, "default", TOKEN, 0))
            p.start()
            child.close()
            if not parent.poll(300):
                raise TimeoutError("a replica did not connect within 300 s")
            hello = parent.recv()
            if hello[0] != "ok":
                raise RuntimeError(f"a replica failed: {hello}")
            procs.append(p)
            conns.append(parent)
        result["device"] = hello[3]
        keys = S.keys(n, base=a.seed * 10_000_000)
        committed, publish_s = ask(conns[0], "publish_bulk", keys, a.seed)
        result.update(committed=committed, publish_s=round(publish_s, 3))
        got = ask(conns[1], "load_bulk", keys, a.seed, a.repeats)[0]
        med = {k: statistics.median(v) for k, v in got["times_s"].items()}
        raw = statistics.median(got["raw_copy_s"])
        k = a.tokens // 1000
        result.update({
            f"gpu_tier_load_s_27b_{k}k": round(med["load"], 4),
            "phases_median_s": {x: round(v, 4) for x, v in med.items()},
            "load_s_all": [round(v, 4) for v in got["times_s"]["load"]],
            "raw_copy_s": round(raw, 4), "raw_copy_GBps": round(n * page / raw / 1e9, 1),
            "gather_GBps": round(n * page / med["gather"] / 1e9, 1),
            "gpu_tier_load_vs_raw_copy": round(med["load"] / raw, 3),
            "target_s": TARGET_S, "vs_target": round(med["load"] / TARGET_S, 3),
            "seed003_on_128k_s": SEED003_ON_128K_S,
            "sketch_and_digests_s": round(got["sketch_and_digests_s"], 4),
            "check_split_s": {k: round(v, 4) for k, v in got["check_s"].items()},
            f"gpu_tier_verified_load_s_27b_{k}k": round(med["load"] + got["sketch_and_digests_s"], 4),
            "bytes_differ": got["bytes_differ"], "digests_differ": got["digests_differ"],
        })
    finally:
        for c in conns:
            try:
                ask(c, "exit", timeout=60)
            except (OSError, EOFError, TimeoutError, RuntimeError) as exc:  # kept in the result
                result.setdefault("teardown_errors", []).append(f"{type(exc).__name__}: {exc}")
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        keeper.send_signal(signal.SIGTERM)
        result["keeper_exit"] = keeper.wait(60)
    ok = (result.get("bytes_differ") == 0 and result.get("digests_differ") == 0 and result.get("committed") == n
          and result.get("keeper_exit") == 0 and not result.get("teardown_errors"))
    result["ok"] = ok
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
