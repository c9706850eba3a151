"""`kvgate bench hosts`: the multi-host tier measured on hosts made of network namespaces
(kvgate.harness.system.hosts): replica G on host h1 (its pool daemon), replica H on host h2 (its
own), Redis on a store host; every byte between hosts crosses a veth link, and each host
has a core of its own.

Per prefix length, over fresh prompts (G computes and publishes each, to h1's pool and the
tier):
  cold_prefill_ms       H, the pool and the tier bypassed (a cache salt of its own)
  same_host_hit_ttft_ms G with its own prefix cache emptied: the blocks from h1's pool
                        (shared memory), as another replica of h1 would load them
  local_hit_ttft_ms     G again: its own prefix cache
  cross_host_hit_ttft_ms H: the blocks from the store host (the network tier)
  tier_mb_per_s         the tier loads' bytes over their seconds (the worker's records)
and the ratios to the same run's baselines: cross/same-host, cross/local, cross/cold, and
the seed's rule (p95 cross-host below p50 cold).

Then the degradation table at one length (--fault-length): H's time to first token with
the store host healthy, its link degraded (tc tbf at --degraded-rate: the first request
after the fault and a later one), the store killed, and the store partitioned away, next
to cold. The tier rule (kvpool.tier.rule) is what keeps the degraded, dead and
partitioned rows near cold. Every run's output must equal its baseline's tokens (byte
exactness is the suites' job; here a wrong output fails the bench). The last line is one
JSON object; `--out` also writes it to a file.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvgate.harness.client.http import complete, reset_prefix_cache
from kvgate.harness.scenarios.hosts import publish_on_g
from kvgate.harness.workload.prompts import Corpus

LENGTHS = (1024, 2048, 4096, 8192)
B = 128
PAGE = 128 * 1024
# The bench's own tier settings: a deadline long enough that the healthy rows measure the
# tier, not the rule; the fault rows show what the rule does with them.
LAYOUT = {"h1": ["G"], "h2": ["H"]}
SETTINGS = {"tier_timeout_s": 0.5, "tier_deadline_s": 2.0, "tier_backoff_s": 5.0, "tier_backoff_max_s": 5.0}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class BenchError(RuntimeError):
    """A run gave a wrong output or no output: the bench's figures would mean nothing."""


def _check(got, ref, what: str) -> None:  # noqa: ANN001
    if got.error is not None or got.token_ids != ref.token_ids:
        raise BenchError(f"{what}: output differs from its baseline ({got.error or got.token_ids} vs {ref.token_ids})")


