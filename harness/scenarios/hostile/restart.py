"""Hostile scenario: restart. The pool daemon restarted again and again under live replicas
whose schedulers probe the tenant segment's index (kvpool.client.pool_client.PoolClient.probe) on
vLLM's scheduler thread while their lookup threads drop the dead connection and swap in
the new daemon's segment. An exception there ends the replica's engine core (every later
request fails, /health fails); a probe that read the old segment beside the new session
claims blocks the new pool does not hold.

  restart_under_probe(cluster, corpus, seed, *, restarts=20, senders=3, prompt_tokens=400,
                      lookup_delay_ms=300, control=None, pause_ms=50)
      Replicas A and B are sent requests without pause (`senders` threads each, prompts
      drawn from a few, every request under its own cache salt so that neither the
      replica's prefix cache nor the pool answers it: each is probed; none publishes, so
      the pool holds nothing the race could claim) while the pool is SIGKILLed and
      restarted `restarts` times at seeded moments. Every lookup of A and B waits
      `lookup_delay_ms` (kvgate.faults.backend section "lookup": a slow pool), so lookups run
      beside the next requests' probes, as they do under load. Judged:
        * no replica's engine died: every request ended with its tokens, both replicas
          healthy at the end (the requests oracle sees any that failed);
        * outputs unchanged: every completion's tokens equal a cold run of its prompt on
          its replica;
        * misses classified: every lookup of the race is a miss with a cause, some
          transport_error (the pool was down), none a claimed hit (the pool held nothing);
        * sharing resumes: after the last restart A publishes a prompt and B loads every
          loadable block, its output equal to A's own prefix hit (the same partition).
      control="unguarded_probe": both replicas' probes are kvgate.faults.hook_controls'
      unguarded probe (the scheduler reads the client's socket and segment one attribute
      at a time, pausing `pause_ms` between its reads), plugged in through the replicas'
      fault control (kvgate.faults.backend, section "client"). A restart swapping the segment
      under it raises TypeError out of get_num_new_matched_tokens: the engine core dies and
      the requests oracle finds requests that failed without a failed load. The control's run
      stops restarting the pool once a request of it has failed (its defect has struck; the
      engines are gone). A replica left unhealthy is restarted at the end (recorded), so the
      gate goes on.

RUNNERS maps a scenario file's `runner` to its body (kvgate.harness.scenarios.catalog).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable

from kvgate.harness.checkers.history import records
from kvgate.harness.checkers.verdict import Checks, Verdict
from kvgate.harness.client.http import Completion, RequestFailed, complete, healthy
from kvgate.harness.scenarios.live import BLOCK, wait_stored
from kvgate.harness.system.cluster import Cluster
from kvgate.harness.workload.prompts import Corpus

CONTROLS = ("unguarded_probe",)
REPLICAS = ("A", "B")
# a lookup's miss causes while the pool restarts: down (transport_error), up and empty
# (never_published), a lookup past its bound (timeout), a publish still open (in_flight)
RACE_CAUSES = {"transport_error", "never_published", "timeout", "in_flight"}


def _arm(cluster: Cluster, lookup_delay_ms: float, control: str | None, pause_ms: float) -> None:
    doc: dict[str, object] = {"lookup": {"delay_ms": lookup_delay_ms}} if lookup_delay_ms else {}
    if control:
        doc["client"] = {"control": control, "pause_ms": pause_ms}
    for name in REPLICAS:
        cluster.faults[name].write_text(json.dumps(doc))


def _heal_replicas(cluster: Cluster) -> list[str]:
    """Restart a replica whose engine is gone (its server up or not): the gate goes on."""
    healed = []
    for name in REPLICAS:
        if not healthy(cluster.replicas[name].url, timeout_s=10.0):
            cluster.nemesis("replica_heal", replica=name, reason="unhealthy after the restart race")
            cluster.kill_replica(name)
            healed.append(name)
    if healed:
        cluster.restart_replicas(healed)
    return healed


def restart_under_probe(cluster: Cluster, corpus: Corpus, seed: int, *, restarts: int = 20, senders: int = 3,
                        prompt_tokens: int = 400, prompts: int = 4, lookup_delay_ms: float = 300,
                        control: str | None = None, pause_ms: float = 50) -> Verdict:
    if control not in (None, *CONTROLS):
        raise ValueError(f"unknown control {control!r}; known {CONTROLS}")
    rng = random.Random(seed)
    tag = f"{'rc' if control else 'rr'}{seed % 10**8}"
    texts = [corpus.text(prompt_tokens, rng) for _ in range(prompts)]
    urls = {name: cluster.replicas[name].url for name in REPLICAS}
    # Cold references first, before anything is armed: each prompt on each replica.
    cold = {(name, k): complete(urls[name], text, tag=f"{tag}-cold-{name}{k}", replica=name, load=False,
                                publish=False, cache_salt=f"cold-{tag}-{k}")
            for name in REPLICAS for k, text in enumerate(texts)}

    done: list[tuple[str, int, Completion]] = []  # (replica, prompt, completion) of the race
    failed: list[tuple[str, str]] = []  # (replica, why) of race requests that did not complete
    stop = threading.Event()
    lock = threading.Lock()

    def sender(name: str, i: int) -> None:
        srng = random.Random(f"{seed}:{name}:{i}")
        n = 0
        while not stop.is_set():
            k = srng.randrange(prompts)
            rtag = f"{tag}-r{name}{i}-{n}"
            n += 1
            try:  # a new cache salt: no prefix-cache hit, and no pooled block, so every request probes
                got = complete(urls[name], texts[k], tag=rtag, replica=name, publish=False, cache_salt=rtag,
                               timeout_s=60)
            except RequestFailed as exc:  # recorded as failed (the requests oracle reads it); go on
                with lock:
                    failed.append((name, str(exc)[:200]))
                time.sleep(0.2)
                continue
            with lock:
                done.append((name, k, got))

    _arm(cluster, lookup_delay_ms, control, pause_ms)
    threads = [threading.Thread(target=sender, args=(name, i), name=f"sender-{name}{i}", daemon=True)
               for name in REPLICAS for i in range(senders)]
    for t in threads:
        t.start()
    kills = 0
    try:
        time.sleep(1.0)  # the senders' first requests probe a live pool
        for r in range(restarts):
            with lock:
                casualty = bool(control and failed)
            if casualty:  # the control's defect struck (a request failed): no restart after it adds to the proof
                cluster.nemesis("control_struck", iteration=r, failed=len(failed))
                break
            time.sleep(rng.uniform(0.2, 1.0))
            cluster.nemesis("pool_kill", iteration=r)
            cluster.pool.kill()
            kills += 1
            time.sleep(rng.uniform(0.0, 0.5))  # down: lookups are transport_error
            cluster.pool.restart()
            # The pool is back once the lookups that were sent while it was down have been
            # answered (each waited lookup_delay_ms, then a scheduler step collects it): the
            # down interval the miss-cause oracle excuses transport errors in ends here.
            time.sleep(lookup_delay_ms / 1000 + 0.3)
            cluster.nemesis("pool_restart", iteration=r)
        time.sleep(1.5)  # the last reconnects race the last probes
    finally:  # the heal step runs whatever happened
        stop.set()
        for t in threads:
            t.join(timeout=90)
        if cluster.pool.proc.poll() is not None:
            cluster.pool.restart()
            cluster.nemesis("pool_restart", iteration="heal")
        _arm(cluster, 0, None, 0)
    healed = _heal_replicas(cluster)

    # Sharing resumes: A publishes a new prompt, B loads it (no fault armed any more).
    final = corpus.text(5 * BLOCK + 50, rng)
    fb = a_hit = None
    final_error = None
    try:
        complete(urls["A"], final, tag=f"{tag}-fa", replica="A")
        wait_stored(cluster, f"{tag}-fa", "A")
        fb = complete(urls["B"], final, tag=f"{tag}-fb", replica="B")
        a_hit = complete(urls["A"], final, tag=f"{tag}-fahit", replica="A", load=False, publish=False)
    except RequestFailed as exc:  # judged below (and by the requests oracle), not an aborted run
        final_error = str(exc)[:300]

    h = cluster.history_dir
    race = [r for r in records(h, "lookup") if str(r.get("tag", "")).startswith(f"{tag}-r")]
    claimed = [r for r in race if r.get("outcome") in ("remote_hit", "tier_hit")]
    unclassified = [r for r in race if r.get("outcome") == "miss" and r.get("miss_cause") not in RACE_CAUSES]
    causes = sorted({str(r.get("miss_cause")) for r in race if r.get("outcome") == "miss"})
    differ = [(name, k, got.tag) for name, k, got in done if list(got.token_ids) != list(cold[(name, k)].token_ids)]
    up = [r for r in records(h, "lookup", tag=f"{tag}-fb", replica="B")]

    c = Checks()
    c.check("the pool was restarted under the probes", kills == restarts and len(done) >= 2 * restarts,
            {"kills": kills, "completed": len(done)})
    c.check("no replica's engine died: every request of the race completed", not failed,
            {"failed": len(failed), "first": failed[:3]})
    c.check("both replicas stayed healthy", not healed, healed)
    c.check("every completion's tokens equal a cold run of its prompt on its replica", not differ,
            {"differ": len(differ), "first": differ[:3]})
    c.check("every lookup of the race was answered", len(race) >= len(done), {"lookups": len(race), "done": len(done)})
    c.check("no lookup of the race claimed a block (the pool held none)", not claimed,
            [(r.get("tag"), r.get("via"), r.get("hit_blocks")) for r in claimed[:3]])
    c.check("every miss of the race has its cause", not unclassified,
            [(r.get("tag"), r.get("miss_cause")) for r in unclassified[:3]])
    c.check("the pool's restarts were seen as transport_error", "transport_error" in causes, causes)
    c.check("after the restarts sharing resumed", final_error is None and len(up) == 1
            and up[0].get("outcome") == "remote_hit" and up[0].get("hit_blocks") == 5, final_error or up[:1])
    c.check("and B's output is complete", fb is not None and len(fb.token_ids) == 16,
            None if fb is None else len(fb.token_ids))
    c.output("B's output after the restarts equals A's prefix hit of the same blocks", fb, a_hit)
    c.evidence.update(restarts=kills, requests=len(done) + len(failed), failed=len(failed), lookups=len(race),
                      miss_causes=causes, healed=healed, control=control, lookup_delay_ms=lookup_delay_ms,
                      pause_ms=pause_ms if control else None)
    return c.verdict(f"{kills} pool restarts under {len(done)} probed requests: no engine died, outputs unchanged, "
                     f"misses classified ({', '.join(causes)}), sharing resumed")


RUNNERS: dict[str, Callable[..., Verdict]] = {"restart_under_probe": restart_under_probe}
