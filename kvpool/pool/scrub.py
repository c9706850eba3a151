"""The pool daemon's scrub at rest (mixed into kvpool.pool.daemon.PoolDaemon).

  Scrubber._scrub          the scrub's loop: a round per interval and tenant segment.
  Scrubber._scrub_targets  a round's pages of the pass at rest (the catalog's cursor).
  Scrubber._scrub_pages    hash a round's pages on the scrub's thread, count and drop.

Contracts:
  * The scrub, at rest, on a thread of its own, one round per `scrub_interval_s` per
    tenant segment: first up to `scrub_pages_per_round` commits taken on trust and not
    yet scrubbed (the fresh queue: at most one entry per page of the segment, an evicted
    page's entry removed with it), then the next `scrub_rest_pages_per_round` committed
    pages of a cyclic cursor over the page ids (every page of every digest kind, O(1)
    memory; by default `scrub_rest_bytes_per_s`, 8 MiB/s, worth of pages a round, at least
    one). With the defaults, at 64 KiB pages: 320 fresh pages/s, and 6 pages a round at
    rest, 120 pages/s: a page corrupted at rest is found within one cycle, num_pages / 120
    s (34 s for 4,096 pages); at 512 KiB pages, 1 page a round, 20 pages/s. A page whose
    bytes no longer match its digest is dropped (Catalog.discard). Stats: `scrub_queued`
    (fresh entries, at most `scrub_queue_bound`, the segment's pages), `scrubbed_pages`,
    `scrub_corrupt`, `scrub_gone` (freed before their turn), `scrub_cycles`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from concurrent.futures import ThreadPoolExecutor

from kvpool.pool.config import PoolConfig
from kvpool.pool.digest import page_digest
from kvpool.pool.state import TenantPool

log = logging.getLogger("kvpool.pool.daemon")  # the daemon's logger, whichever of its modules logs


class Scrubber:
    """The scrub of PoolDaemon; of the daemon it uses its config, tenant pools, loop and the
    scrub's thread (started and stopped by PoolDaemon.serve)."""

    config: PoolConfig
    pools: dict[str, TenantPool]
    _loop: asyncio.AbstractEventLoop | None
    _scrub_executor: ThreadPoolExecutor

    async def _scrub(self) -> None:
        """Re-take the digest of committed pages at rest, one round per interval and tenant
        segment: the fresh commits taken on trust first, then the cyclic pass over every
        committed page. A page that no longer holds that commit is skipped (`scrub_gone`);
        one whose bytes do not match is dropped from the pool (`scrub_corrupt`; a loader
        holding it re-checks it itself, and its page is freed at the release)."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.scrub_interval_s)
            for tp in self.pools.values():
                fresh = tp.catalog.scrub_fresh(cfg.scrub_pages_per_round)
                await self._scrub_pages(tp, fresh + self._scrub_targets(tp), len(fresh))

    def _scrub_targets(self, tp: TenantPool) -> list[tuple[int, int]]:
        """This round's pages of the pass at rest."""
        return tp.catalog.scrub_cycle(self.config.scrub_rest_pages())

    async def _scrub_pages(self, tp: TenantPool, targets: list[tuple[int, int]], fresh: int) -> None:
        """Hash `targets` (page, generation) in one trip to the scrub's thread; the first
        `fresh` of them leave the fresh queue once their outcome is counted."""
        cat = tp.catalog
        jobs = []
        for page, gen in targets:
            kind = cat.committed_as(page, gen)
            if kind is not None:
                jobs.append((page, gen, kind, cat.digest[page].tobytes(), tp.arena.page(page, int(cat.length[page]))))
        if jobs:
            got = await self._loop.run_in_executor(
                self._scrub_executor, lambda: [page_digest(view, kind) for _, _, kind, _, view in jobs])
        else:
            got = []
        hashed = {(page, gen): (kind, want, digest) for (page, gen, kind, want, _), digest in zip(jobs, got)}
        for i, (page, gen) in enumerate(targets):
            found = hashed.get((page, gen))
            if found is None or cat.committed_as(page, gen) is None:  # freed or reused (maybe while hashed)
                tp.scrubbed["scrub_gone"] += 1
            elif hmac.compare_digest(found[2], found[1]):
                tp.scrubbed["scrubbed_pages"] += 1
            else:
                cat.discard(page, gen)
                tp.scrubbed["scrub_corrupt"] += 1
                log.warning("kvgate pool %s: tenant %s page %d (generation %d) no longer matches its %s digest at "
                            "rest: dropped", self.config.name, tp.tenant, page, gen, found[0].value)
            if i < fresh:
                cat.scrubbed(page, gen)

