"""kv-sketch-1's Triton kernel (kvpool.gpu.sketch_kernel, the engine's "triton-dot") against the
host reference (kvpool.pool.digest.page_sketch), on this machine's CPU through Triton's
interpreter (TRITON_INTERPRET=1, in a process of its own: the variable is read when the kernel is
defined): exact sums over rows that fill a program and rows that do not, rows with a stride
(staging rows are padded), a given output; the Sketcher's probe takes it where it is exact and
refuses the LastTileSkipped control (kvgate.faults.sketch_controls), whose sums miss the last
tile of each row. The fused copy and sketch of a load (CopySketchKernel): the bytes of pages taken
out of order and a stride apart, in padded rows, and their sketches; malformed geometry refused. On a GPU the same probe runs at every engine's start (suites/gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json, numpy as np, torch
    from kvpool.gpu import sketch as S
    from kvpool.gpu.sketch_kernel import SketchKernel
    from kvpool.pool.digest import SKETCH_ROW, page_sketch, sketch_key

    key = torch.from_numpy(np.array(sketch_key()))
    rng = np.random.default_rng(7)
    out = {}
    for bm, m in ((16, 37), (64, 64), (64, 3)):
        rows = rng.integers(0, 256, (m, SKETCH_ROW), dtype=np.uint8)
        got = SketchKernel(bm=bm, bk=512)(torch.from_numpy(rows).view(torch.int8), key).numpy()
        out[f"bm{bm}_m{m}"] = bool(np.array_equal(got, page_sketch(rows)))
    padded = torch.from_numpy(rng.integers(0, 256, (5, SKETCH_ROW + 4096), dtype=np.uint8)).view(torch.int8)
    given = torch.full((5, 16), -1, dtype=torch.int32)
    got = SketchKernel(bm=16, bk=512)(padded[:, :SKETCH_ROW], key, given)
    out["strided_into_out"] = bool(got.data_ptr() == given.data_ptr() and np.array_equal(
        given.numpy(), page_sketch(np.ascontiguousarray(padded[:, :SKETCH_ROW].numpy()).view(np.uint8))))
    sk = S.Sketcher(torch.device("cpu"), "triton-dot")
    out["probe_took"] = sk.impl
    # the fused copy and sketch: pages out of order, 2 sketch rows each, a stride past them, padded rows
    from kvpool.gpu.sketch_kernel import CopySketchKernel
    pb, stride = 2 * SKETCH_ROW, 2 * SKETCH_ROW + 4096
    arena = torch.from_numpy(rng.integers(0, 256, 9 * stride, dtype=np.uint8)).view(torch.int8)
    order = [6, 1, 8, 0]
    width = pb + 8192
    dst = torch.zeros((4, width), dtype=torch.int8)
    sk_out = torch.full((8, 16), -3, dtype=torch.int32)
    CopySketchKernel(bm=16, bk=512)(arena, torch.tensor(order, dtype=torch.int64), stride, pb, dst.view(-1), width,
                                    key, sk_out)
    a = arena.numpy().view(np.uint8)
    src = [a[p * stride : p * stride + pb] for p in order]
    out["fused_bytes"] = all(np.array_equal(dst[i, :pb].numpy().view(np.uint8), src[i]) for i in range(4))
    out["fused_padding_untouched"] = not bool(dst[:, pb:].any())
    out["fused_sketch"] = bool(np.array_equal(sk_out.numpy(), np.concatenate([page_sketch(x) for x in src])))
    refused = []
    for bad in ({"page": SKETCH_ROW + 1}, {"stride": SKETCH_ROW}, {"width": SKETCH_ROW}):
        try:
            CopySketchKernel()(arena, torch.tensor(order, dtype=torch.int64), bad.get("stride", stride),
                               bad.get("page", pb), dst.view(-1), bad.get("width", width), key, sk_out)
            refused.append(False)
        except ValueError:
            refused.append(True)
    out["fused_refuses"] = refused
    if CONTROL:
        import kvgate.faults.sketch_controls as C
        import kvpool.gpu.sketch_kernel as K
        K.SketchKernel = C.LastTileSkipped
        rows = rng.integers(0, 256, (20, SKETCH_ROW), dtype=np.uint8)
        out["control_differs"] = not np.array_equal(
            C.LastTileSkipped(bm=16, bk=512)(torch.from_numpy(rows).view(torch.int8), key).numpy(), page_sketch(rows))
        try:
            S.Sketcher(torch.device("cpu"), "triton-dot")
            out["control_forced"] = "taken"
        except RuntimeError as exc:
            out["control_forced"] = str(exc)
        auto = S.Sketcher(torch.device("cpu"))
        out["control_auto"] = [auto.impl, auto.reason]
        class OutOfResources(Exception):  # Triton's own errors are not RuntimeErrors
            pass
        class Unbuildable(C.LastTileSkipped):
            def __call__(self, *a, **k):
                raise OutOfResources("shared memory")
        K.SketchKernel = Unbuildable
        built = S.Sketcher(torch.device("cpu"))
        out["unbuildable_auto"] = [built.impl, built.reason]
    print(json.dumps(out))
""")


