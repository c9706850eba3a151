"""Which digest a GPU load checks, and over what (no GPU needed): a chunk's check-stream
work by its pages' kinds, and each page's digest taken, by its own kind, from what
arrived in GPU memory only (the GPU's sketches of the staged rows for kv-sketch-1, the
staged rows read back for xxh3-128), never from another input."""

import numpy as np
import pytest

pytest.importorskip("torch")
from kvpool.pool.digest import DigestKind, page_digest, page_sketch, sketch_digest, sketch_rows  # noqa: E402
from kvpool.gpu.sketch import SKETCH_COLS  # noqa: E402
from kvpool.errors import InvalidRequest  # noqa: E402
from kvpool.gpu.load import arrived_digests, check_plan  # noqa: E402

X, S = DigestKind.XXH3, DigestKind.SKETCH
PB = 40_000  # not a whole number of sketch rows: the last row is zero-padded


def _arrived(rng, kinds):  # noqa: ANN001, ANN202
    pages = rng.integers(0, 256, (len(kinds), PB), dtype=np.uint8)
    sketches = np.stack([page_sketch(p) for p in pages])  # the host reference of what the GPU computes
    readback = np.zeros((len(kinds), PB + 64), dtype=np.uint8)  # a wider pinned row: only PB bytes count
    readback[:, :PB] = pages
    return pages, sketches, readback


@pytest.mark.parametrize("kinds,plan", [([], (False, False)), ([S, S], (True, False)), ([X], (False, True)),
                                        ([X, S, X], (True, True))])
def test_check_plan_by_kind(kinds, plan):
    assert check_plan(kinds) == plan


def test_each_page_is_digested_by_its_kind_from_what_arrived(test_seed):
    rng = np.random.default_rng(test_seed)
    kinds = [X, S, S, X, S, X]
    pages, sketches, readback = _arrived(rng, kinds)
    got = arrived_digests(kinds, sketches, readback, PB)
    assert got == [page_digest(p, k) for p, k in zip(pages, kinds)]
    # an xxh3-128 page's digest comes from its read-back row alone, a kv-sketch-1 page's
    # from its sketch alone: changing the other input changes nothing
    other_sk, other_rb = sketches.copy(), readback.copy()
    for i, k in enumerate(kinds):
        if k is X:
            other_sk[i] += 1
        else:
            other_rb[i, : PB] ^= 0xFF
    assert arrived_digests(kinds, other_sk, other_rb, PB) == got
    # and a byte that arrived changed changes that page's digest, whichever its kind
    for i, k in enumerate(kinds):
        changed = pages[i].copy()
        changed[int(rng.integers(PB))] ^= 0x01
        rb, sk = readback.copy(), sketches.copy()
        rb[i, :PB], sk[i] = changed, page_sketch(changed)
        again = arrived_digests(kinds, sk, rb, PB)
        assert again[i] != got[i] and again[:i] + again[i + 1 :] == got[:i] + got[i + 1 :], (i, k)


def test_a_kind_without_its_arrived_input_is_refused(test_seed):
    rng = np.random.default_rng(test_seed)
    _, sketches, readback = _arrived(rng, [X, S])
    with pytest.raises(InvalidRequest):
        arrived_digests([X, S], sketches, None, PB)
    with pytest.raises(InvalidRequest):
        arrived_digests([X, S], None, readback, PB)
    with pytest.raises(InvalidRequest):
        arrived_digests([X], None, readback[:, : PB - 1], PB)
    assert arrived_digests([S], sketches[1:], None, PB) == [page_digest(readback[1, :PB], S)]


def test_every_page_sketched_takes_the_rows_in_place_and_agrees_with_the_general_way():
    """All pages kv-sketch-1 (the tier's case): the digests come from rows 0..n-1 of the
    sketches (a view), equal to those of the mixed path's per-kind selection."""
    from kvpool.pool.records import Hits

    rng = np.random.default_rng(7)
    n, page_bytes = 9, 4096
    rows = sketch_rows(page_bytes)
    sketches = rng.integers(-(2**31), 2**31 - 1, (n + 3, rows, SKETCH_COLS), dtype=np.int64).astype(np.int32)
    readback = rng.integers(0, 256, (n + 3, page_bytes), dtype=np.uint8)
    want = [sketch_digest(sketches[i].astype("<i4").tobytes(), page_bytes) for i in range(n)]
    assert arrived_digests([DigestKind.SKETCH] * n, sketches, None, page_bytes) == want
    mixed = [DigestKind.SKETCH] * (n - 1) + [DigestKind.XXH3]
    got = arrived_digests(mixed, sketches, readback, page_bytes)
    assert got[:-1] == want[:-1] and got[-1] == page_digest(readback[n - 1], DigestKind.XXH3)
    hits = Hits(list(range(3)), [1] * 3, [page_bytes] * 3, b"\0" * 48, bytes([DigestKind.SKETCH.code] * 3))
    assert hits.kind_list() == [DigestKind.SKETCH] * 3 == [hits.kind(i) for i in range(3)]
    mixed_hits = Hits(list(range(3)), [1] * 3, [page_bytes] * 3, b"\0" * 48,
                      bytes([DigestKind.SKETCH.code, DigestKind.XXH3.code, DigestKind.SKETCH.code]))
    assert mixed_hits.kind_list() == [mixed_hits.kind(i) for i in range(3)]
    assert Hits(list(range(2)), [1] * 2, [page_bytes] * 2, b"\0" * 32).kind_list() == [DigestKind.XXH3] * 2
