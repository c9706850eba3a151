"""Page integrity: every committed page carries a 128-bit digest of its bytes, of one of
two kinds, recorded with the page.

  xxh3-128     XXH3-128 of the page bytes (`xxhash`). Taken by a host publisher while it
               copies (kvpool.pool.copy.copy_digest), re-taken by the daemon before commit (a
               page whose bytes do not match is never made visible), and re-taken by the
               loader after its copy (a mismatch is MissCause.CORRUPT, the block is
               recomputed).
  kv-sketch-1  XXH3-128 (seeded with the page length) of an integer linear sketch of the
               page: the page, zero-padded to rows of SKETCH_ROW bytes read as int8,
               times a fixed int8 key matrix of SKETCH_ROW x SKETCH_COLS, in exact integer
               arithmetic (every sum is below 2^28), as int32 little-endian. A GPU computes
               the sketch on its tensor cores over the KV it is about to copy or has just
               copied (kvpool.gpu.transfer), so the host reads 1/256 of the bytes instead
               of all of them; the daemon trusts the writer's digest at commit and scrubs
               the page at rest in the background (`page_digest` here, the host reference);
               the loader re-takes it over the bytes it installed.

Why a linear sketch: for two different pages, some row differs by a non-zero vector e;
each key column c is independent and uniform over int8, so e.c = 0 for at most one of
the 256 values of the key entry under a non-zero e_i: the sketches collide with
probability at most 256^-16 = 2^-128 over the key, and XXH3-128 over differing sketches
collides like XXH3-128. The key is fixed (from SKETCH_SEED), as a CRC's polynomial is:
this detects corruption by faults and bugs, it is no MAC.
"""

from __future__ import annotations

import enum
import functools

import numpy as np
import xxhash

DIGEST_BYTES = 16
SKETCH_ROW = 16384  # bytes per sketch row: |sum| <= 16384 * 128 * 128 = 2^28, exact in int32 and float64
SKETCH_COLS = 16  # int32 outputs per row: 64 bytes per 16 KiB row (1/256 of the page)
SKETCH_SEED = 0x6B76_7367_6B31  # fixes the key matrix; changing it is a new kind


class DigestKind(enum.StrEnum):
    XXH3 = "xxh3-128"
    SKETCH = "kv-sketch-1"

    @property
    def code(self) -> int:
        """Its byte in the catalog and in Hits.kinds."""
        return KINDS.index(self)

    @property
    def verified_at_commit(self) -> bool:
        """Whether the daemon re-takes it before commit (else it trusts it and scrubs later)."""
        return self is DigestKind.XXH3


KINDS: tuple[DigestKind, ...] = (DigestKind.XXH3, DigestKind.SKETCH)


def kind_of(code: int) -> DigestKind:
    return KINDS[code]


@functools.cache
def sketch_key() -> np.ndarray:
    """The fixed int8 key matrix (SKETCH_ROW x SKETCH_COLS) of kv-sketch-1."""
    key = np.random.Generator(np.random.PCG64(SKETCH_SEED)).integers(-128, 128, (SKETCH_ROW, SKETCH_COLS),
                                                                     dtype=np.int8)
    key.flags.writeable = False
    return key


@functools.cache
def _key_f64() -> np.ndarray:
    return sketch_key().astype(np.float64)


def sketch_rows(nbytes: int) -> int:
    """Sketch rows of a page of `nbytes` (the last one zero-padded)."""
    return -(-nbytes // SKETCH_ROW)


def page_sketch(buf, rows_per_step: int = 64) -> np.ndarray:  # noqa: ANN001 - any buffer
    """The kv-sketch-1 sketch of a page on the host: int32 (rows, SKETCH_COLS). Exact:
    float64 products and sums of int8 values stay integers far below 2^53."""
    data = np.frombuffer(buf, dtype=np.int8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.int8)
    n = data.size
    rows = sketch_rows(n)
    out = np.empty((rows, SKETCH_COLS), dtype=np.int32)
    key = _key_f64()
    full = n // SKETCH_ROW
    for a in range(0, full, rows_per_step):
        b = min(full, a + rows_per_step)
        block = data[a * SKETCH_ROW : b * SKETCH_ROW].reshape(b - a, SKETCH_ROW).astype(np.float64)
        out[a:b] = block @ key
    if full < rows:
        tail = np.zeros(SKETCH_ROW, dtype=np.float64)
        tail[: n - full * SKETCH_ROW] = data[full * SKETCH_ROW :]
        out[full] = tail @ key
    return out


def sketch_digest(sketch, nbytes: int) -> bytes:  # noqa: ANN001 - the sketch's int32 bytes
    """The kv-sketch-1 digest of a page of `nbytes` from its sketch (int32 LE, row order)."""
    return xxhash.xxh3_128_digest(sketch, seed=nbytes)


def page_digest(buf, kind: DigestKind = DigestKind.XXH3) -> bytes:  # noqa: ANN001 - any buffer
    if kind is DigestKind.XXH3:
        return xxhash.xxh3_128_digest(buf)
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    return sketch_digest(page_sketch(arr).astype("<i4", copy=False).tobytes(), arr.nbytes)