def _run(control: bool) -> dict:
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", f"CONTROL = {control}\n" + SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_kernel_sums_every_row_exactly_and_the_probe_takes_it():
    out = _run(control=False)
    assert out == {"bm16_m37": True, "bm64_m64": True, "bm64_m3": True, "strided_into_out": True,
                   "probe_took": "triton-dot", "fused_bytes": True, "fused_padding_untouched": True,
                   "fused_sketch": True, "fused_refuses": [True, True, True]}


def test_a_kernel_that_skips_the_last_tile_is_refused_by_the_probe():
    out = _run(control=True)
    assert out["probe_took"] == "triton-dot"  # the real kernel, in the same process, first
    assert out["control_differs"] is True
    assert "no implementation equals the host reference" in out["control_forced"]
    assert "triton-dot: returned other values than the host reference" in out["control_forced"]
    impl, reason = out["control_auto"]
    assert impl != "triton-dot" and "triton-dot: returned other values" in reason
    impl, reason = out["unbuildable_auto"]  # a kernel that does not build: the next implementation, and why
    assert impl != "triton-dot" and "triton-dot: OutOfResources: shared memory" in reason


INSTALL_SCRIPT = textwrap.dedent("""
    import json, numpy as np, torch
    from kvpool.gpu.layout import KVLayout, block_page
    from kvpool.gpu.sketch_kernel import InstallSketchKernel, install_pieces
    from kvpool.pool.digest import SKETCH_ROW, page_sketch, sketch_key

    key = torch.from_numpy(np.array(sketch_key()))
    rng = np.random.default_rng(11)
    nb, per = 9, 2 * 9 * 16 * 4 * 32
    # four layers in one allocation, a gap after the second: blocks on dim 1, so each block of a
    # layer is two runs (K and V) far apart, the way vLLM's FlashAttention layout lies
    store = torch.from_numpy(rng.integers(-9000, 9000, 4 * per + 128, dtype=np.int16)).view(torch.bfloat16)
    starts = [0, per, 2 * per + 64, 3 * per + 64]
    layers = [store[a : a + per].view(2, nb, 16, 4, 32) for a in starts]
    lay = KVLayout.of(layers, 1)
    pb, stride = lay.page_bytes, lay.page_bytes + 4096
    spec = [(t, lb.block_stride, lb.runs) for t, lb in zip(layers, lay.layers)]
    pieces = install_pieces(spec, pb, 512, torch.device("cpu"))
    arena = torch.from_numpy(rng.integers(0, 256, 7 * stride, dtype=np.uint8)).view(torch.int8)
    pages, blocks = [5, 0, 3], [7, 2, 4]
    sk_out = torch.full((3 * pb // SKETCH_ROW, 16), -1, dtype=torch.int32)
    page_of = lambda b: block_page(layers, 1, b).numpy().view(np.uint8).copy()  # noqa: E731
    before = {b: page_of(b) for b in range(nb)}
    if CONTROL:  # two pieces of the page trade places: every byte is written, two runs in the wrong block part
        off = pieces.off.clone()
        off[[1, 9]] = off[[9, 1]]
        pieces.off = off
    InstallSketchKernel(bm=16, bk=512)(arena, torch.tensor(pages), torch.tensor(blocks), stride, pb, pieces, key,
                                       sk_out)
    a = arena.numpy().view(np.uint8)
    src = [a[p * stride : p * stride + pb] for p in pages]
    out = {"page_bytes": pb, "runs_per_layer": len(lay.layers[0].runs),
           "installed": [bool(np.array_equal(page_of(b), s)) for b, s in zip(blocks, src)],
           "others_untouched": all(np.array_equal(page_of(b), before[b])
                                   for b in range(nb) if b not in blocks),
           "sketch": bool(np.array_equal(sk_out.numpy(), np.concatenate([page_sketch(x) for x in src])))}
    # layers that are permuted views (blocks-first memory seen K/V-first, as vLLM's layouts are
    # views): the kernel writes through their storage, never a copy of them
    flat = torch.zeros(2 * nb * 2 * 16 * 4 * 32, dtype=torch.bfloat16)
    perm = [flat[i * nb * 4096 : (i + 1) * nb * 4096].view(nb, 2, 16, 4, 32).permute(1, 0, 2, 3, 4) for i in range(2)]
    pl = KVLayout.of(perm, 1)
    pp = install_pieces([(t, lb.block_stride, lb.runs) for t, lb in zip(perm, pl.layers)], pl.page_bytes, 512,
                        torch.device("cpu"))
    src2 = torch.from_numpy(rng.integers(0, 256, 4 * pl.page_bytes, dtype=np.uint8)).view(torch.int8)
    sk2 = torch.empty((3 * pl.page_bytes // SKETCH_ROW, 16), dtype=torch.int32)
    InstallSketchKernel(bm=16, bk=512)(src2, torch.tensor([3, 1, 0]), torch.tensor([5, 0, 8]), pl.page_bytes,
                                       pl.page_bytes, pp, key, sk2)
    s2 = src2.numpy().view(np.uint8)
    out["permuted_views"] = [bool(np.array_equal(block_page(perm, 1, b).numpy().view(np.uint8),
                                                 s2[p * pl.page_bytes : (p + 1) * pl.page_bytes]))
                             for p, b in ((3, 5), (1, 0), (0, 8))]
    refused = []
    narrow = [torch.zeros((2, nb, 16, 1, 4), dtype=torch.bfloat16) for _ in range(2)]  # runs of 128 bytes
    nl = KVLayout.of(narrow, 1)
    for bad in (lambda: install_pieces([(t, lb.block_stride, lb.runs) for t, lb in zip(narrow, nl.layers)],
                                       nl.page_bytes, 512, torch.device("cpu")),
                lambda: install_pieces(spec, pb + 512, 512, torch.device("cpu")),
                lambda: install_pieces(spec, pb, 24, torch.device("cpu")),
                lambda: InstallSketchKernel(bm=16, bk=256)(arena, torch.tensor(pages), torch.tensor(blocks), stride,
                                                           pb, pieces, key, sk_out),
                lambda: InstallSketchKernel(bm=16, bk=512)(arena, torch.tensor(pages), torch.tensor(blocks[:2]),
                                                           stride, pb, pieces, key, sk_out)):
        try:
            bad()
            refused.append(False)
        except ValueError:
            refused.append(True)
    out["refuses"] = refused
    print(json.dumps(out))
""")


