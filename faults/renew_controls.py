"""Known-bad renewals (kvpool.pool.catalog.Catalog.renew) for suites/unit/test_renew.py and
suites/pool/test_renew.py: each breaks one rule a renewal must keep. Never the production
daemon; a daemon runs one through PoolDaemon(config, catalog_factory=...).

  OwnerBlindRenewCatalog   renews any open reservation or lease named, whoever holds it: one
                           client keeps another's pages from the reaper (the other's abandoned
                           publish never expires while someone renews its id).
  ResurrectingRenewCatalog renews a grant whose deadline has passed but which the reaper has
                           not reached yet: an expired publish comes back to life (its pages
                           were the reaper's to reclaim; a client that took the expiry as final
                           may have moved on).
  AgelessRenewCatalog      renews without the maximum age: a stuck client that keeps renewing
                           holds its pages for ever.
"""

from __future__ import annotations

from kvpool.pool.catalog import Catalog
from kvpool.pool.records import Renewal


class OwnerBlindRenewCatalog(Catalog):
    def _renew_one(self, grant, grant_id, client, now, ttl_s, max_s) -> Renewal:  # noqa: ANN001
        if grant is not None:
            client = grant.client  # whoever asks, the grant's own client asked
        return super()._renew_one(grant, grant_id, client, now, ttl_s, max_s)


class ResurrectingRenewCatalog(Catalog):
    def _renew_one(self, grant, grant_id, client, now, ttl_s, max_s) -> Renewal:  # noqa: ANN001
        if grant is not None and grant.client == client and grant.deadline <= now:
            grant.deadline = now + ttl_s  # "still working on it": taken at its word
            return Renewal(grant_id, ttl_s)
        return super()._renew_one(grant, grant_id, client, now, ttl_s, max_s)


class AgelessRenewCatalog(Catalog):
    def _renew_one(self, grant, grant_id, client, now, ttl_s, max_s) -> Renewal:  # noqa: ANN001
        return super()._renew_one(grant, grant_id, client, now, ttl_s, float("inf"))


RENEW_CATALOG_CONTROLS = {
    "owner_blind_renew": OwnerBlindRenewCatalog,
    "resurrecting_renew": ResurrectingRenewCatalog,
    "ageless_renew": AgelessRenewCatalog,
}
