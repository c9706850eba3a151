"""What the pool daemon keeps per connection and per tenant (kvpool.pool.daemon).

  Session      one connection: its client id, peer, tenant once its hello succeeded, and
               whether a lookup of it is parked on a pending publish.
  TenantPool   one tenant's part of the daemon: its arena segment, its catalog, the lookups
               parked on its reservations, its lease start times, its wait, scrub and
               report counters.
"""

from __future__ import annotations

import asyncio
import dataclasses

from kvpool.pool.arena import Arena
from kvpool.pool.catalog import Catalog


@dataclasses.dataclass
class Session:
    client: int
    peer: str
    tenant: str | None = None
    name: str = ""
    waiting: bool = False  # a lookup of this session is parked on a pending publish


@dataclasses.dataclass
class TenantPool:
    """One tenant's part of the daemon: its segment, its catalog, what waits on them."""

    tenant: str
    arena: Arena
    catalog: Catalog
    # reservation id -> futures of the lookups parked on it, resolved when it closes
    parked: dict[int, list[asyncio.Future]] = dataclasses.field(default_factory=dict)
    lease_started: dict[int, float] = dataclasses.field(default_factory=dict)
    waits: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"lookup_waits": 0, "lookup_wait_us": 0, "lookup_waiting": 0})
    # the scrub's and the loaders' reports' outcomes (the queue and cursor are the catalog's)
    scrubbed: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"scrubbed_pages": 0, "scrub_corrupt": 0, "scrub_gone": 0,
                                 "report_dropped": 0, "report_intact": 0})