def _run_install(control: bool) -> dict:
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", f"CONTROL = {control}\n" + INSTALL_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_direct_install_writes_each_page_into_its_block_and_sketches_what_it_wrote():
    """InstallSketchKernel (a load's copy, check and install in one pass, pages in device
    memory): pages taken out of order a stride apart land in their blocks of four layers whose
    blocks are two runs each (K and V) and whose tensors lie at irregular addresses, and in the
    blocks of layers that are permuted views of their memory; no other block changes; the sketches are the host reference's of the pages; layouts that are not
    whole pieces, pieces of another step and a block list of another length are refused."""
    out = _run_install(control=False)
    assert out == {"page_bytes": 32768, "runs_per_layer": 2, "installed": [True, True, True],
                   "others_untouched": True, "sketch": True, "permuted_views": [True, True, True],
                   "refuses": [True] * 5}


def test_two_pieces_installed_in_each_others_place_are_seen_by_the_byte_oracle():
    """The control: the same install with two pieces' destinations exchanged writes every byte
    of each page into its block, two runs in the wrong part; the byte oracle (the block's
    page order, kvpool.gpu.layout.block_page) must see it in every block, while the sketch of
    what was read stays right (the check covers the bytes, not where they went: the layout's
    pieces are built and probed once, at the engine's start)."""
    out = _run_install(control=True)
    assert out["installed"] == [False, False, False], "negative control NOT caught by the byte oracle"
    assert out["sketch"] is True and out["others_untouched"] is True
