"""The seeded fault schedule: data, drawn from one root seed, replayable.

  FaultSpec          one fault site: its kind, where it strikes, its drawn parameters, the
                     probability it fires with once active, and its heal step.
  FaultSchedule      the run's faults: seed, profile, specs. JSON in and out (a failing
                     run's schedule is written next to its report and replays as is).
  draw_schedule(seed, profile)
                     every parameter from a named child generator of the root seed
                     (`random.Random(f"{seed}:fault:{kind}")`), so adding a fault kind never
                     changes another kind's draws. Each site is activated at most once per
                     run (BUGGIFY style: a drawn coin), then fires with its drawn probability.
  pin(schedule)      a schedule file replayed as it is: draw_schedule of its seed returns it.
  FaultSchedule.fires(kind, attempt) / .first_firing(kind)
                     whether the site fires on its n-th opportunity, decided by the schedule
                     alone (same seed, same answers); a seed cannot force thread
                     interleavings, and reports say so. The live injectors take the same
                     decision with `fires(seed, kind, attempt, p)` (kvgate.faults.backend: a load
                     fault armed with "p" and "schedule_seed").
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

# kind -> (site it strikes, heal step). The live injectors: kvgate.faults.backend, kvgate.faults.copier,
# kvgate.faults.connector, kvgate.faults.proxy, and the harness's own actions on the pool and replicas.
KINDS: dict[str, tuple[str, str]] = {
    "corrupt": ("pool arena (a committed page under a lease)", "the bit is flipped back when the lease is released"),
    "transport_error": ("transport proxy (the acquire's reply)", "the client reconnects on its next request"),
    "timeout": ("pool client (a page read slower than the load's deadline)", "the next load has a fresh deadline"),
    "evict": ("pool_client.acquire", "the recomputed blocks are published again"),
    "pool_restart": ("pool daemon", "restart the daemon; clients reconnect; the pool starts empty"),
    "stream_delay": ("copier", "the delayed copy runs; the engine's ordering held the blocks meanwhile"),
    "revision_mismatch": ("namespace", "nothing to heal: blocks of another revision are never loaded"),
    "replica_crash": ("replica process, mid-publish", "restart the replica; the pool reclaimed its open publish"),
    "conn_reset": ("transport proxy (page frame)", "the client reconnects on its next request"),
    "truncated_frame": ("transport proxy (page frame)", "the client reconnects on its next request"),
    "bitflip": ("transport proxy (page payload)", "the next load reads the committed page again"),
    "stall": ("transport proxy (page frame)", "the stall ends; the next load has a fresh deadline"),
    "slow_link": ("transport proxy (every page frame)", "the throttle is lifted"),
    "evict_leased": ("pool (evict, capacity squeeze)", "the lease is released; the capacity restored"),
    "store_kill": ("the network tier's store server (SIGKILL, on its own host)",
                   "restart it, empty; the tier rule's hold expires and a probe trusts it again"),
    "store_partition": ("the store host's link (down)", "the link back up; the hold expires, a probe passes"),
    "store_degraded": ("the store host's link (tc tbf, slower than recompute)",
                       "the rate limit lifted; the hold expires, a probe passes"),
    "store_slow": ("the store host's link (tc tbf, slower, still faster than recompute)", "the rate limit lifted"),
    "hostile": ("an adversary at a boundary (a tenant's mapping, a store client, a checkpoint path, a frame, "
                "the run directory, a restart under the probe)",
                "the adversary stops; the pool is restarted or reset and the store flushed"),
}
PROFILES: dict[str, tuple[str, ...]] = {
    "transport": ("corrupt", "transport_error", "timeout", "conn_reset", "truncated_frame", "bitflip", "stall",
                  "slow_link"),
    "eviction": ("evict", "evict_leased"),
    "crash": ("pool_restart", "replica_crash"),
    "stream": ("stream_delay",),
    "revision": ("revision_mismatch",),
    "hosts": ("store_kill", "store_partition", "store_degraded", "store_slow"),
    "hostile": ("hostile",),
    "all": tuple(KINDS),
}


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    kind: str
    site: str
    heal: str
    active: bool
    probability: float
    params: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class FaultSchedule:
    seed: int
    profile: str
    faults: tuple[FaultSpec, ...]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FaultSchedule:
        data = json.loads(text)
        return cls(int(data["seed"]), str(data["profile"]), tuple(FaultSpec(**f) for f in data["faults"]))

    def spec(self, kind: str) -> FaultSpec:
        for f in self.faults:
            if f.kind == kind:
                return f
        raise KeyError(f"fault kind {kind!r} is not in profile {self.profile!r}")

    def fires(self, kind: str, attempt: int) -> bool:
        spec = self.spec(kind)
        return spec.active and fires(self.seed, kind, attempt, spec.probability)

    def first_firing(self, kind: str, limit: int = 16) -> int | None:
        """The opportunity (0, 1, ...) at which an active site first fires; None if it does
        not within `limit` (or the site is not active in this run)."""
        return next((n for n in range(limit) if self.fires(kind, n)), None)


def fires(seed: int, kind: str, attempt: int, probability: float) -> bool:
    """Whether a site fires on its n-th opportunity: one draw of the run's seed, the same
    in the schedule and in the injector that acts on it."""
    return random.Random(f"{seed}:fires:{kind}:{attempt}").random() < probability


_PINNED: dict[int, FaultSchedule] = {}


def pin(schedule: FaultSchedule) -> None:
    """Make `draw_schedule(schedule.seed, profile)` return this schedule as it is, for any
    profile whose kinds it holds: a schedule file, perhaps edited, replays with its own
    parameters and probabilities, not drawn again. Validated against the kinds first."""
    for f in schedule.faults:
        if f.kind not in KINDS:
            raise ValueError(f"schedule names an unknown fault kind {f.kind!r}; known: {sorted(KINDS)}")
        if not 0.0 <= float(f.probability) <= 1.0:
            raise ValueError(f"fault {f.kind}: probability {f.probability!r} is not in [0, 1]")
    _PINNED[schedule.seed] = schedule


def draw_schedule(seed: int, profile: str = "all", *, force_active: bool = True) -> FaultSchedule:
    """`force_active` (the gate's default) activates every site of the profile, so every
    kind is exercised in every run; without it each site is activated by a drawn coin. A
    pinned schedule (pin) of that seed and profile is returned as it is."""
    if profile not in PROFILES:
        raise ValueError(f"unknown fault profile {profile!r}; known: {sorted(PROFILES)}")
    pinned = _PINNED.get(seed)
    if pinned is not None and set(PROFILES[profile]) <= {f.kind for f in pinned.faults}:
        # a kind's draws never depend on the profile, so a profile's schedule is the file's sites of its kinds
        return FaultSchedule(seed, profile, tuple(f for f in pinned.faults if f.kind in PROFILES[profile]))
    faults = []
    for kind in PROFILES[profile]:
        rng = random.Random(f"{seed}:fault:{kind}")
        site, heal = KINDS[kind]
        active = True if force_active else rng.random() < 0.5
        probability = round(rng.uniform(0.5, 1.0), 3)
        params: dict[str, Any] = {"block": rng.randrange(0, 6)}
        if kind == "pool_restart":
            params = {"after_requests": rng.randrange(1, 3)}
        elif kind == "stream_delay":
            params = {"store_delay_ms": rng.randrange(2000, 3001, 100), "load_delay_ms": rng.randrange(500, 1501, 100)}
        faults.append(FaultSpec(kind, site, heal, active, probability, params))
    return FaultSchedule(seed, profile, tuple(faults))
