"""Page integrity: `page_digest(buf)` is the 128-bit XXH3 of a page's bytes.

Taken by the publisher, re-taken by the daemon before commit (a page whose bytes do
not match is never made visible), and re-taken by the loader after its copy (a
mismatch is MissCause.CORRUPT and the block is recomputed).
"""

from __future__ import annotations

import xxhash

DIGEST_BYTES = 16


def page_digest(buf) -> bytes:  # noqa: ANN001 - any object exporting the buffer protocol
    return xxhash.xxh3_128_digest(buf)
