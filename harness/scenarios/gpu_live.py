"""The parts of `kvgate gpu-live` (kvgate.harness.gpu_live): kvgate live on GPUs with vLLM 0.24 (the GPU bundle).

Placement (`--gpus N`): with N <= 1, two replicas (A, B) of the tiny model share one GPU;
with N >= 2, one replica per GPU (A on GPU 0, B on GPU 1, C on GPU 2, ...; each started
with CUDA_VISIBLE_DEVICES set to its GPU). Either way every replica is registered on the
same kvpool pool (one tenant, one segment on the host), through kvpool's connector, under
the audit wrapper (kvpool.connector.audit) around the fault-injecting connector (kvgate.faults.connector,
whose stream-delay site and unordered-transfer control act on CUDA), with a fault-control
file each.

Directions: every replica publishes once to the next one (A -> B, B -> A with two
replicas; A -> B -> C -> A with three). Six exchanges per direction, each on a fresh
seeded prompt of several blocks; in each, the producer computes and publishes, the
consumer loads, then the consumer recomputes the same prompt cold (its prefix cache
reset, pool bypassed):

  cross_replica_hit   no fault: the consumer's tokens equal its cold run's, and the
                      byte-exact oracle (kvgate.harness.checkers.byte_exact.exchange_exact) holds: every block
                      it installed equals the producer's bytes and the pool's committed
                      copy, and its own cold recompute gives the same bytes.
  stream_delay        the producer's step that publishes runs behind a torch.cuda._sleep
                      enqueued on the engine's stream before the forward writes the KV; the
                      ordered engine must still publish exact bytes (same checks).
  stream_delay_control
                      the same delay with the negative control armed (the transfer engine
                      drops the store's dependency on the engine's stream,
                      kvgate.faults.gpu_live.SwitchableTransferEngine): the byte-exact check must
                      catch it (a FAIL verdict there is the expected outcome).
  load_delay          the consumer's side: the writes of its load into its KV cache run
                      behind a torch.cuda._sleep (kvgate.faults.gpu_live, `load_delay_ms`);
                      its forward must still read them only once written (same checks, and
                      its TTFT holds the delay).
  load_delay_staged   the same on the staged install (the control's way, with its edges).
  load_delay_control  the same delay with the edges that order the consumer's reads after
                      the load dropped (read_after_load for synchronous loads; with it
                      release_after_copy, the host's wait, for asynchronous ones: either
                      alone orders them), its load on the staged install (with the direct
                      install the writes are over when load() returns: the host read the
                      sketches the same kernel took of them, kvgate.faults.gpu_live; a
                      run of this control on it read nothing early). The installed bytes
                      end up exact, so the oracle this control validates is the output
                      one: the consumer's tokens on its hit must differ from its own
                      prefix hit of the prompt, on a hit that ran to the end and loaded
                      every block, with its blocks and its cold run's exact afterwards (the
                      prefix hit reads the cold run's), the baselines taken once the
                      consumer's engine recorded the delayed writes over.

The tier's exchanges (`--tier-exchanges`): the same six exchanges on two more tiny replicas
whose pool is a GPU keeper's tier in device memory (tiny_tier_cluster: `kvpool keeper --backing
vmm` on GPU 0, each replica's pool `keeper:RUN_DIR`); the oracle's "pool" is the tier, each
committed page copied out under a lease of the oracle's own session (TierOracle). The edges the
controls drop are the same: the producer's copy into the tier must follow the forward's KV
write, and the committed page is checked against the producer's bytes; the consumer's reads
must follow its copy out of the tier, in another process than the producer's.

Sessions (`--sessions`): the OFF-ON-ON-OFF comparison of the seed (003_...) on a second
set of replicas of the bench model (kvgate.fixtures.gpu_model, 64 KiB of KV per token), placed
like the tiny ones: six-turn sessions whose turns alternate replicas, run four times
(pool off, on, on, off; each block under its own cache_salt); TTFT per turn, the median
of the cross-replica turns per block, and the generated tokens compared across blocks.

  GpuCluster            kvgate.harness.system.gpu: the cluster with vLLM 0.24 GPU flags.
  placement(gpus)       -> [(replica, CUDA_VISIBLE_DEVICES or None)]
  directions(names)     -> [(producer, consumer)]
  run_live(cluster, model, seed, pool=None)  -> dict    the exchanges and their verdicts (`pool`:
                        what the oracle reads as the shared store; default the cluster's daemon).
  tiny_tier_cluster(report_dir, gpus, extra=None) / start_tier_cluster(report_dir, gpus, extra=None)
                        the tiny replicas on a keeper's tier, and its oracle (TierOracle).
  environment() -> dict  the GPUs, vLLM, torch and CUDA versions and the tree's provenance.
  run_session_blocks(cluster, corpus, seed, ...) -> dict   OFF-ON-ON-OFF at one context.
  failures(result, ...)  -> [str]    every failure the run measured, of the parts it was asked for:
                        an exchange whose verdict failed, a part that raised, a cluster that
                        left processes behind, a session turn whose tokens differ between the
                        four blocks, a session turn that errored or whose publish never
                        landed, an audited session block installed with bytes other than its
                        producer's, a bench that raised, a bench remote hit that loaded fewer
                        blocks than its prompt has, and a part asked for that did not run (a
                        context length or a bench length or repetition skipped for lack of
                        time): not run is never a pass. The bench's speed targets are
                        reported, not judged.
  wait_published(history_dir, replica, tag, blocks)   a replica's publish records of a
                        request covering `blocks` blocks (the bench waits on it too).
  publish_outcome(records)   what those records say landed: blocks committed or already in
                        the pool, and the ones that did not land (no capacity, not admitted,
                        rejected, a store that failed) with the errors; a record covers the
                        blocks it offered, landed or not, so covering is not landing.
The command that runs these parts with the bench (kvgate.harness.bench.gpu_live) and writes the
checklist is kvgate.harness.gpu_live; this module imports nothing of the bench.
Each verdict says what it does not check. The delay is seeded only in its length; a seed
cannot force a thread interleaving.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

from kvgate.harness.checkers.byte_exact import exchange_exact, pool_digests
from kvgate.harness.checkers.history import audit_digests, namespace_of, records
from kvgate.harness.checkers.verdict import Verdict
from kvgate.harness.client import http
from kvgate.harness.client.http import Completion, complete, reset_prefix_cache
from kvgate.harness.system.cluster import Cluster, ReplicaSpec
from kvgate.harness.system.gpu import BLOCK_SIZE, GpuCluster, gpu_args
from kvgate.harness.workload.prompts import Corpus
from kvpool.pool.arena import memory_available

STREAM_DELAY_MS = 300.0


class GpuLiveError(RuntimeError):
    """A live GPU step could not run (a publish never landed, a reset was refused)."""


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


PUBLISH_SHORT = ("no_capacity", "not_admitted", "rejected")


def publish_outcome(recs: list[dict]) -> dict:
    """Sum of a request's publish records: `offered` blocks, `landed` (committed or already
    in the pool), `pending` (another producer's publish of the block was in flight), the
    blocks refused by cause, and every store's error."""
    out = {"offered": 0, "landed": 0, "pending": 0, **{k: 0 for k in PUBLISH_SHORT}, "errors": []}
    for r in recs:
        out["offered"] += int(r.get("blocks", 0))
        out["landed"] += int(r.get("committed", 0)) + int(r.get("exists", 0))
        out["pending"] += int(r.get("pending", 0))
        for k in PUBLISH_SHORT:
            out[k] += int(r.get(k, 0))
        if r.get("error"):
            out["errors"].append(f"blocks {r.get('first_block')}+{r.get('blocks')}: {r['error']}"[:300])
    return out


def published_exact(cluster: Cluster, producer: str, tag: str, pool=None) -> Verdict:  # noqa: ANN001
    """Every block the producer computed for `tag` equals the pool's committed copy (`pool`: as
    exchange_exact's)."""
    produced = audit_digests(cluster.history_dir, "produced", tag, producer)
    pool = pool_digests(cluster.pool if pool is None else pool, namespace_of(cluster.history_dir, producer),
                        list(produced))
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
    fault: dict | None  # the "gpu" fault section of the replica on `side` during its request
    expect_caught: bool  # a negative control: its oracle must catch it
    side: str = "producer"  # whose request the fault is armed for: the producer's publish, the consumer's hit


CONSUMER_EDGES = "the consumer's reads"  # `drop` of a consumer-side control: the edges by load mode (reads_edges)

EXCHANGES = (
    Exchange("cross_replica_hit", 1200, None, False),
    Exchange("stream_delay", 1200, {"stream_delay_ms": STREAM_DELAY_MS, "times": 1}, False),
    Exchange("stream_delay_control", 1200, {"stream_delay_ms": STREAM_DELAY_MS, "times": 1, "control": "unordered",
                                            "drop": "store_after_write"}, True),
    Exchange("load_delay", 1200, {"load_delay_ms": STREAM_DELAY_MS, "times": 1}, False, "consumer"),
    Exchange("load_delay_staged", 1200, {"load_delay_ms": STREAM_DELAY_MS, "times": 1, "install": "staged"}, False,
             "consumer"),
    Exchange("load_delay_control", 1200, {"load_delay_ms": STREAM_DELAY_MS, "times": 1, "control": "unordered",
                                          "drop": CONSUMER_EDGES, "install": "staged"}, True, "consumer"),
)


def wait_delayed_writes(history_dir: Path, replica: str, since: float, timeout_s: float = 60.0) -> None:
    """Until the replica's engine recorded that a load delayed since `since` has every write
    over on the GPU (kvgate.faults.gpu_live: `load_delay_done`); GpuLiveError past `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not [r for r in records(history_dir, "load_delay_done", replica=replica) if r["t"] >= since]:
        if time.monotonic() > end:
            raise GpuLiveError(f"{replica}'s delayed load never finished its writes within {timeout_s:.0f} s")
        time.sleep(0.05)


def reads_edges(load_mode: str | None) -> list[str]:
    """The edges that keep an engine's reads of loaded blocks behind the load's writes:
    synchronous loads, the stream wait before the forward (read_after_load); asynchronous
    ones, that wait (made when the load is reported finished) and the host's wait for the
    copies before it is reported finished (release_after_copy). Either of those two alone
    orders the reads, so the control drops both."""
    if load_mode == "async":
        return ["read_after_load", "release_after_copy"]
    return ["read_after_load"]


def load_mode(history_dir: Path, replica: str) -> str | None:
    """"sync" or "async": the replica's connector's load mode, from its namespace record."""
    modes = [r.get("load_mode") for r in records(history_dir, "namespace", replica=replica) if r.get("load_mode")]
    return modes[-1] if modes else None


def _tokens(c: Completion) -> dict:
    return {"tokens": c.token_ids, "ttft_ms": round(c.ttft_s * 1e3, 1), "finish_reason": c.finish_reason,
            "error": c.error}


def placement(gpus: int) -> list[tuple[str, str | None]]:
    """Replica names and their CUDA_VISIBLE_DEVICES: two replicas on the one visible GPU
    (None: inherited) for gpus <= 1, else one replica per GPU."""
    if gpus > 26:
        raise ValueError(f"at most 26 replicas (A..Z), asked for {gpus} GPUs")
    if gpus <= 1:
        return [("A", None), ("B", None)]
    return [(chr(ord("A") + i), str(i)) for i in range(gpus)]


def directions(names: list[str]) -> list[tuple[str, str]]:
    """(producer, consumer) pairs: every replica publishes to the next one, the last to the
    first (A -> B and B -> A for two replicas)."""
    if len(names) < 2:
        raise ValueError(f"a cross-replica hit needs two replicas, got {names}")
    return [(names[i], names[(i + 1) % len(names)]) for i in range(len(names))]


def _gpu_env(device: str | None) -> tuple[tuple[str, str], ...]:
    return () if device is None else (("CUDA_VISIBLE_DEVICES", device),)


def run_exchange(cluster: GpuCluster, corpus: Corpus, ex: Exchange, rng: random.Random,
                 max_tokens: int = 16, producer: str = "A", consumer: str = "B", pool=None) -> dict:  # noqa: ANN001
    P, C = cluster.replicas[producer].url, cluster.replicas[consumer].url
    h = cluster.history_dir
    prompt = corpus.text(ex.prompt_tokens, rng)  # + BOS
    n = ex.prompt_tokens + 1
    label = ex.name if (producer, consumer) == ("A", "B") else f"{ex.name}-{producer}{consumer}"
    pub, hit, cold = f"{label}-pub", f"{label}-hit", f"{label}-cold"
    faulted = producer if ex.side == "producer" else consumer
    mode = load_mode(h, consumer) if ex.side == "consumer" else None  # read once, where a control needs it
    fault = ex.fault
    if fault and fault.get("drop") == CONSUMER_EDGES:
        fault = {**fault, "drop": reads_edges(mode)}
    if ex.side == "producer":
        t_arm = time.time()
        cluster.arm(producer, fault)
        try:
            a = complete(P, prompt, tag=pub, replica=producer, max_tokens=max_tokens)
            pubs = wait_published(h, producer, pub, n // BLOCK_SIZE)
        finally:
            cluster.arm(producer, None)
        t_heal = time.time()
        b = complete(C, prompt, tag=hit, replica=consumer, max_tokens=max_tokens)
    else:
        a = complete(P, prompt, tag=pub, replica=producer, max_tokens=max_tokens)
        pubs = wait_published(h, producer, pub, n // BLOCK_SIZE)
        t_arm = time.time()
        cluster.arm(consumer, fault)
        try:
            b = complete(C, prompt, tag=hit, replica=consumer, max_tokens=max_tokens)
            # a control lets the hit finish before its load's delayed writes: those are over on the
            # GPU (the consumer's engine says so) before the baselines below take blocks the hit freed
            wait_delayed_writes(h, consumer, t_arm)
        finally:
            cluster.arm(consumer, None)
        t_heal = time.time()
    reset_prefix_cache(C)
    bc = complete(C, prompt, tag=cold, replica=consumer, max_tokens=max_tokens, load=False, publish=False)
    # the same prompt once more on the consumer, now a hit in its own prefix cache (the cold run's blocks): the
    # engine's prefix-hit path without kvpool, to tell a transfer error from the engine's own numerics
    bl = complete(C, prompt, tag=f"{label}-local", replica=consumer, max_tokens=max_tokens, load=False,
                  publish=False)
    reset_prefix_cache(C)
    lookups = records(h, "lookup", replica=consumer, tag=hit)
    loads = records(h, "load", replica=consumer, tag=hit)
    if ex.side == "producer":
        faults = [r for r in records(h, "fault", replica=producer) if pub in (r.get("tags") or [])]
    else:  # a load carries no tag into the engine: the delays of the consumer's armed window
        faults = [r for r in records(h, "fault", replica=consumer, site="gpu_stream") if t_arm <= r["t"] <= t_heal]
    dropped = [r for r in records(h, "fault", replica=faulted, site="gpu_transfer") if t_arm <= r["t"] <= t_heal]
    exact = exchange_exact(cluster, (producer, pub), (consumer, hit), (consumer, cold), pool=pool)
    pooled = published_exact(cluster, producer, pub, pool=pool)
    # The fallback oracle's baseline is a run with the same prefill partition: the consumer's
    # own prefix hit on the same prompt (all blocks reused, the tail computed), as on CPU
    # (README, "Faults, scenarios and the gate"). Equality with the cold run is reported.
    tokens_equal = b.token_ids == bl.token_ids and len(b.token_ids) == max_tokens
    hit_blocks = sum(int(r["loaded"]) for r in loads)
    want_blocks = (n - 1) // BLOCK_SIZE
    # "A", "B_hit", "B_cold" name the roles (producer, consumer), whichever replicas play them
    out = {
        "name": ex.name, "producer": producer, "consumer": consumer, "tag": label, "prompt_tokens": n,
        "block_size": BLOCK_SIZE, "fault": fault, "side": ex.side, "expect_caught": ex.expect_caught,
        "A": _tokens(a), "B_hit": _tokens(b), "B_cold": _tokens(bc), "B_local_hit": _tokens(bl),
        "tokens_equal_B_hit_vs_cold": b.token_ids == bc.token_ids, "tokens_equal_A_vs_B_cold": a.token_ids == bc.token_ids,
        "tokens_equal_B_hit_vs_local_hit": b.token_ids == bl.token_ids,
        "tokens_equal_B_local_hit_vs_cold": bl.token_ids == bc.token_ids,
        "lookup_B": [{k: r.get(k) for k in ("outcome", "hit_blocks", "external_tokens", "miss_cause")}
                     for r in lookups],
        "blocks_loaded_B": hit_blocks, "blocks_expected": want_blocks,
        "published_A": [{k: r.get(k) for k in ("blocks", "committed", "exists", "rejected", "error")} for r in pubs],
        "fault_records": faults, "edges_dropped": len(dropped),
        "byte_exact": dataclasses.asdict(exact), "pool_equals_producer": dataclasses.asdict(pooled),
    }
    if ex.expect_caught and ex.side == "consumer":
        # the reads ran before the delayed installs: the blocks end up exact (the byte-exact
        # oracle is not the one this control validates), what the forward read was not. A crash
        # proves nothing, nor a baseline the early reads' aftermath could have touched: the hit
        # ran to the end with every block, and its blocks and the cold run's are exact afterwards
        ran = (b.error is None and len(b.token_ids) == max_tokens and hit_blocks == want_blocks
               and exact.valid is True)  # exact: also the cold run's blocks, which the prefix hit reads
        caught = ran and b.token_ids != bl.token_ids
        fired = bool(faults) and bool(dropped)
        out["verdict"] = dataclasses.asdict(Verdict(
            caught and fired,
            ("negative control caught by the output oracle: " if caught else
             "negative control NOT caught by the output oracle: ")
            + f"{consumer}'s tokens on its hit {'differ from' if caught else 'equal'} its own prefix hit of the same "
              f"prompt; dropped {fault.get('drop')} ({mode} loads, "
              f"{'direct' if any(r.get('direct') for r in faults) else 'staged'} install); delay fired {len(faults)}x, "
              f"edge dropped {len(dropped)}x; installed bytes afterwards: {exact.reason}",
            {"caught": caught, "hit_ran": ran, "delay_fired": len(faults), "edges_dropped": len(dropped),
             "exact_after": exact.valid},
            not_checked="the KV the forward read, byte by byte (only what it computed from it)"))
    elif ex.expect_caught:
        caught = exact.valid is False or pooled.valid is False
        fired = bool(faults) and bool(dropped)
        out["verdict"] = dataclasses.asdict(Verdict(
            caught and fired,
            ("negative control caught: " if caught else "negative control NOT caught: ") + exact.reason
            + f"; pool vs producer: {pooled.reason}; delay fired {len(faults)}x, edge dropped {len(dropped)}x",
            {"caught": caught, "delay_fired": len(faults), "edges_dropped": len(dropped)},
            not_checked=f"whether {consumer}'s tokens differ (a stale block need not change greedy tokens)"))
    else:
        delayed = a if ex.side == "producer" else b
        fault_ok = ex.fault is None or (bool(faults) and delayed.ttft_s * 1e3 >= 0.9 * STREAM_DELAY_MS)
        ok = (exact.valid is True and pooled.valid is True and tokens_equal and hit_blocks == want_blocks
              and fault_ok)
        out["verdict"] = dataclasses.asdict(Verdict(
            ok, f"{consumer} loaded {hit_blocks}/{want_blocks} blocks {producer} published; tokens {consumer} hit == "
                f"its own prefix hit of the same prompt (same partition): {tokens_equal} (== {consumer} cold: "
                f"{b.token_ids == bc.token_ids}; prefix hit == cold: {bl.token_ids == bc.token_ids}); {exact.reason}; "
                f"{pooled.reason}"
                + (f"; delay fired {len(faults)}x, {faulted}'s TTFT {delayed.ttft_s * 1e3:.0f} ms" if ex.fault else ""),
            {"exact": exact.valid, "pool": pooled.valid, "tokens_equal": tokens_equal},
            not_checked="tokens beyond the first max_tokens; blocks outside this prompt"))
    return out


def environment() -> dict:
    import torch

    from kvgate.harness.provenance import provenance

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "provenance": provenance()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        from vllm.version import __version__ as v

        out["vllm"] = v
    except ImportError as exc:
        out["vllm"] = f"not importable: {exc}"
    return out


def tiny_cluster(report_dir: Path, gpus: int = 1) -> tuple[GpuCluster, list[ReplicaSpec], Path]:
    from kvgate.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
    specs = [ReplicaSpec(name, core=str(i), kv_bytes=1 << 30, audit=True, policy="recompute",
                         max_model_len=4096, max_num_batched_tokens=2048,
                         faults_file=str(report_dir / f"faults-{name}.json"), extra_env=_gpu_env(device),
                         extra_args=gpu_args(0.08))
             for i, (name, device) in enumerate(placement(gpus))]
    return GpuCluster(model, report_dir, page_size=64 * 1024, pool_pages=4096), specs, model


TIER_TOKEN = "tier-live"  # the tier exchanges' tenant token at their keeper


def tiny_tier_cluster(report_dir: Path, gpus: int = 1, extra: dict | None = None):  # noqa: ANN201
    """The tiny replicas on a GPU keeper's tier instead of the host pool: a keeper with its pages
    in device memory (`kvpool keeper --backing vmm`, on GPU 0, a companion of the cluster) and
    each replica's pool `keeper:RUN_DIR` (its GPU engine copies device to device, or GPU to GPU
    where the replica is on another one), with the connector settings in `extra` besides (for
    example {"gpu_install_direct": false}). The oracle reads the tier through a session of its
    own. Returns (GpuCluster, specs, model, TierOracle)."""
    import torch

    from kvgate.harness.scenarios.gpu_tier_engine import TierOracle
    from kvgate.harness.system.keeper import KeeperProcess

    cluster, specs, model = tiny_cluster(report_dir, gpus)
    run_dir = report_dir / "keeper-run"
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    cluster.companions.append(KeeperProcess(
        run_dir, "--gpu", "0", "--page-size", str(cluster.page_size), "--pages", str(cluster.pool_pages),
        "--tenant", f"default={TIER_TOKEN}", "--maintenance-s", "0.5", backing="vmm"))
    tier = (("pool", f"keeper:{run_dir}"), ("token", TIER_TOKEN), *sorted((extra or {}).items()))
    specs = [dataclasses.replace(s, connector_extra=(*s.connector_extra, *tier)) for s in specs]
    return cluster, specs, model, TierOracle(run_dir, "default", TIER_TOKEN, torch.device("cuda", 0))


def start_tier_cluster(report_dir: Path, gpus: int = 1, extra: dict | None = None) -> GpuCluster:
    """tiny_tier_cluster, started; its oracle as `.tier_oracle` (run_live's `pool`)."""
    cluster, specs, _, oracle = tiny_tier_cluster(report_dir, gpus, extra)
    try:
        cluster.start(specs, 400.0)
    except BaseException:
        for companion in cluster.companions:
            companion.stop()
        raise
    cluster.tier_oracle = oracle
    return cluster


def run_live(cluster: GpuCluster, model: Path, seed: int, pool=None) -> dict:  # noqa: ANN001
    """The exchanges in every direction; `pool`: the store the oracle reads (run_exchange's)."""

    http.RECORDER = cluster.history
    corpus = Corpus(model)
    rng = random.Random(f"gpu-live:{seed}")
    names = list(cluster.replicas)
    for name in names:  # first requests compile kernels; not part of any exchange
        complete(cluster.replicas[name].url, corpus.text(40, rng), tag=f"warmup-{name}", replica=name,
                 load=False, publish=False)
    pairs = directions(names)
    results = [run_exchange(cluster, corpus, ex, rng, producer=p, consumer=c, pool=pool)
               for ex in EXCHANGES for p, c in pairs]
    reg = records(cluster.history_dir, "register")
    gpu = records(cluster.history_dir, "gpu_transfer")
    return {
        "seed": seed, "env": environment(), "exchanges": results, "directions": [f"{p}->{c}" for p, c in pairs],
        "placement": {r.spec.name: dict(r.spec.extra_env).get("CUDA_VISIBLE_DEVICES", "inherited")
                      for r in cluster.replicas.values()},
        "register": [{k: r.get(k) for k in ("replica", "shape", "block_bytes")} for r in reg],
        "gpu_transfer": [{k: r.get(k) for k in ("replica", "host_memory", "path")} for r in gpu],
        "passed": all(r["verdict"]["valid"] is True for r in results),
    }


# -- sessions: OFF-ON-ON-OFF on the bench model ----------------------------------------------

SESSION_CHUNK = 8192
SESSION_KV_BYTES = 10 << 30  # a 64k-token session (4.2 GiB of KV) stays in a replica's own prefix cache
SESSION_POOL_BYTES = 16 << 30
SESSION_USER_TOKENS = 64
SESSION_MAX_TOKENS = 16


def start_sessions(report_dir: Path, gpus: int, max_context: int, turns: int = 6, audit: bool = False) -> Cluster:
    """Replicas of the bench model (kvgate.fixtures.gpu_model), placed as the tiny ones, on a pool
    of their own; kvpool's connector without audit (the byte-exact oracle runs on the tiny
    pair)."""
    from kvgate.fixtures.gpu_model import BENCH_SHAPE, build_llama

    t0 = time.monotonic()
    model = build_llama(report_dir / "model", BENCH_SHAPE, seed=0)
    page = BENCH_SHAPE.kv_bytes_per_token * BLOCK_SIZE
    n_len = max_context + turns * (SESSION_USER_TOKENS + SESSION_MAX_TOKENS) + 1024
    specs = [ReplicaSpec(name, core=str(i), kv_bytes=SESSION_KV_BYTES, max_model_len=n_len, audit=audit,
                         max_num_batched_tokens=SESSION_CHUNK, extra_env=_gpu_env(device), extra_args=gpu_args(0.12))
             for i, (name, device) in enumerate(placement(gpus))]
    free = memory_available()
    pool_bytes = min(SESSION_POOL_BYTES, free - (16 << 30))  # room for the tiny pool, the replicas and others
    if pool_bytes < 2 * max_context * BENCH_SHAPE.kv_bytes_per_token:
        raise GpuLiveError(f"{free / 2**30:.1f} GiB of memory available: too little for a pool "
                           f"of two {max_context}-token sessions")
    cluster = Cluster(model, report_dir, page_size=page, pool_pages=pool_bytes // page)
    cluster.start(specs, timeout=400.0)
    _say(f"kvgate gpu-live: session replicas {list(cluster.replicas)} up after {time.monotonic() - t0:.0f} s")
    return cluster


def _settle(history_dir: Path, replica: str, tag: str, prompt_tokens: int, timeout_s: float,
            block_size: int = BLOCK_SIZE) -> dict:
    """Wait until the turn's publish records cover its prompt's full blocks after the ones it
    loaded (the next turn, on another replica, should find them). Recorded, not raised: a
    publish that did not land shows as fewer remote-hit blocks in the next turn."""
    t0 = time.monotonic()
    want = got = 0
    while time.monotonic() - t0 < timeout_s:
        looks = records(history_dir, "lookup", replica=replica, tag=tag)
        start = 0
        if looks and int(looks[0].get("hit_blocks") or 0) > 0:
            start = int(looks[0].get("first_block") or 0) + int(looks[0]["hit_blocks"])
        want = prompt_tokens // block_size - start
        got = sum(int(r["blocks"]) for r in records(history_dir, "publish", replica=replica, tag=tag))
        if got >= want:
            return {"published": got, "settle_s": round(time.monotonic() - t0, 3)}
        time.sleep(0.05)
    return {"published": got, "expected": want, "settle_s": round(time.monotonic() - t0, 3), "timed_out": True}


def run_session_blocks(cluster: Cluster, corpus: Corpus, seed: int, *, context_tokens: int, sessions: int = 2,
                       turns: int = 6, settle_s: float = 30.0, audit: bool = False, router: str = "alternating",
                       label: str = "", block_size: int = BLOCK_SIZE) -> dict:
    """OFF-ON-ON-OFF: the same `sessions` six-turn sessions (kvgate.harness.workload.prompts.six_turn_session,
    turns placed by kvgate.harness.workload.router.Router `router`: "alternating" replicas, or "sticky",
    the fixed-placement control) four times, each block under its own cache_salt; with the pool
    off requests neither load nor publish. `label` prefixes the tags and salts (default
    "ooo<context>"), so parts at the same context stay apart; `block_size`: the replicas'
    (tokens per block)."""
    from kvgate.harness.workload.prompts import six_turn_session
    from kvgate.harness.workload.router import Router

    http.RECORDER = cluster.history
    names = list(cluster.replicas)
    label = label or f"ooo{context_tokens}"
    turns_out: list[dict] = []
    t_start = time.monotonic()
    for i, on in enumerate((False, True, True, False)):
        block = f"{i}:{'on' if on else 'off'}"
        placer = Router(router, names, seed)
        salt = f"{label}-{seed}-{i}"
        for s in range(sessions):
            rng = random.Random(f"{seed}:session:{context_tokens}:{s}")
            context, users = six_turn_session(corpus, rng, context_tokens, SESSION_USER_TOKENS, turns)
            conversation = context
            prev = None
            for t, user in enumerate(users):
                conversation += " " + user
                name = placer.pick(f"s{s}", t)
                tag = f"{label}-{i}-s{s}-t{t}"
                c = complete(cluster.replicas[name].url, conversation, tag=tag, replica=name,
                             max_tokens=SESSION_MAX_TOKENS, load=on, publish=on, cache_salt=salt)
                n = c.prompt_tokens or len(conversation.split()) + 1
                look = records(cluster.history_dir, "lookup", replica=name, tag=tag)
                row = {"block": block, "session": s, "turn": t, "replica": name, "cross": prev is not None and
                       prev != name, "prompt_tokens": n, "ttft_ms": round(c.ttft_s * 1e3, 1),
                       "remote_hit_blocks": int(look[0].get("hit_blocks") or 0) if look else 0,
                       "local_tokens": int(look[0].get("local_tokens") or 0) if look else 0,
                       "tokens": c.token_ids, "finish_reason": c.finish_reason, "error": c.error}
                if on:
                    row.update(_settle(cluster.history_dir, name, tag, n, settle_s, block_size))
                turns_out.append(row)
                conversation += " " + c.text.strip()
                prev = name
        _say(f"  sessions {context_tokens}: block {block} done after {time.monotonic() - t_start:.0f} s")
    out = summarize_sessions(turns_out, context_tokens, sessions, turns, names, router)
    if audit:
        out["audit"] = session_audit(cluster.history_dir, label, turns_out)
    return out


def session_audit(history_dir: Path, label: str, turns_out: list[dict]) -> dict:
    """With audited session replicas: every block a turn loaded against the bytes its
    producer computed and against what the engine's stream read at the first layer
    ("seen"); and the KV bytes of the same (session, turn, block position) compared between
    the two OFF blocks and between the two ON blocks, with the earliest difference next to
    the earliest token difference (a later turn's prompt holds the earlier answers, so
    its bytes differ legitimately after a token difference)."""
    recs = [r for r in records(history_dir, "audit") if str(r.get("tag", "")).startswith(label + "-")]
    by_key: dict[tuple[int, str], dict[str, str]] = {}  # (block, kind) -> key -> digest
    by_pos: dict[tuple[int, str], dict[tuple[int, int, int], str]] = {}  # (block, kind) -> (s, t, pos) -> digest
    for r in recs:
        _, i, s, t = r["tag"].rsplit("-", 3)
        i, s, t = int(i), int(s[1:]), int(t[1:])
        for j, (k, d) in enumerate(zip(r["keys"], r["digests"])):
            by_key.setdefault((i, r["kind"]), {})[k] = d
            by_pos.setdefault((i, r["kind"]), {})[(s, t, int(r["first_block"]) + j)] = d
    out: dict = {"records": len(recs)}
    for i in (1, 2):
        inst = by_key.get((i, "installed"), {})
        prod = by_key.get((i, "produced"), {})
        seen = by_key.get((i, "seen"), {})
        out[f"block{i}_installed"] = len(inst)
        out[f"block{i}_installed_not_produced_here"] = sum(1 for k in inst if k not in prod)
        out[f"block{i}_installed_differs_from_producer"] = sum(1 for k, d in inst.items() if k in prod and prod[k] != d)
        out[f"block{i}_seen_differs_from_installed"] = sum(1 for k, d in seen.items() if inst.get(k) != d)
    first_token_diff = {}
    for a, b in ((0, 3), (1, 2)):
        ta = {(r["session"], r["turn"]): r["tokens"] for r in turns_out if r["block"].startswith(f"{a}:")}
        tb = {(r["session"], r["turn"]): r["tokens"] for r in turns_out if r["block"].startswith(f"{b}:")}
        diff_turns = sorted(k for k in ta if ta[k] != tb.get(k))
        first_token_diff[f"{a}v{b}"] = [f"s{s}-t{t}" for s, t in diff_turns]
        for kind in ("produced", "installed"):
            pa, pb = by_pos.get((a, kind), {}), by_pos.get((b, kind), {})
            common = sorted(set(pa) & set(pb))
            differ = [k for k in common if pa[k] != pb[k]]
            earliest: dict[int, str] = {}
            for s_, t_, pos in differ:
                earliest.setdefault(s_, f"s{s_}-t{t_} block {pos}")
            out[f"{kind}_{a}v{b}"] = {"compared": len(common), "differ": len(differ),
                                      "earliest_by_session": earliest}
    out["token_differences"] = first_token_diff
    return out


def summarize_sessions(turns_out: list[dict], context_tokens: int, sessions: int, turns: int,
                       names: list[str], router: str = "alternating") -> dict:
    blocks = ["0:off", "1:on", "2:on", "3:off"]
    by_key: dict[tuple[int, int], list[list[int]]] = {}
    for r in turns_out:
        by_key.setdefault((r["session"], r["turn"]), []).append(r["tokens"])
    mismatched = sorted(f"s{s}-t{t}" for (s, t), outs in by_key.items() if any(o != outs[0] for o in outs))
    per_block: dict[str, dict] = {}
    for b in blocks:
        rows = [r for r in turns_out if r["block"] == b]
        cross = [r["ttft_ms"] for r in rows if r["cross"]]
        session_sums = [sum(r["ttft_ms"] for r in rows if r["session"] == s) for s in range(sessions)]
        per_turn = {str(t): round(statistics.median(r["ttft_ms"] for r in rows if r["turn"] == t), 1)
                    for t in range(turns)}
        per_block[b] = {
            "ttft_median_ms_cross_turns": round(statistics.median(cross), 1) if cross else None,
            "ttft_median_ms_all_turns": round(statistics.median(r["ttft_ms"] for r in rows), 1) if rows else None,
            "session_ttft_sum_ms_mean": round(statistics.mean(session_sums), 1) if rows else None,
            "ttft_median_ms_by_turn": per_turn,
            "remote_hit_blocks": sum(r["remote_hit_blocks"] for r in rows),
            "settle_timeouts": sum(1 for r in rows if r.get("timed_out")),
            "errors": [r["error"] for r in rows if r["error"]],
        }

    def improvement(key: str) -> float | None:
        off = [per_block[b][key] for b in ("0:off", "3:off")]
        on = [per_block[b][key] for b in ("1:on", "2:on")]
        if None in off or None in on:
            return None
        return round(1 - statistics.mean(on) / statistics.mean(off), 3)

    return {
        "context_tokens": context_tokens, "sessions": sessions, "turns": turns, "router": router,
        "replicas": names, "user_tokens": SESSION_USER_TOKENS, "max_tokens": SESSION_MAX_TOKENS,
        "blocks": per_block,
        "ttft_median_ms_cross_turns": {b: per_block[b]["ttft_median_ms_cross_turns"] for b in blocks},
        "improvement_cross_turn_median": improvement("ttft_median_ms_cross_turns"),
        "improvement_session_ttft_sum": improvement("session_ttft_sum_ms_mean"),
        "mismatched_turns": mismatched, "tokens_equal_all_blocks": not mismatched,
        "turns_detail": turns_out,
    }


def warm_up_sessions(cluster: Cluster, corpus: Corpus, seed: int, block_size: int = BLOCK_SIZE) -> None:
    """Kernels compile on first use: on every replica a prompt longer than one chunk, cold
    and then as a local prefix hit; then a remote hit in every direction. Under a salt of
    its own, so nothing of it is reused by the blocks."""

    http.RECORDER = cluster.history
    rng = random.Random(f"gpu-live-sessions-warmup:{seed}")
    salt = f"warmup-{seed}"
    for name, r in cluster.replicas.items():
        prompt = corpus.text(SESSION_CHUNK + 1000, rng)
        for i in range(2):
            complete(r.url, prompt, tag=f"warmup-{name}-{i}", replica=name, max_tokens=2, load=False, publish=False,
                     cache_salt=f"{salt}-{name}")
    for p, c in directions(list(cluster.replicas)):
        prompt = corpus.text(2000, rng)
        pub = complete(cluster.replicas[p].url, prompt, tag=f"warmup-{p}{c}-pub", replica=p, max_tokens=2,
                       load=False, cache_salt=salt)
        _settle(cluster.history_dir, p, f"warmup-{p}{c}-pub", pub.prompt_tokens or 2001, 30.0, block_size)
        complete(cluster.replicas[c].url, prompt, tag=f"warmup-{p}{c}-hit", replica=c, max_tokens=2, publish=False,
                 cache_salt=salt)


def run_sessions(cluster: Cluster, seed: int, contexts: tuple[int, ...], sessions: int, turns: int,
                 deadline: float, audit: bool = False) -> list[dict]:
    """OFF-ON-ON-OFF at each context length while time is left (a length is started only if
    about 3.5x the previous one's time remains: prefill grows faster than linearly)."""
    corpus = Corpus(cluster.model_dir)
    warm_up_sessions(cluster, corpus, seed)
    out: list[dict] = []
    last = 0.0
    for ctx in contexts:
        left = deadline - time.monotonic()
        if out and left < 3.5 * last + 20:
            _say(f"kvgate gpu-live: sessions at {ctx} tokens skipped: {left:.0f} s left, the last length took "
                 f"{last:.0f} s")
            out.append({"context_tokens": ctx, "skipped": f"{left:.0f} s left; {last:.0f} s for the last length"})
            continue
        t0 = time.monotonic()
        out.append(run_session_blocks(cluster, corpus, seed, context_tokens=ctx, sessions=sessions, turns=turns,
                                      audit=audit))
        last = time.monotonic() - t0
        s = out[-1]
        _say(f"kvgate gpu-live: sessions {ctx}: cross-turn TTFT medians {s['ttft_median_ms_cross_turns']} ms; "
             f"improvement {s['improvement_cross_turn_median']}; tokens equal in all blocks "
             f"{s['tokens_equal_all_blocks']} ({last:.0f} s)")
    return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _exchange_failures(part: dict, error: str | None, stop_error: str | None, what: str, cluster: str) -> list[str]:
    """The failures of one set of exchanges (run_live's result `part`, the error its part raised
    and its cluster's stop error), named `what` ("live", "tier")."""
    out = []
    if error:
        out.append(f"the {what} exchanges raised: " + error.strip().splitlines()[-1][:300])
    bad = [f"{ex['name']} {ex.get('producer', 'A')}->{ex.get('consumer', 'B')}"
           for ex in part.get("exchanges", []) if ex["verdict"]["valid"] is not True]
    if bad:
        out.append(f"{what} exchanges failed: {', '.join(bad)}")
    if not part.get("exchanges") and not error:
        out.append(f"the {what} exchanges did not run")
    elif not part.get("passed") and not bad and not error:
        out.append(f"the {what} exchanges did not pass")
    if stop_error:
        out.append(f"{cluster}: {stop_error[:300]}")
    return out


def failures(result: dict, *, exchanges: bool, sessions: bool, bench: bool,
             session_contexts: tuple[int, ...] = (), bench_lengths: tuple[int, ...] = (),
             bench_reps: int = 1, tier_exchanges: bool = False) -> list[str]:
    """Every failure the run measured, of the parts that were asked for (see the module's
    docstring); empty when the run passed."""
    out: list[str] = []
    if not (exchanges or sessions or bench or tier_exchanges):
        return ["nothing was asked for: no exchanges, sessions or bench ran"]
    if tier_exchanges:
        out += _exchange_failures(result.get("tier") or {}, result.get("tier_error"), result.get("tier_stop_error"),
                                  "tier", "the tier replicas' cluster")
    if exchanges:
        out += _exchange_failures(result, result.get("error"), result.get("stop_error"), "live",
                                  "the tiny replicas' cluster")
    if sessions:
        if result.get("sessions_error"):
            out.append("the sessions raised: " + result["sessions_error"].strip().splitlines()[-1][:300])
        if result.get("sessions_stop_error"):
            out.append(f"the session replicas' cluster: {result['sessions_stop_error'][:300]}")
        ran = {s["context_tokens"]: s for s in result.get("sessions") or []}
        for ctx in session_contexts or tuple(ran):
            s = ran.get(ctx)
            if s is None:
                if not result.get("sessions_error"):
                    out.append(f"sessions at {ctx} tokens: not run")
                continue
            if "skipped" in s:
                out.append(f"sessions at {ctx} tokens: not run ({s['skipped']})")
                continue
            if s.get("mismatched_turns"):
                out.append(f"sessions at {ctx} tokens: {len(s['mismatched_turns'])} turns generated different tokens "
                           f"across the OFF-ON-ON-OFF blocks ({', '.join(s['mismatched_turns'][:8])})")
            for name, b in s.get("blocks", {}).items():
                if b.get("errors"):
                    out.append(f"sessions at {ctx} tokens, block {name}: {len(b['errors'])} requests failed "
                               f"({str(b['errors'][0])[:200]})")
                if b.get("settle_timeouts"):
                    out.append(f"sessions at {ctx} tokens, block {name}: {b['settle_timeouts']} turns' publishes "
                               f"never landed")
            audit = s.get("audit") or {}
            for key in sorted(audit):
                if key.endswith(("_installed_differs_from_producer", "_seen_differs_from_installed")) and audit[key]:
                    out.append(f"sessions at {ctx} tokens, audit: {key.replace('_', ' ')}: {audit[key]} blocks")
    if bench:
        if result.get("bench_error"):
            out.append("the bench raised: " + result["bench_error"].strip().splitlines()[-1][:300])
        if result.get("bench_stop_error"):
            out.append(f"the bench replicas' cluster: {result['bench_stop_error'][:300]}")
        rows = {r["prefix_tokens"]: r for r in (result.get("bench") or {}).get("rows", [])}
        for n in bench_lengths or tuple(rows):
            r = rows.get(n)
            if r is None:
                if not result.get("bench_error"):
                    out.append(f"bench at {n} tokens: not run")
                continue
            if r["runs"] < bench_reps:
                out.append(f"bench at {n} tokens: {r['runs']} of {bench_reps} repetitions ran")
            for key in ("remote_blocks_loaded", "remote_sync_blocks_loaded"):
                if key in r and r[key] < r["remote_blocks_expected"]:
                    out.append(f"bench at {n} tokens: {key.replace('_', ' ')} {r[key]} of "
                               f"{r['remote_blocks_expected']}")
            for mode in ("", "sync_"):
                got, want = r.get(f"gpu_tier_{mode}blocks_loaded"), r.get(f"gpu_tier_{mode}blocks_expected")
                if got is not None and got < want:
                    out.append(f"bench at {n} tokens: the GPU tier loaded {got} of {want} blocks"
                               f"{' (load_mode sync)' if mode else ''}")
    return out