def run_bench(reps: int = 3, lengths: tuple[int, ...] = LENGTHS, fault_length: int = 4096,
              degraded_rate: str = "256kbit", report_dir: Path | None = None, out: Path | None = None) -> int:
    from kvgate.fixtures.tiny_model import build_tiny_model
    from kvgate.harness.system.hosts import MultiHost

    report_dir = report_dir or Path(tempfile.mkdtemp(prefix="kvgate-bench-hosts-"))
    model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
    corpus = Corpus(model)
    _say("kvgate bench hosts: hosts h1 (G), h2 (H) and a store host (Redis) as network namespaces ...")
    system = MultiHost(model, report_dir / "hosts", LAYOUT, settings=SETTINGS, pool_pages=2048,
                       kv_bytes=512 * 2**20)
    system.start()
    try:
        rng = random.Random(20261202)
        for name in ("G", "H"):
            complete(system.url(name), corpus.text(64, rng), tag=f"warmup-{name}", replica=name, max_tokens=1)
        rows = [_length(system, corpus, rng, n, reps) for n in lengths]
        faults = _faults(system, corpus, rng, fault_length, reps, degraded_rate)
    finally:
        system.stop()
    result = {"rows": rows, "faults": faults, "settings": SETTINGS,
              "system": {"hosts": LAYOUT, "store": "redis-server on its own host", "cores": "one per host",
                         "links": "veth pairs to a bridge (no rate limit unless a fault sets one)"}}
    from kvgate.harness.provenance import provenance

    result["provenance"] = provenance()
    _say("prefix_tokens,cold_ms,local_hit_ms,same_host_hit_ms,cross_host_hit_ms(p50/p95),tier_MB/s,cross/same,cross/cold")
    for r in rows:
        _say(f"{r['prefix_tokens']},{r['cold_prefill_ms']},{r['local_hit_ttft_ms']},{r['same_host_hit_ttft_ms']},"
             f"{r['cross_host_hit_ttft_ms']}/{r['cross_host_hit_ttft_ms_p95']},{r['tier_mb_per_s']},"
             f"{r['cross_vs_same_host']},{r['cross_vs_cold']}")
    for name, f in faults["rows"].items():
        _say(f"  {name}: {f['ttft_ms']} ms ({f['vs_cold']}x cold)")
    text = json.dumps(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    return 0


def _length(system, corpus: Corpus, rng: random.Random, n: int, reps: int) -> dict:  # noqa: ANN001
    from kvgate.harness.checkers.history import records

    cold, local, same, cross, rates = [], [], [], [], []
    claimed = found = 0
    for rep in range(reps):
        prompt = corpus.text(n - 1, rng)
        tag = f"b{n}-{rep}"
        publish_on_g(system, prompt, f"{tag}-g", max_tokens=1)
        c = complete(system.url("H"), prompt, tag=f"{tag}-cold", replica="H", max_tokens=1, load=False, publish=False,
                     cache_salt=f"cold-{tag}")
        reset_prefix_cache(system.url("G"))  # G's next run finds the prompt in h1's pool only
        s = complete(system.url("G"), prompt, tag=f"{tag}-same", replica="G", max_tokens=1, publish=False)
        loc = complete(system.url("G"), prompt, tag=f"{tag}-local", replica="G", max_tokens=1, publish=False)
        x = complete(system.url("H"), prompt, tag=f"{tag}-cross", replica="H", max_tokens=1, publish=False)
        for got, what in ((s, "same-host hit"), (x, "cross-host hit"), (loc, "local hit")):
            _check(got, c, f"{what} at {n} tokens")
        cold.append(c.ttft_s * 1e3)
        same.append(s.ttft_s * 1e3)
        cross.append(x.ttft_s * 1e3)
        local.append(loc.ttft_s * 1e3)
        for r in records(system.history_dir, "tier_load", tag=f"{tag}-cross", replica="H"):
            if r.get("loaded") and r.get("seconds"):
                rates.append(r["loaded"] * PAGE / r["seconds"] / 1e6)
        (lk,) = records(system.history_dir, "lookup", tag=f"{tag}-cross", replica="H")
        claimed += lk.get("tier_blocks", 0)
        found += lk.get("tier_found", lk.get("tier_blocks", 0))
        for name in ("G", "H"):  # the next prompt starts from cold caches everywhere
            reset_prefix_cache(system.url(name))
    row = {"prefix_tokens": n, "runs": reps, "kv_bytes": n // B * PAGE}
    for name, values in (("cold_prefill_ms", cold), ("local_hit_ttft_ms", local), ("same_host_hit_ttft_ms", same),
                         ("cross_host_hit_ttft_ms", cross)):
        row[name] = round(statistics.median(values), 1)
        row[f"{name}_p95"] = round(_pct(values, 0.95), 1)
    row["tier_mb_per_s"] = round(statistics.median(rates), 1) if rates else None
    row["tier_blocks_claimed_of_found"] = [claimed, found]
    row["cross_vs_same_host"] = round(row["cross_host_hit_ttft_ms"] / row["same_host_hit_ttft_ms"], 3)
    row["cross_vs_local"] = round(row["cross_host_hit_ttft_ms"] / row["local_hit_ttft_ms"], 3)
    row["cross_vs_cold"] = round(row["cross_host_hit_ttft_ms"] / row["cold_prefill_ms"], 3)
    row["seed_rule_p95_cross_below_p50_cold"] = row["cross_host_hit_ttft_ms_p95"] < row["cold_prefill_ms"]
    _say(f"  {n:>6} tokens: cold {row['cold_prefill_ms']} ms, local {row['local_hit_ttft_ms']}, same-host "
         f"{row['same_host_hit_ttft_ms']}, cross-host {row['cross_host_hit_ttft_ms']} ms, tier {row['tier_mb_per_s']} MB/s")
    return row


def _faults(system, corpus: Corpus, rng: random.Random, n: int, reps: int, rate: str) -> dict:  # noqa: ANN001
    """H's TTFT at n tokens under each state of the store host, next to cold."""
    from kvgate.harness.checkers.history import records

    out: dict[str, list[float]] = {k: [] for k in ("cold", "healthy", "degraded_first", "degraded_later", "dead",
                                                   "partitioned_first", "partitioned_later")}
    notes: dict[str, list] = {k: [] for k in out}

    def one(state: str, prompt: str, tag: str, ref=None) -> None:  # noqa: ANN001
        got = complete(system.url("H"), prompt, tag=tag, replica="H", max_tokens=1, publish=False)
        if ref is not None:
            _check(got, ref, f"{state} at {n} tokens")
        out[state].append(got.ttft_s * 1e3)
        lk = records(system.history_dir, "lookup", tag=tag, replica="H")
        notes[state].append({k: lk[0].get(k) for k in ("tier_blocks", "tier_held", "tier_error", "lookup_us", "deferred")
                             if k in lk[0]}
                            if lk else None)

    def settle() -> None:  # heal, and let the rule's hold expire and its probe pass
        system.reset()
        time.sleep(SETTINGS["tier_backoff_max_s"] + 0.3)
        warm = corpus.text(n - 1, rng)
        for i in range(2):
            publish_on_g(system, warm, f"settle-{time.monotonic_ns()}-{i}", max_tokens=1)
            complete(system.url("H"), warm, tag=f"settle-h-{time.monotonic_ns()}", replica="H", max_tokens=1,
                     publish=False)
            system.reset()

    for rep in range(reps):
        settle()
        prompts = [corpus.text(n - 1, rng) for _ in range(2)]
        tag = f"f{n}-{rep}"
        for i, p in enumerate(prompts):
            publish_on_g(system, p, f"{tag}-g{i}", max_tokens=1)
        refs = [complete(system.url("H"), p, tag=f"{tag}-cold{i}", replica="H", max_tokens=1, load=False,
                         publish=False, cache_salt=f"cold-{tag}") for i, p in enumerate(prompts)]
        out["cold"].append(refs[0].ttft_s * 1e3)
        one("healthy", prompts[0], f"{tag}-healthy", refs[0])
        reset_prefix_cache(system.url("H"))
        system.slow("store", rate)
        one("degraded_first", prompts[0], f"{tag}-deg1", refs[0])
        reset_prefix_cache(system.url("H"))
        one("degraded_later", prompts[1], f"{tag}-deg2", refs[1])
        system.heal("store")

        settle()
        prompts = [corpus.text(n - 1, rng) for _ in range(3)]
        for i, p in enumerate(prompts):
            publish_on_g(system, p, f"{tag}-pg{i}", max_tokens=1)
        refs = [complete(system.url("H"), p, tag=f"{tag}-pcold{i}", replica="H", max_tokens=1, load=False,
                         publish=False, cache_salt=f"cold-{tag}") for i, p in enumerate(prompts)]
        system.partition("store")
        one("partitioned_first", prompts[0], f"{tag}-part1", refs[0])
        reset_prefix_cache(system.url("H"))
        one("partitioned_later", prompts[1], f"{tag}-part2", refs[1])
        system.heal("store")
        settle()
        publish_on_g(system, prompts[2], f"{tag}-kg", max_tokens=1)
        system.kill_store()
        one("dead", prompts[2], f"{tag}-dead", refs[2])
        system.restart_store()
    cold = statistics.median(out["cold"])
    rows = {k: {"ttft_ms": round(statistics.median(v), 1), "ttft_ms_max": round(max(v), 1),
                "vs_cold": round(statistics.median(v) / cold, 3), "lookups": notes[k]} for k, v in out.items()}
    return {"prefix_tokens": n, "runs": reps, "degraded_rate": rate, "rows": rows}
