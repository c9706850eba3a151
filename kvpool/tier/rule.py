"""When to read the network tier, and when recomputing is faster: the scheduler's rule.

A remote block pays only if it arrives before the replica could have computed it. The
worker bounds each tier load by a deadline (`tier_deadline_s`: past it the rest of the
run is reported failed and recomputed, so a slow tier costs at most the deadline); the
scheduler uses what the worker measured to claim only what arrives in time, and stops
asking a tier that fails.

  TierRule(deadline_s, backoff_s, backoff_max_s)
    .claim(n, now) -> (blocks, why)
                    how many of the n blocks the tier holds to read: all of them while
                    nothing is measured; at most rate x deadline_s; none while the tier is
                    held off; after a hold, one block (a probe, one at a time) measures it
                    again. `why` names the limit that applied (None: none did).
    .allow_lookup(now) -> str | None
                    None when the tier may be asked at all; else why not (held off). A
                    lookup skips the tier's round trip, as a partitioned tier would make it
                    wait for its timeout.
    .observe(TierLoadStat, now)
                    a finished tier load: its rate joins the estimate (an exponentially
                    weighted mean); a load that failed, timed out, or whose rate cannot fill
                    one block within the deadline, holds the tier off for the backoff
                    (doubled while it keeps failing, up to the maximum); a good one resets it.
    .fail(now, why) a lookup that could not reach the tier: held off.
    .forget() -> why | None
                    drop any hold (what a rule that never learns would do; a negative control).
  TierLoadStat      one tier load as the worker saw it: blocks wanted and loaded, seconds,
                    miss cause. The worker reports them through vLLM's KV-connector stats
                    (kvpool.connector.stats.KVPoolStats), which the engine hands to the scheduler's
                    update_connector_output; vLLM's own connector-stats channel, so it works
                    when scheduler and worker are different processes.
"""

from __future__ import annotations

import dataclasses
import math
import threading

from kvpool.errors import MissCause

_FAILS = {MissCause.TIMEOUT.value, MissCause.TRANSPORT_ERROR.value}


@dataclasses.dataclass(frozen=True)
class TierLoadStat:
    wanted: int
    loaded: int
    seconds: float
    cause: str | None = None  # the miss cause that ended it early, if any

    def as_list(self) -> list:
        return [self.wanted, self.loaded, round(self.seconds, 6), self.cause]

    @classmethod
    def of(cls, item: list | tuple) -> TierLoadStat:
        wanted, loaded, seconds, cause = item
        return cls(int(wanted), int(loaded), float(seconds), cause)


class TierRule:
    def __init__(self, deadline_s: float, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 weight: float = 0.3) -> None:
        if deadline_s <= 0:
            raise ValueError(f"tier_deadline_s must be positive, got {deadline_s}")
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.weight = weight
        self.rate: float | None = None  # blocks per second of recent tier loads
        self.held_until = 0.0
        self.held_why = ""
        self._backoff = backoff_s
        self._probe_since: float | None = None  # a probe's claim, until its load is observed
        self._after_hold = False
        self._lock = threading.Lock()

    def _hold(self, now: float, why: str) -> None:
        self.held_until = now + self._backoff
        self.held_why = why
        self._backoff = min(2 * self._backoff, self.backoff_max_s)
        self._after_hold = True

    def allow_lookup(self, now: float) -> str | None:
        with self._lock:
            if now < self.held_until:
                return f"held off {self.held_until - now:.2f} s more: {self.held_why}"
            return None

    def claim(self, n: int, now: float) -> tuple[int, str | None]:
        with self._lock:
            if n <= 0:
                return 0, None
            if now < self.held_until:
                return 0, f"held off {self.held_until - now:.2f} s more: {self.held_why}"
            if self._after_hold:  # measure again with one block before trusting it with more
                if self._probe_since is not None and now - self._probe_since < 2 * self.deadline_s:
                    return 0, "a probe of the tier is in flight"
                self._probe_since = now
                return 1, "probe after a hold" if n > 1 else None
            if self.rate is None:
                return n, None
            cap = math.floor(self.rate * self.deadline_s)
            if cap < n:
                return cap, f"rate {self.rate:.1f} blocks/s x deadline {self.deadline_s} s"
            return n, None

    def observe(self, stat: TierLoadStat, now: float) -> None:
        with self._lock:
            self._probe_since = None
            if stat.loaded > 0 and stat.seconds > 0:
                r = stat.loaded / stat.seconds
                self.rate = r if self.rate is None else (1 - self.weight) * self.rate + self.weight * r
            if stat.cause in _FAILS:
                self._hold(now, f"a tier load ended on {stat.cause} after {stat.seconds:.2f} s")
            elif self.rate is not None and self.rate * self.deadline_s < 1:
                self._hold(now, f"rate {self.rate:.2f} blocks/s fills no block within {self.deadline_s} s")
            elif stat.loaded > 0:
                self._backoff = self.backoff_s
                self._after_hold = False

    def fail(self, now: float, why: str) -> None:
        with self._lock:
            self._hold(now, why)

    def forget(self) -> str | None:
        """Drop any hold and the probe after it (the rate estimate and backoff stay); returns
        why the tier was held, or None if it was not."""
        with self._lock:
            if not (self.held_until or self._after_hold):
                return None
            why = self.held_why
            self.held_until, self._after_hold, self._probe_since = 0.0, False, None
            return why
