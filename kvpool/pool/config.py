"""The pool daemon's configuration (kvpool.pool.daemon).

  PoolConfig          frozen: geometry, addresses, tenants and their quotas, limits, the
                      scrub's rates, the pre-hello bounds, the admins.
  default_run_dir     $XDG_RUNTIME_DIR/NAME, else /tmp/kvgate-$UID/NAME.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from kvpool.errors import InvalidRequest
from kvpool.pool import protocol as P
from kvpool.pool.catalog import AdmissionPolicy, LoadLimits


def default_run_dir(name: str) -> Path:
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvgate-{os.getuid()}")
    return base / name


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    name: str = "kvgate-pool"  # shared-memory segment name and run-dir name
    page_size: int = 64 * 1024
    num_pages: int = 4096
    run_dir: Path | None = None  # pid file, Unix socket, address.json
    unix_socket: bool = True
    tcp_host: str | None = "127.0.0.1"
    tcp_port: int = 0  # 0: pick a free port (written to address.json)
    tenants: Mapping[str, str] = dataclasses.field(default_factory=dict)  # tenant -> token
    # The largest frame after a hello, either way (requests and replies); 0: derived from the
    # page size, kvpool.pool.protocol.frame_limit (16 pages and 4 MiB for everything else).
    max_frame: int = 0
    max_clients: int = 256
    max_queue: int = 64
    io_threads: int = 2
    admission: AdmissionPolicy = AdmissionPolicy()
    limits: LoadLimits = LoadLimits()
    # A reservation (lease) not committed (released) by its TTL is reclaimed by the reaper,
    # unless its client renews it (Renew; the hello advertises both TTLs); renewals never take
    # it past its grant + reservation_max_s (lease_max_s).
    reservation_ttl_s: float = 30.0
    lease_ttl_s: float = 60.0
    reservation_max_s: float = 3600.0
    lease_max_s: float = 3600.0
    reap_interval_s: float = 0.5
    # The heartbeat in each tenant's private segment (kvpool.pool.arena): same-host clients trust a probe of
    # the segment's index only while it is fresh, so a stopped daemon is noticed within a
    # few beats without a round trip. 0: no heartbeat (clients then always ask the daemon).
    heartbeat_s: float = 0.02
    # "HOST:PORT" of a Prometheus HTTP endpoint (GET /metrics) serving the pool's metrics,
    # pool-wide (an operator's scrape, not a tenant's); port 0 picks one, written to
    # address.json as "metrics". Empty: none (admins still read them over the socket).
    metrics_addr: str = ""
    max_lookup_wait_s: float = 2.0  # cap on a lookup's wait for a pending publish (Lookup.wait_pending_ms)
    # The scrub at rest, on its own thread (never in the requests' way), one round per interval
    # and tenant segment: at most `scrub_pages_per_round` commits taken on trust and not yet
    # scrubbed (the fresh queue, at most one entry per page: 320 pages/s by default), then the
    # next committed pages of the cyclic pass over every page: `scrub_rest_pages_per_round`
    # (0: no pass at rest), or by default `scrub_rest_bytes_per_s` worth of pages a round, at
    # least one (8 MiB/s: xxh3-128 costs well under 1% of a core at that rate, kv-sketch-1's
    # host reference some 7-25%).
    scrub_interval_s: float = 0.05
    scrub_pages_per_round: int = 16
    scrub_rest_pages_per_round: int | None = None
    scrub_rest_bytes_per_s: int = 8 * 1024 * 1024
    # Re-hash xxh3-128 pages before they become visible (False: trust them as kv-sketch-1
    # pages are trusted, and scrub them at rest; every loader verifies every page anyway).
    verify_commits: bool = True
    # Before a successful hello a connection costs the daemon little and not for long:
    hello_timeout_s: float = 5.0  # it is closed (after a typed error) if no hello succeeds by then
    max_hello_frame: int = 4096  # its largest frame: a bigger length prefix is refused before any byte of it
    max_unauthenticated: int = 64  # connections awaiting their hello, at most; past it the oldest is closed
    # Tenants allowed the pool-wide operations (capacity, pool-wide stats and metrics); none
    # named: the only tenant of a single-tenant pool, and nobody in a pool of several.
    admins: frozenset[str] = frozenset()
    # Pages of each tenant's own segment; the tenants not named share the rest of num_pages.
    quotas: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def frame_limit(self) -> int:
        """The largest frame after a hello (bytes, without its length prefix)."""
        return self.max_frame or P.frame_limit(self.page_size)

    def is_admin(self, tenant: str) -> bool:
        if self.admins:
            return tenant in self.admins
        return len(self.tenants) == 1 and tenant in self.tenants

    def tenant_pages(self) -> dict[str, int]:
        """The pages of each tenant's segment (InvalidRequest for quotas that do not fit)."""
        unknown = sorted(set(self.quotas) - set(self.tenants))
        if unknown:
            raise InvalidRequest(f"quotas name tenants the pool does not have: {unknown}")
        bad = {t: q for t, q in self.quotas.items() if not isinstance(q, int) or q <= 0}
        if bad:
            raise InvalidRequest(f"quotas must be positive page counts: {bad}")
        others = [t for t in self.tenants if t not in self.quotas]
        rest = self.num_pages - sum(self.quotas.values())
        share = rest // len(others) if others else 0
        if others and share < 1:
            raise InvalidRequest(f"{self.num_pages} pages leave {rest} for the {len(others)} tenants without a "
                                 f"quota: less than one page each")
        return {t: self.quotas.get(t, share) for t in self.tenants}

    def scrub_rest_pages(self) -> int:
        """Pages of the scrub's pass at rest per round and tenant segment."""
        if self.scrub_rest_pages_per_round is not None:
            return self.scrub_rest_pages_per_round
        return max(1, round(self.scrub_rest_bytes_per_s * self.scrub_interval_s / self.page_size))

    def resolved_run_dir(self) -> Path:
        return self.run_dir if self.run_dir is not None else default_run_dir(self.name)
