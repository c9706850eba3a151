"""`kvgate gpu-live`: kvgate live on one GPU with vLLM 0.24 (the GPU bundle).

Two replicas (A, B) of the tiny model share one GPU and one kvpool pool through kvpool's
connector, each under the audit wrapper (kvpool.audit) around
faults.gpu_live.StreamDelayConnector (kvpool's connector with the stream-delay fault
site), with a fault-control file each. Three exchanges, each on a fresh seeded prompt of
several blocks; in each, A computes and publishes, B loads, then B recomputes the same
prompt cold (its prefix cache reset, pool bypassed):

  cross_replica_hit   no fault: B's tokens equal its cold run's, and the byte-exact oracle
                      (harness.live_checks.byte_exact) holds: every block B installed
                      equals A's produced bytes and the pool's committed copy, and B's own
                      cold recompute gives the same bytes.
  stream_delay        A's step that publishes runs behind a torch.cuda._sleep enqueued on
                      the engine's stream before the forward writes the KV; the ordered
                      engine must still publish exact bytes (same checks).
  stream_delay_control
                      the same delay with the negative control armed (the transfer engine
                      drops the store's dependency on the engine's stream,
                      faults.gpu_live.SwitchableTransferEngine): the byte-exact check must
                      catch it (a FAIL verdict there is the expected outcome).

  GpuCluster            harness.cluster.Cluster with vLLM 0.24 GPU flags and the fault site
                        as the audit wrapper's inner connector.
  run_live(report_dir, seed)  -> dict    the three exchanges and their verdicts.
  render_markdown(result)     -> str     the checklist.
The last line printed is the result as one JSON object. Each verdict says what it does not
check. The delay is seeded only in its length; a seed cannot force a thread interleaving.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

from harness.cluster import Cluster, ReplicaSpec
from harness.live_checks import audit_digests, byte_exact, namespace_of, pool_digests, records
from harness.workload import Completion, Corpus, complete
from reports.render import Verdict

BLOCK_SIZE = 16  # TRITON_ATTN needs a multiple of 16; set explicitly so kernel and manager blocks agree
STREAM_DELAY_MS = 300.0
FAULT_SITE = "faults.gpu_live:StreamDelayConnector"


class GpuLiveError(RuntimeError):
    """A live GPU step could not run (a publish never landed, a reset was refused)."""


def gpu_args(memory_utilization: float, block_size: int = BLOCK_SIZE) -> tuple[str, ...]:
    """vLLM 0.24 flags for a replica sharing one GPU (the bundle has TRITON_ATTN only)."""
    return ("--attention-backend", "TRITON_ATTN", "--enforce-eager", "--block-size", str(block_size),
            "--gpu-memory-utilization", str(memory_utilization))


class GpuCluster(Cluster):
    """A Cluster whose audited replicas with a fault file run the GPU fault site
    (faults.gpu_live.StreamDelayConnector) as the audit wrapper's inner connector."""

    def kv_transfer_config(self, spec: ReplicaSpec) -> dict:
        config = super().kv_transfer_config(spec)
        if spec.audit and spec.faults_file:
            config["kv_connector_extra_config"]["audit_inner"] = FAULT_SITE
        return config

    def arm(self, replica: str, section: dict | None) -> None:
        """Write the replica's "gpu" fault section (None: disarm)."""
        self.faults[replica].write_text(json.dumps({"gpu": section} if section else {}))
        self.nemesis("gpu_fault_arm" if section else "gpu_fault_heal", replica=replica, section=section)


def reset_prefix_cache(url: str, timeout_s: float = 30.0) -> None:
    """POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1), retried while the engine is busy."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST", data=b"")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.URLError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise GpuLiveError(f"{url}: reset_prefix_cache not accepted within {timeout_s}s ({last})")


def wait_published(history_dir: Path, replica: str, tag: str, blocks: int, timeout_s: float = 60.0) -> list[dict]:
    """Wait until the replica's `publish` records for `tag` cover `blocks` blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = records(history_dir, "publish", replica=replica, tag=tag)
        if sum(int(r["blocks"]) for r in recs) >= blocks:
            return recs
        if time.monotonic() > deadline:
            raise GpuLiveError(f"{replica} published {sum(int(r['blocks']) for r in recs)} of {blocks} blocks of "
                               f"{tag} within {timeout_s}s: {recs}")
        time.sleep(0.1)


