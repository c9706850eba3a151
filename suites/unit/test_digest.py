"""kv-sketch-1 (kvpool.pool.digest): the GPU's implementation (kvpool.gpu.sketch, run here on the
CPU through the same torch calls) equals the host reference, padding included, and the
digest sees every changed byte, its position and the page length."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.pool.digest import KINDS, SKETCH_ROW, DigestKind, page_digest, page_sketch, sketch_key, sketch_rows

torch = pytest.importorskip("torch")

from kvpool.gpu.sketch import Sketcher, digests, staged_width  # noqa: E402


def test_the_key_is_fixed_and_read_only():
    key = sketch_key()
    assert key.shape == (SKETCH_ROW, 16) and key.dtype == np.int8 and not key.flags.writeable
    assert int(key.astype(np.int64).sum()) == int(sketch_key().astype(np.int64).sum())
    assert {int(key.min()), int(key.max())} == {-128, 127}


def test_kinds_round_trip_through_their_codes():
    assert [k.code for k in KINDS] == [0, 1]
    assert DigestKind.XXH3.verified_at_commit and not DigestKind.SKETCH.verified_at_commit


@pytest.mark.parametrize("nbytes", [1, 100, SKETCH_ROW - 1, SKETCH_ROW, SKETCH_ROW + 1, 3 * SKETCH_ROW, 70_000])
def test_the_torch_sketch_of_a_staged_page_equals_the_host_reference(nbytes, test_seed):
    rng = np.random.default_rng(test_seed)
    pages = rng.integers(0, 256, (3, nbytes), dtype=np.uint8)
    width = staged_width(nbytes)
    assert width % SKETCH_ROW == 0 and width - nbytes < SKETCH_ROW
    stage = np.zeros((3, width), dtype=np.uint8)
    stage[:, :nbytes] = pages
    sk = Sketcher(torch.device("cpu"))
    out = sk.sketch(torch.from_numpy(stage).view(-1, SKETCH_ROW)).numpy().reshape(3, sketch_rows(nbytes), 16)
    for i in range(3):
        assert np.array_equal(out[i], page_sketch(pages[i]))
    assert digests(out, nbytes) == [page_digest(p, DigestKind.SKETCH) for p in pages]


def test_both_torch_products_agree_at_the_largest_sums():
    """All bytes -128 against the key: the largest sums the rows can reach stay exact, on every
    implementation that runs here (the Triton kernel's are suites/unit/test_sketch_kernel.py's)."""
    rows = torch.full((20, SKETCH_ROW), 0x80, dtype=torch.uint8)
    want = page_sketch(rows.numpy())
    sk = Sketcher(torch.device("cpu"))
    assert np.array_equal(sk.sketch(rows).numpy(), want)
    for impl in ("int8-mm", "float64-mm"):
        assert np.array_equal(Sketcher(torch.device("cpu"), impl).sketch(rows).numpy(), want), impl
    assert int(np.abs(want).max()) <= SKETCH_ROW * 128 * 128


def test_an_unknown_or_unusable_implementation_is_refused():
    with pytest.raises(ValueError, match="unknown kv-sketch-1 implementation"):
        Sketcher(torch.device("cpu"), "fast")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="triton-dot: needs a CUDA device"):
            Sketcher(torch.device("cpu"), "triton-dot")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3 * SKETCH_ROW), st.data())
def test_any_changed_byte_changes_the_digest(nbytes, data):
    rng = np.random.default_rng(nbytes)
    page = rng.integers(0, 256, nbytes, dtype=np.uint8)
    at = data.draw(st.integers(0, nbytes - 1))
    flip = data.draw(st.integers(1, 255))
    other = page.copy()
    other[at] ^= flip
    assert page_digest(page, DigestKind.SKETCH) != page_digest(other, DigestKind.SKETCH)


def test_swapped_rows_and_zero_padding_are_told_apart(test_seed):
    rng = np.random.default_rng(test_seed)
    page = rng.integers(0, 256, 2 * SKETCH_ROW, dtype=np.uint8)
    swapped = np.concatenate([page[SKETCH_ROW:], page[:SKETCH_ROW]])
    assert page_digest(page, DigestKind.SKETCH) != page_digest(swapped, DigestKind.SKETCH)
    short = page[: SKETCH_ROW + 10].copy()
    short[-10:] = 0
    padded = np.concatenate([short, np.zeros(5, np.uint8)])  # same sketch rows, other length
    assert np.array_equal(page_sketch(short), page_sketch(padded))
    assert page_digest(short, DigestKind.SKETCH) != page_digest(padded, DigestKind.SKETCH)


def _page(nbytes: int = 70_000) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)


def test_both_digests_are_pinned_over_any_buffer_of_the_same_bytes():
    """The pool hands the digests memoryviews of its segment, the loader bytes or arrays of
    any shape and dtype: the digest is of the bytes, whatever holds them (pinned values: a
    change is a new digest kind)."""
    page = _page()
    want = {DigestKind.XXH3: "0e0bad1241362092681e0ea2d6b6f11f", DigestKind.SKETCH: "da464a1623dd2fac1f9d14c8724fefc6"}
    for kind, hexdigest in want.items():
        for buf in (page, page.tobytes(), bytearray(page.tobytes()), memoryview(page.tobytes()),
                    page.view(np.int16).reshape(50, -1), page.view(np.int8)):
            assert page_digest(buf, kind).hex() == hexdigest, (kind, type(buf))


def test_the_sketch_is_int32_rows_the_same_over_any_buffer_and_any_step():
    page = _page(5 * SKETCH_ROW + 124)
    ref = page_sketch(page)
    assert ref.dtype == np.int32 and ref.shape == (6, 16)
    for buf in (page.tobytes(), memoryview(page.tobytes()), page.view(np.uint16).reshape(-1, 2)):
        assert np.array_equal(page_sketch(buf), ref)
    pages = [np.random.default_rng(seed).integers(0, 256, 5 * SKETCH_ROW + 124, dtype=np.uint8) for seed in range(4)]
    refs = [page_sketch(p) for p in pages]
    for step in (1, 2, 4):  # full rows taken a few at a time: the same rows (each page's own, not the last's)
        for p, r in zip(pages, refs):
            assert np.array_equal(page_sketch(p, rows_per_step=step), r)


def test_a_strided_or_odd_length_page_is_digested_as_its_bytes_in_order():
    page = _page(2 * 70_001)
    strided = page[::2]  # not contiguous: the sketch reads its elements in order
    assert np.array_equal(page_sketch(strided), page_sketch(strided.tobytes()))
    assert page_digest(strided, DigestKind.SKETCH) == page_digest(strided.tobytes(), DigestKind.SKETCH)
    odd = page[:70_001].tobytes()  # no whole number of any wider element
    assert page_digest(odd, DigestKind.SKETCH) == page_digest(np.frombuffer(odd, dtype=np.uint8), DigestKind.SKETCH)
