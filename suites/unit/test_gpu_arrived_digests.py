"""Which digest a GPU load checks, and over what (no GPU needed): a chunk's check-stream
work by its pages' kinds, and each page's digest taken, by its own kind, from what
arrived in GPU memory only (the GPU's sketches of the staged rows for kv-sketch-1, the
staged rows read back for xxh3-128), never from another input."""

import numpy as np
import pytest

pytest.importorskip("torch")
from kvpool.pool.digest import DigestKind, page_digest, page_sketch  # noqa: E402
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