def published_exact(cluster: Cluster, producer: str, tag: str) -> Verdict:
    """Every block the producer computed for `tag` equals the pool's committed copy."""
    produced = audit_digests(cluster.history_dir, "produced", tag, producer)
    pool = pool_digests(cluster, namespace_of(cluster.history_dir, producer), list(produced))
    differ = [k for k, d in produced.items() if k in pool and pool[k] != d]
    evidence = {"produced": len(produced), "in_pool": len(pool), "pool_differs": len(differ)}
    if not pool:
        return Verdict(False, f"none of {producer}'s {len(produced)} blocks of {tag} is in the pool", evidence)
    if differ:
        return Verdict(False, f"{len(differ)} of {len(pool)} pooled blocks differ from what {producer} computed",
                       evidence)
    return Verdict(True, f"all {len(pool)} pooled blocks equal {producer}'s bytes", evidence,
                   not_checked="blocks that were not committed")


@dataclasses.dataclass(frozen=True)
class Exchange:
    name: str
    prompt_tokens: int
    fault: dict | None  # A's "gpu" fault section during its publishing request
    expect_caught: bool  # a negative control: the byte-exact check must fail


EXCHANGES = (
    Exchange("cross_replica_hit", 1200, None, False),
    Exchange("stream_delay", 1200, {"stream_delay_ms": STREAM_DELAY_MS, "times": 1}, False),
    Exchange("stream_delay_control", 1200, {"stream_delay_ms": STREAM_DELAY_MS, "times": 1, "control": "unordered",
                                            "drop": "store_after_write"}, True),
)


def _tokens(c: Completion) -> dict:
    return {"tokens": c.token_ids, "ttft_ms": round(c.ttft_s * 1e3, 1), "finish_reason": c.finish_reason,
            "error": c.error}


