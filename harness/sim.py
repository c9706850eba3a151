"""A discrete-event simulation of many replicas sharing one pool (SimPy), calibrated with
measured distributions (kvgate.harness.plan.Measured), for the scale a machine cannot run live:
8 to 64 replicas starting together, a request spike, a degraded storage node.

The model, each part a measured input or a stated rule:
  replica      one engine (a SimPy Resource of capacity 1: prefills of one replica run one
               after another) and its own prefix cache (LRU over prefixes, `local_slots`).
  request      arrives (Poisson per class, or in a burst), is routed (round robin, or to a
               replica that holds its prefix: `warm_routing`), waits for its replica's engine
               (the step that schedules it looks it up and runs its load, as vLLM's
               scheduler and a CPU replica's synchronous load do), then is served as
                 local     its replica holds the prefix: T_local(L)
                 remote    the pool holds it and remote loads are on: the load takes a lease
                           when its copy can start (a link stream, and its replica's core where
                           cores are shared) and moves S bytes in S x k / B, k the transfers
                           under way as it starts (they share the measured rate B); then the
                           engine takes T_remote(L) minus the single-load transfer time
                           measured into it
                 throttled the pool's load limit (`max_loads` in flight) is reached: the
                           load is refused at once and the prefix recomputed (cold)
                 fallback  the load would end past `load_deadline_s`: it is abandoned there
                           and the prefix recomputed after it
                 cold      otherwise: T_cold(L), then the prefix is published to the pool
               where T_x(L) is drawn from a lognormal with the measured p50 and p95 at L
               (interpolated between measured lengths, as kvgate plan does).
  dispatch     where measured (`dispatch`: a request's send to its scheduler's first lookup),
               each request first spends a draw of it in the front end (on a core, where the
               replicas share them), and the median is taken out of the measured TTFTs the
               service times are drawn from; a burst's requests draw from `dispatch_burst`
               instead where it was measured (in bursts: contention included, as a delay).
  pool         LRU over prefixes by bytes, `capacity_bytes`; a publish of a prefix already
               pooled refreshes it.
  degraded     between `degrade_from_s` and `degrade_until_s` the link moves bytes
               `degrade_factor` times slower (a storage node's bad link, as bench hosts
               measures with tc).
Every random draw comes from one numpy Generator seeded by `seed`: a run replays exactly.

  simulate(measured, config) -> dict   per kind: count, p50, p95 TTFT; hit rate; bytes
                                       read and written; the link's peak queue; per request
                                       samples (kind, prefix, replica, TTFT) if asked.
  SCENARIOS                            the three scale scenarios, each with and without its
                                       mitigation (load limits, warm routing, deadline).
  run_scale(measured, replicas, seed)  every scenario at every replica count.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import OrderedDict, defaultdict
from typing import Any

import numpy as np
import simpy

from kvgate.harness.measure import percentile
from kvgate.harness.plan import Measured

Z95 = 1.6448536269514722  # the standard normal's 95th percentile


@dataclasses.dataclass(frozen=True)
class SimClass:
    name: str
    rate_rps: float  # per second, over all replicas
    prefix_tokens: int
    hot_prefixes: int = 1  # distinct prefixes of the class, drawn uniformly
    tail_tokens: int = 0
    warm: bool = True  # its prefixes start in the warm replicas' caches and the pool (False: one-off prompts)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    replicas: int
    classes: tuple[SimClass, ...]
    duration_s: float = 60.0
    seed: int = 0
    warm_replicas: int = 1  # replicas whose prefix cache starts holding every hot prefix
    pool_warm: bool = True  # the pool starts holding every hot prefix (published by the warm ones)
    capacity_bytes: float = 1e12
    local_slots: int = 64  # prefixes a replica's own cache holds
    link_streams: int = 64  # loads that move bytes at once (more wait), sharing the link's measured rate
    max_loads: int = 0  # the pool's concurrent load limit (0: none)
    load_deadline_s: float = 10.0
    warm_routing: bool = False
    remote_loads: bool = True
    burst: int = 0  # requests that all arrive at t = 0, round robin over the replicas that are not warm (a fan-out)
    spike_factor: float = 1.0  # the rate is multiplied by it between spike_from_s and spike_until_s
    spike_from_s: float = 0.0
    spike_until_s: float = 0.0
    degrade_factor: float = 1.0
    degrade_from_s: float = 0.0
    degrade_until_s: float = 0.0
    keep_samples: bool = False
    link: str = "remote"  # the measured link the loads cross: "remote" (this host's pool) or "tier"
    cores: int = 0  # CPU cores the replicas share (0: each replica has its own): a live run on a small machine


class _Lognormal:
    """A measured kind at a prefix length, as a lognormal with its p50 and p95."""

    def __init__(self, m: Measured, kind: str, fallback: str | None = None):
        self.m, self.kind, self.fallback = m, kind, fallback
        self._cache: dict[int, tuple[float, float]] = {}

    def params(self, L: int) -> tuple[float, float]:
        if L not in self._cache:
            p50, _ = self.m.at(self.kind, L, "p50_ms")
            p95, _ = self.m.at(self.kind, L, "p95_ms")
            if p50 is None and self.fallback:
                p50, _ = self.m.at(self.fallback, L, "p50_ms")
                p95, _ = self.m.at(self.fallback, L, "p95_ms")
            if p50 is None:
                raise ValueError(f"nothing measured for {self.kind} at {L} tokens")
            p50 = max(p50, 1e-3)
            sigma = max(0.0, math.log(max(p95, p50) / p50) / Z95)
            self._cache[L] = (math.log(p50), sigma)
        return self._cache[L]

    def draw(self, rng: np.random.Generator, L: int) -> float:
        mu, sigma = self.params(L)
        return float(math.exp(mu + sigma * rng.standard_normal())) / 1e3  # seconds

    def median_s(self, L: int) -> float:
        return math.exp(self.params(L)[0]) / 1e3


class _LRU:
    def __init__(self, capacity: float):
        self.capacity = capacity
        self.used = 0.0
        self.items: OrderedDict[str, float] = OrderedDict()

    def has(self, key: str) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        return False

    def put(self, key: str, size: float) -> None:
        if key in self.items:
            self.items.move_to_end(key)
            return
        self.items[key] = size
        self.used += size
        while self.used > self.capacity and self.items:
            _, s = self.items.popitem(last=False)
            self.used -= s


def simulate(m: Measured, cfg: SimConfig) -> dict[str, Any]:
    if not m.bytes_per_token:
        raise ValueError("the simulation needs bytes per token (measured)")
    link_Bps = m.throughput_Bps.get(cfg.link)
    if not link_Bps:
        raise ValueError(f"the simulation needs the {cfg.link} link's measured throughput "
                         "(bench pool: remote; bench hosts: tier)")
    rng = np.random.default_rng(cfg.seed)
    env = simpy.Environment()
    cold, local = _Lognormal(m, "cold"), _Lognormal(m, "local", "cold")
    # the front end's time before the scheduler sees a request (Tdispatch), where measured: drawn
    # for each request before it queues for its engine, and taken out of the measured service times
    dispatch = _Lognormal(m, "dispatch") if m.by_kind.get("dispatch") else None
    # a burst's requests, where the dispatch was also measured in bursts: that draw, as a delay
    # (the contention of the front ends it measured is in it)
    # (measured on shared cores: it applies where the simulated replicas share them too, not to a
    # fleet whose front ends each have their own host)
    dispatch_burst = _Lognormal(m, "dispatch_burst") if m.by_kind.get("dispatch_burst") and cfg.cores else None
    remote = _Lognormal(m, cfg.link, "remote" if cfg.link == "tier" else "tier")
    engines = [simpy.Resource(env, capacity=1) for _ in range(cfg.replicas)]
    # shared cores, as a small machine runs its replicas: a replica's forward passes and copies
    # on the core its engine is bound to (replica r on core r mod cores); the front end's work
    # on whichever core is free (its processes are not bound)
    cpu = simpy.Resource(env, capacity=cfg.cores) if cfg.cores else None
    bound = [simpy.Resource(env, capacity=1) for _ in range(cfg.cores)]
    caches = [_LRU(cfg.local_slots) for _ in range(cfg.replicas)]
    pool = _LRU(cfg.capacity_bytes)
    link = simpy.Resource(env, capacity=cfg.link_streams)
    moving = [0]  # transfers in progress: they share the link's rate
    in_flight = [0]
    peak = {"link_queue": 0, "loads_in_flight": 0}
    out: list[dict] = []
    bytes_rw = {"read": 0.0, "written": 0.0}
    rr = [0]

    hot = [(c, f"{c.name}/{i}") for c in cfg.classes if c.warm for i in range(c.hot_prefixes)]
    for c, key in hot:
        size = c.prefix_tokens * m.bytes_per_token
        for r in range(min(cfg.warm_replicas, cfg.replicas)):
            caches[r].put(key, 1)
        if cfg.pool_warm:
            pool.put(key, size)

    def degraded(t: float) -> float:
        return cfg.degrade_factor if cfg.degrade_from_s <= t < cfg.degrade_until_s else 1.0

    new = list(range(min(cfg.warm_replicas, cfg.replicas), cfg.replicas)) or list(range(cfg.replicas))

    def route(key: str, burst: bool = False) -> int:
        if cfg.warm_routing:
            holders = [r for r in range(cfg.replicas) if key in caches[r].items]
            if holders:  # the least busy replica that holds it
                return min(holders, key=lambda r: (len(engines[r].queue) + engines[r].count, r))
        r = new[rr[0] % len(new)] if burst else rr[0] % cfg.replicas
        rr[0] += 1
        return r

    def on_core(seconds: float, r: int | None = None):  # noqa: ANN202 - time that needs a core where they are shared
        if cpu is None:
            yield env.timeout(seconds)
            return
        res = cpu if r is None else bound[r % cfg.cores]
        with res.request() as core:
            yield core
            yield env.timeout(seconds)

    def request(c: SimClass, key: str, burst: bool = False):  # noqa: ANN202 - a SimPy process
        """As vLLM serves it: the request waits for its replica's engine; in the step that
        schedules it the scheduler finds the engine's own prefix cache, else asks the pool
        (the load runs inside that step), else computes the prefix and publishes it."""
        t0 = env.now
        L = c.prefix_tokens
        size = L * m.bytes_per_token
        d50 = 0.0
        if dispatch is not None:  # the front end works (HTTP, tokenizing the prompt): on a core where shared
            d50 = dispatch.median_s(L)
            if burst and dispatch_burst is not None:
                yield env.timeout(dispatch_burst.draw(rng, L))
            else:
                yield from on_core(dispatch.draw(rng, L))
        r = route(key, burst)

        def service(kind_of: _Lognormal) -> float:
            return max(1e-4, kind_of.draw(rng, L) - d50)

        with engines[r].request() as turn:
            yield turn
            kind = "cold"
            if caches[r].has(key):
                kind = "local"
                yield from on_core(service(local), r)
            else:
                pooled = cfg.remote_loads and pool.has(key)
                if pooled:
                    one_load = size / link_Bps  # the transfer a single load had inside its measured T_remote
                    started = env.now
                    peak["link_queue"] = max(peak["link_queue"], len(link.queue))
                    with link.request() as stream:
                        yield stream
                        core = None
                        if cpu is not None:  # a CPU replica's copier copies on its core
                            core = bound[r % cfg.cores].request()
                            yield core
                        # the lease is taken when the copy can start, and held while it runs
                        if cfg.max_loads and in_flight[0] >= cfg.max_loads:
                            kind, pooled = "throttled", False  # refused at once: recomputed
                        else:
                            in_flight[0] += 1
                            peak["loads_in_flight"] = max(peak["loads_in_flight"], in_flight[0])
                            moving[0] += 1  # shares the link with the transfers under way as it starts
                            transfer = size * moving[0] / link_Bps * degraded(env.now)
                            waited = env.now - started
                            if waited + transfer > cfg.load_deadline_s:  # past the load's deadline: given up there
                                yield env.timeout(max(0.0, cfg.load_deadline_s - waited))
                                kind = "fallback"
                            else:
                                yield env.timeout(transfer)
                                bytes_rw["read"] += size
                            moving[0] -= 1
                            in_flight[0] -= 1
                        if core is not None:
                            bound[r % cfg.cores].release(core)
                if kind in ("fallback", "throttled"):
                    yield from on_core(service(cold), r)
                elif pooled:
                    kind = "remote"
                    yield from on_core(max(1e-4, service(remote) - one_load), r)
                else:
                    yield from on_core(service(cold), r)
            caches[r].put(key, 1)
            if kind in ("cold", "throttled", "fallback"):
                pool.put(key, size)
                bytes_rw["written"] += size
        out.append({"t": round(t0, 4), "class": c.name, "kind": kind, "replica": r,
                    "ttft_ms": (env.now - t0) * 1e3})

    def arrivals(c: SimClass):  # noqa: ANN202
        while True:
            rate = c.rate_rps * (cfg.spike_factor if cfg.spike_from_s <= env.now < cfg.spike_until_s else 1.0)
            yield env.timeout(float(rng.exponential(1.0 / rate)))
            if env.now >= cfg.duration_s:
                return
            env.process(request(c, f"{c.name}/{int(rng.integers(c.hot_prefixes))}"))

    for i in range(cfg.burst):  # all at t = 0, spread over the classes in turn
        c = cfg.classes[i % len(cfg.classes)]
        env.process(request(c, f"{c.name}/{int(rng.integers(c.hot_prefixes))}", burst=True))
    for c in cfg.classes:
        if c.rate_rps > 0:
            env.process(arrivals(c))
    env.run()
    return summarize(out, cfg, bytes_rw, peak)


def summarize(out: list[dict], cfg: SimConfig, bytes_rw: dict, peak: dict) -> dict[str, Any]:
    by: dict[str, list[float]] = defaultdict(list)
    for o in out:
        by[o["kind"]].append(o["ttft_ms"])
    allv = [o["ttft_ms"] for o in out]
    doc = {
        "replicas": cfg.replicas, "requests": len(out),
        "kinds": {k: {"n": len(v), "p50_ms": round(statistics.median(v), 2), "p95_ms": round(percentile(v, 0.95), 2)}
                  for k, v in sorted(by.items())},
        "ttft_p50_ms": round(statistics.median(allv), 2) if allv else None,
        "ttft_p95_ms": round(percentile(allv, 0.95), 2) if allv else None,
        "hit_rate": round(sum(len(by[k]) for k in ("local", "remote")) / len(out), 4) if out else None,
        "bytes_read": round(bytes_rw["read"]), "bytes_written": round(bytes_rw["written"]),
        "peak_link_queue": peak["link_queue"], "peak_loads_in_flight": peak["loads_in_flight"],
    }
    if cfg.keep_samples:
        doc["samples"] = out
    return doc


def scenarios(replicas: int, prefix_tokens: int, seed: int, bytes_per_token: float) -> dict[str, SimConfig]:
    """The seed's three load patterns at `replicas`, each with and without its mitigation."""
    hot = (SimClass("hot", 0.0, prefix_tokens, hot_prefixes=4),)
    fanout = SimConfig(replicas, hot, duration_s=0.0, seed=seed, warm_replicas=1, burst=2 * replicas)
    spike_classes = (SimClass("shared", 2.0, prefix_tokens, hot_prefixes=8),
                     SimClass("unique", 2.0, prefix_tokens // 2, hot_prefixes=10**9, warm=False))
    spike = SimConfig(replicas, spike_classes, duration_s=60.0, seed=seed, warm_replicas=replicas // 2, spike_factor=4.0,
                      spike_from_s=20.0, spike_until_s=40.0,
                      capacity_bytes=64 * prefix_tokens * bytes_per_token)  # the shared prefixes and a few unique ones
    # a storage node's link degraded 50x for 20 s; loads cross the network tier, bounded by
    # the tier deadline (1 s, kvpool's default) or not
    degraded = SimConfig(replicas, (SimClass("shared", 4.0, prefix_tokens, hot_prefixes=32),), duration_s=60.0,
                         seed=seed, warm_replicas=0, degrade_factor=50.0, degrade_from_s=20.0, degrade_until_s=40.0,
                         link="tier", load_deadline_s=1.0)
    return {
        "fanout": fanout,
        "fanout+load_limit": dataclasses.replace(fanout, max_loads=max(1, replicas // 4)),
        "fanout+warm_routing": dataclasses.replace(fanout, warm_routing=True),
        "spike": spike,
        "degraded": dataclasses.replace(degraded, load_deadline_s=60.0),
        "degraded+deadline": degraded,
    }


def run_scale(m: Measured, replica_counts: tuple[int, ...] = (8, 16, 32, 64), prefix_tokens: int = 4096,
              seed: int = 0, progress: Any = None) -> dict[str, Any]:
    rows = []
    for n in replica_counts:
        for name, cfg in scenarios(n, prefix_tokens, seed, m.bytes_per_token or 1).items():
            if cfg.link not in m.throughput_Bps:  # no tier measured: the degraded node is this host's pool
                cfg = dataclasses.replace(cfg, link="remote")
            rows.append({"scenario": name, **simulate(m, cfg)})
            if progress is not None:
                progress.update(1)
    return {"prefix_tokens": prefix_tokens, "seed": seed, "rows": rows,
            "degraded_link": "tier" if "tier" in m.throughput_Bps else "remote"}
