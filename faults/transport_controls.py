"""Negative controls for the transport faults (kvgate.faults.proxy): known-bad loaders the
suites must catch, as kvgate.faults.controls holds the known-bad catalogs.

  TrustingLoader   kvpool.client.transfer.load without its one safeguard: the bytes a lease's
                   pages arrive with are installed and counted as loaded without being
                   compared with the digest taken at publish. Under the proxy's bitflip
                   it installs a corrupted page as good; a byte-exact check must see it.
  digest_of_the_page()
                   a context in which kvpool.client.transfer.publish takes its digests over
                   the reserved page after the copy instead of over the producer's bytes (its
                   defect before): a write into the page by another client of the tenant
                   between the copy and the hash is then vouched for, the daemon's
                   re-verification passes it, and a loader installs it as good.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from kvpool.client import transfer

from kvpool.client.backend import Destination, LoadResult, PoolBackend
from kvpool.pool.copy import as_segments, copy_digest, total_size
from kvpool.errors import InvalidRequest
from kvpool.pool.keys import Namespace


class TrustingLoader:
    """A loader that believes the wire. Do not use outside negative controls."""

    def load(self, backend: PoolBackend, ns: Namespace, hashes: Sequence[bytes], dest: Destination) -> LoadResult:
        lease = backend.acquire(ns, hashes)
        loaded = 0
        try:
            for i, ref in enumerate(lease.hits):
                target = as_segments(dest(i))
                if total_size(target) != ref.length:
                    raise InvalidRequest(f"block {i}: destination of {total_size(target)} bytes for a page of {ref.length}")
                copy_digest(as_segments(backend.read_page(lease, i)), target)  # the defect: digest unused
                loaded += 1
        finally:
            if lease.lease_id:
                backend.release(lease.lease_id)
        return LoadResult(len(hashes), loaded, lease.miss, 0.0)


@contextlib.contextmanager
def digest_of_the_page() -> Iterator[None]:
    before = transfer.PUBLISH_DIGEST_OF
    transfer.PUBLISH_DIGEST_OF = "dst"
    try:
        yield
    finally:
        transfer.PUBLISH_DIGEST_OF = before
