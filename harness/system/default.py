"""The embedded default system the gate and the live suite run on.

  start_system(report_dir, replicas) -> (cluster, model_dir)
      a local pool and replicas A (policy fail) and B (recompute) of the tiny local model
      (kvgate.harness.system.cluster.default_cluster), and as the scenarios need them C (revision
      r2 of the model: other weights, same tokenizer) and D (a 64-block KV cache whose
      pool traffic crosses the fault proxy over TCP). Progress goes to stderr.
  start_hosts_system(report_dir, store="redis") -> (system, model_dir)
      the multi-host system (kvgate.harness.system.hosts.MultiHost): G on host h1, H on host h2,
      each with its own pool daemon, the store (Redis, or Mooncake's master and a storage
      node) on a store host; the tier settings HOSTS_SETTINGS
      (short timeouts and holds, so a scenario's faults and heals fit in seconds).
  start_for(report_dir, replicas, store)   whichever of the two the replicas belong to
      (HOSTS_REPLICAS: the multi-host system's; the scenario catalog reads it from here).
"""

from __future__ import annotations

import sys
from pathlib import Path


def start_system(report_dir: Path, replicas: set[str]):  # noqa: ANN201
    """The embedded default system: a local pool, replicas A and B of the tiny local
    model (harness.cluster.default_cluster), and as the scenarios need them C (revision
    r2 of the model: other weights, same tokenizer) and D (a 64-block KV cache)."""
    from kvgate.fixtures.tiny_model import build_tiny_model
    from kvgate.harness.system.cluster import DEFAULT_CHUNK, ReplicaSpec, default_cluster, small_kv_spec

    model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
    cluster, specs = default_cluster(model, report_dir)
    if "C" in replicas:
        r2 = build_tiny_model(report_dir / "model" / "tiny-r2", seed=0, revision="r2")
        specs.append(ReplicaSpec("C", core="0", model_dir=r2, audit=True, max_num_batched_tokens=DEFAULT_CHUNK,
                                 faults_file=str(report_dir / "faults-C.json")))
    if "D" in replicas:
        specs.append(small_kv_spec(report_dir))
    print(f"kvgate: starting the pool and {len(specs)} vLLM replicas ({', '.join(s.name for s in specs)}; "
         "one to three minutes) ...", file=sys.stderr, flush=True)
    return cluster.start(specs), model


HOSTS_REPLICAS = frozenset({"G", "H"})  # the multi-host system's replicas: G on host h1, H on host h2
# A call to the tier times out at 0.5 s: a degraded link's page (128 KiB at 256 kbit/s, about 4 s)
# takes longer, and a partitioned store costs one lookup that long. A whole load stops at 2 s: a slow
# but healthy store's (11 pages at 100 mbit/s, about 0.12 s on a quiet machine) finishes with room
# to spare on a loaded two-core one, where a 0.5 s deadline cut one short at its tenth page.
HOSTS_SETTINGS = {"tier_timeout_s": 0.5, "tier_deadline_s": 2.0, "tier_backoff_s": 3.0, "tier_backoff_max_s": 3.0}


def start_hosts_system(report_dir: Path, store: str = "redis"):  # noqa: ANN201
    from kvgate.fixtures.tiny_model import build_tiny_model
    from kvgate.harness.system.hosts import MultiHost

    model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
    print(f"kvgate: starting hosts h1 (replica G, its pool), h2 (replica H, its pool) and a store host ({store}) "
          "as network namespaces (one to three minutes) ...", file=sys.stderr, flush=True)
    system = MultiHost(model, report_dir / f"hosts-{store}", {"h1": ["G"], "h2": ["H"]}, settings=HOSTS_SETTINGS,
                       store=store)
    return system.start(), model


def start_for(report_dir: Path, replicas: set[str], store: str = "redis"):  # noqa: ANN201
    if replicas & HOSTS_REPLICAS:
        return start_hosts_system(report_dir, store)
    return start_system(report_dir, replicas)