def run_exchange(cluster: GpuCluster, corpus: Corpus, ex: Exchange, rng: random.Random,
                 max_tokens: int = 16) -> dict:
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    h = cluster.history_dir
    prompt = corpus.text(ex.prompt_tokens, rng)  # + BOS
    n = ex.prompt_tokens + 1
    pub, hit, cold = f"{ex.name}-pub", f"{ex.name}-hit", f"{ex.name}-cold"
    t_arm = time.time()
    cluster.arm("A", ex.fault)
    try:
        a = complete(A, prompt, tag=pub, replica="A", max_tokens=max_tokens)
        pubs = wait_published(h, "A", pub, n // BLOCK_SIZE)
    finally:
        cluster.arm("A", None)
    t_heal = time.time()
    b = complete(B, prompt, tag=hit, replica="B", max_tokens=max_tokens)
    reset_prefix_cache(B)
    bc = complete(B, prompt, tag=cold, replica="B", max_tokens=max_tokens, load=False, publish=False)
    reset_prefix_cache(B)
    lookups = records(h, "lookup", replica="B", tag=hit)
    loads = records(h, "load", replica="B", tag=hit)
    faults = [r for r in records(h, "fault", replica="A") if pub in (r.get("tags") or [])]
    dropped = [r for r in records(h, "fault", replica="A", site="gpu_transfer") if t_arm <= r["t"] <= t_heal]
    exact = byte_exact(cluster, ("A", pub), ("B", hit), ("B", cold))
    pooled = published_exact(cluster, "A", pub)
    tokens_equal = b.token_ids == bc.token_ids and len(b.token_ids) == max_tokens
    hit_blocks = sum(int(r["loaded"]) for r in loads)
    want_blocks = (n - 1) // BLOCK_SIZE
    out = {
        "name": ex.name, "prompt_tokens": n, "block_size": BLOCK_SIZE, "fault": ex.fault,
        "expect_caught": ex.expect_caught,
        "A": _tokens(a), "B_hit": _tokens(b), "B_cold": _tokens(bc),
        "tokens_equal_B_hit_vs_cold": tokens_equal, "tokens_equal_A_vs_B_cold": a.token_ids == bc.token_ids,
        "lookup_B": [{k: r.get(k) for k in ("outcome", "hit_blocks", "external_tokens", "miss_cause")}
                     for r in lookups],
        "blocks_loaded_B": hit_blocks, "blocks_expected": want_blocks,
        "published_A": [{k: r.get(k) for k in ("blocks", "committed", "exists", "rejected", "error")} for r in pubs],
        "fault_records": faults, "edges_dropped": len(dropped),
        "byte_exact": dataclasses.asdict(exact), "pool_equals_producer": dataclasses.asdict(pooled),
    }
    if ex.expect_caught:
        caught = exact.valid is False or pooled.valid is False
        fired = bool(faults) and bool(dropped)
        out["verdict"] = dataclasses.asdict(Verdict(
            caught and fired,
            ("negative control caught: " if caught else "negative control NOT caught: ") + exact.reason
            + f"; pool vs producer: {pooled.reason}; delay fired {len(faults)}x, edge dropped {len(dropped)}x",
            {"caught": caught, "delay_fired": len(faults), "edges_dropped": len(dropped)},
            not_checked="whether B's tokens differ (a stale block need not change greedy tokens)"))
    else:
        fault_ok = ex.fault is None or (bool(faults) and a.ttft_s * 1e3 >= 0.9 * STREAM_DELAY_MS)
        ok = (exact.valid is True and pooled.valid is True and tokens_equal and hit_blocks == want_blocks
              and fault_ok)
        out["verdict"] = dataclasses.asdict(Verdict(
            ok, f"B loaded {hit_blocks}/{want_blocks} blocks; tokens B hit == B cold: {tokens_equal}; "
                f"{exact.reason}; {pooled.reason}"
                + (f"; delay fired {len(faults)}x, A's TTFT {a.ttft_s * 1e3:.0f} ms" if ex.fault else ""),
            {"exact": exact.valid, "pool": pooled.valid, "tokens_equal": tokens_equal},
            not_checked="tokens beyond the first max_tokens; blocks outside this prompt"))
    return out


def _env() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        from vllm.version import __version__ as v

        out["vllm"] = v
    except ImportError as exc:
        out["vllm"] = f"not importable: {exc}"
    return out


def tiny_cluster(report_dir: Path) -> tuple[GpuCluster, list[ReplicaSpec], Path]:
    from fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
    specs = [ReplicaSpec(name, core=str(i), kv_bytes=1 << 30, audit=True, policy="recompute",
                         max_model_len=4096, max_num_batched_tokens=2048,
                         faults_file=str(report_dir / f"faults-{name}.json"), extra_args=gpu_args(0.08))
             for i, name in enumerate(("A", "B"))]
    return GpuCluster(model, report_dir, page_size=64 * 1024, pool_pages=4096), specs, model


def run_live(cluster: GpuCluster, model: Path, seed: int) -> dict:
    corpus = Corpus(model)
    rng = random.Random(f"gpu-live:{seed}")
    for name in ("A", "B"):  # first requests compile kernels; not part of any exchange
        complete(cluster.replicas[name].url, corpus.text(40, rng), tag=f"warmup-{name}", replica=name,
                 load=False, publish=False)
    results = [run_exchange(cluster, corpus, ex, rng) for ex in EXCHANGES]
    reg = records(cluster.history_dir, "register")
    gpu = records(cluster.history_dir, "gpu_transfer")
    return {
        "seed": seed, "env": _env(), "exchanges": results,
        "register": [{k: r.get(k) for k in ("replica", "shape", "block_bytes")} for r in reg],
        "gpu_transfer": gpu[:2],
        "passed": all(r["verdict"]["valid"] is True for r in results),
    }


def render_markdown(result: dict, date: str) -> str:
    env = result["env"]
    lines = [f"# kvgate live on the GPU — {date}, {result.get('gpu_model', env.get('gpu', '?'))}", "",
             f"{env.get('gpu', '?')}; vLLM {env.get('vllm')} (GPU bundle), torch {env.get('torch')} "
             f"(CUDA {env.get('cuda')}); two replicas of the tiny model (2 layers, 2 KV heads, head 64, block "
             f"{BLOCK_SIZE}) on one GPU, one kvpool pool, TRITON_ATTN, eager; seed {result['seed']}.", ""]
    for ex in result["exchanges"]:
        v = ex["verdict"]
        mark = "x" if v["valid"] else " "
        label = "negative control caught" if ex["expect_caught"] and v["valid"] else (
            "pass" if v["valid"] else "FAIL")
        be = ex["byte_exact"]["evidence"]
        lines += [f"- [{mark}] **{ex['name']}** ({label}): {v['reason']}",
                  f"    - prompt {ex['prompt_tokens']} tokens; B loaded {ex['blocks_loaded_B']} of "
                  f"{ex['blocks_expected']} blocks; installed {be.get('installed')}, differ from A's "
                  f"{be.get('differs_from_producer')}, from the pool's {be.get('differs_from_pool')}; cold recompute "
                  f"compared {be.get('cold_compared', 'n/a (stopped at the first failure)')}, differ "
                  f"{be.get('cold_differs', 'n/a')}",
                  f"    - TTFT A {ex['A']['ttft_ms']} ms, B hit {ex['B_hit']['ttft_ms']} ms, B cold "
                  f"{ex['B_cold']['ttft_ms']} ms; tokens B hit == B cold: {ex['tokens_equal_B_hit_vs_cold']}, "
                  f"A == B cold: {ex['tokens_equal_A_vs_B_cold']}",
                  f"    - not checked: {v['not_checked']}"]
    lines += ["", f"Overall: {'PASS' if result['passed'] else 'FAIL'}", ""]
    bench = result.get("bench")
    if bench:
        lines += ["## `kvgate bench gpu` part 2 (live TTFT)", "", bench.get("model", ""), "",
                  "| prefix tokens | cold ms | local hit ms | kvgate remote hit ms | OffloadingConnector CPU hit ms |"
                  " remote / peer |", "|---|---|---|---|---|---|"]
        for r in bench["rows"]:
            lines.append(f"| {r['prefix_tokens']} | {r['cold_prefill_ms']} | {r['local_hit_ttft_ms']} | "
                         f"{r['remote_hit_ttft_ms']} | {r['peer_hit_ttft_ms']} | {r['remote_vs_peer']} |")
        met = bench["targets"]["remote_no_slower_than_peer_at_every_length"]
        lines += ["", f"- [{'x' if met else ' '}] target: kvgate's remote hit no slower than the peer's CPU-tier hit "
                      f"at every length ({'met' if met else 'NOT met'})", ""]
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    if result.get("command"):
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def _stop(cluster: Cluster) -> str:
    """Stop a cluster; an OrphanError is returned for the result (and fails the run)."""
    from harness.cluster import OrphanError

    try:
        cluster.stop()
    except OrphanError as exc:
        return str(exc)
    return ""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(report_dir: Path, seed: int = 20261129, bench: bool = False, bench_reps: int = 1,
         bench_lengths: tuple[int, ...] = (8192, 32768, 65536), deadline_s: float = 540.0) -> int:
    """Start the tiny pair (and, with `bench`, the bench trio at the same time), run the
    live exchanges, then the bench rows while time is left; write live.json (and
    bench.json) under report_dir as each part finishes."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()
    report_dir.mkdir(parents=True, exist_ok=True)
    cluster, specs, model = tiny_cluster(report_dir / "live")
    bench_f = None
    result: dict = {"passed": False}
    with ThreadPoolExecutor(2) as ex:
        live_f = ex.submit(cluster.start, specs, 300.0)
        if bench:
            from harness.bench_gpu_live import start_bench

            bench_f = ex.submit(start_bench, report_dir / "bench", max(bench_lengths))
        try:
            live_f.result()
            _say(f"kvgate gpu-live: tiny pair up after {time.monotonic() - t0:.0f} s")
            result = run_live(cluster, model, seed)
        except Exception as exc:  # recorded in the result and the exit code; the bench still runs
            result["error"] = "".join(traceback.format_exception(exc))[-4000:]
            _say(f"kvgate gpu-live: live part raised:\n{result['error']}")
        finally:
            result["stop_error"] = _stop(cluster)
        (report_dir / "live.json").write_text(json.dumps(result, indent=1, default=str))
        _say(f"kvgate gpu-live: live part {'PASS' if result['passed'] else 'FAIL'} after "
             f"{time.monotonic() - t0:.0f} s")
        if bench_f is not None:
            from harness.bench_gpu_live import measure

            try:
                bench_cluster = bench_f.result()
            except Exception as exc:
                result["bench_error"] = "".join(traceback.format_exception(exc))[-4000:]
                bench_cluster = None
            if bench_cluster is not None:
                try:
                    left = deadline_s - (time.monotonic() - t0)
                    result["bench"] = measure(bench_cluster, bench_lengths, bench_reps, deadline_s=left)
                except Exception as exc:
                    result["bench_error"] = "".join(traceback.format_exception(exc))[-4000:]
                finally:
                    result["bench_stop_error"] = _stop(bench_cluster)
            if "bench_error" in result:
                _say(f"kvgate gpu-live: bench raised:\n{result['bench_error']}")
    print(json.dumps(result, default=str))
    return 0 if result["passed"] and not result.get("stop_error") else 1
