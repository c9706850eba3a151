"""Negative controls for corruption at rest: known-bad loaders, daemons and catalogs that
keep a corrupt page in the pool, or let the scrub's state grow with the churn. Each is
today's behaviour of one part, or one deliberate defect of it; the suites run each and
assert that the oracle it validates catches it (suites/pool/test_corrupt_at_rest.py).

  SilentLoader(backend)     a loader that finds a page corrupt and tells nobody: the
                            backend without report_corrupt (kvpool.client.transfer.load then has
                            nobody to tell). The corrupt page stays, and every request
                            over it loads it again.
  DeafDaemon                a daemon that answers every report "intact" without looking
                            at the page: the corrupt page stays.
  XxhBlindScrubDaemon       a scrub whose pass at rest skips the pages the daemon re-hashed
                            at commit (xxh3-128): a page corrupted at rest after its commit
                            is never found.
  HoardingCatalog           the scrub's fresh queue as a queue of (page, generation), one
                            entry per trusted commit, an evicted page's entry kept until
                            its turn: it grows with the churn, not with the pool.
"""

from __future__ import annotations

import collections

from kvpool.pool import protocol as P
from kvpool.pool.catalog import Catalog
from kvpool.pool.records import CorruptOutcome
from kvpool.pool.daemon import PoolDaemon


class SilentLoader:
    """Everything of the wrapped backend except report_corrupt."""

    def __init__(self, inner):  # noqa: ANN001 - a kvpool.client.backend.PoolBackend
        self.inner = inner

    @property
    def page_size(self) -> int:
        return self.inner.page_size

    def __getattr__(self, name: str):  # noqa: ANN204
        if name == "report_corrupt":
            raise AttributeError(name)  # the loader that never reports
        return getattr(self.inner, name)


class DeafDaemon(PoolDaemon):
    async def report_corrupt(self, session, op: P.ReportCorrupt) -> P.ReportOk:  # noqa: ANN001
        self._own_lease(session, op.lease_id)
        return P.ReportOk([CorruptOutcome.INTACT] * len(op.indexes))


class XxhBlindScrubDaemon(PoolDaemon):
    def _scrub_targets(self, tp) -> list[tuple[int, int]]:  # noqa: ANN001
        cat = tp.catalog
        return [(p, g) for p, g in super()._scrub_targets(tp)
                if (kind := cat.committed_as(p, g)) is not None and not kind.verified_at_commit]


class _Hoard(collections.OrderedDict):
    """Keyed by (page, generation) under the page-keyed interface: a page's new commit adds
    an entry instead of replacing its old one, and freeing the page removes nothing."""

    def __setitem__(self, page: int, gen: int) -> None:
        super().__setitem__((page, gen), gen)

    def pop(self, page: int, default=None):  # noqa: ANN001, ANN201 - a freed page's entries stay
        return default

    def items(self):  # noqa: ANN201
        return ((page, gen) for (page, gen) in super().keys())

    def get(self, page: int, default=None):  # noqa: ANN001, ANN201
        return default


class HoardingCatalog(Catalog):
    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._unscrubbed = _Hoard()

    def scrubbed(self, page: int, generation: int) -> None:
        collections.OrderedDict.pop(self._unscrubbed, (page, generation), None)
