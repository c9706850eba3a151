"""Stream-ordering scenarios of the GPU transfer engine, shared by the gpu suite and its
sanitizer subprocess (harness/scenarios/gpu_sanitized.py).

  Geometry / GEOMETRIES   KV layouts under test (block dim first and second, three
                          page sizes, engine chunking small enough to reuse staging).
  Scenario                one per ordering edge; each delays the producing stream with
                          torch.cuda._sleep and runs `copies` transfers back to back.
  pool_pages / scrubbed   the pool's committed pages of some hashes; its stats once every
                          page committed on trust had its first scrub.
  run_scenario(...)       -> Verdict: valid iff every page byte is what it must be.
                          evidence: pages compared, stale pages, edges the engine skipped.
  engine_factory(...)     make(layers, drop): the engine, or the control dropping `drop`.
  check_with_control(...) the scenario with the engine (must pass) and with its control
                          (must be caught); asserts both.

The references are computed here, independently of the engine: pages are written into
and read out of the KV tensors block by block with `select`, and compared with host
copies of the bytes drawn from the seed. What is not checked: interleavings other than
the one the delay forces (a seed cannot force a thread or stream interleaving).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from collections.abc import Callable

import numpy as np
import torch

from kvgate.faults.gpu_controls import UnorderedTransferEngine, delay_stream
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.pool.digest import DigestKind
from kvpool.gpu.config import CopyPath, OrderingEdge, TransferConfig
from kvpool.gpu.transfer import TransferEngine
from kvpool.pool.keys import Namespace, block_hashes
from kvgate.harness.checkers.verdict import Verdict

POOL_PAGE = 512 * 1024


@dataclasses.dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    template: tuple[int | str, ...]  # the per-layer shape, "N" where the blocks are
    dtype: str
    num_blocks: int
    chunk_pages: int = 0  # engine staging chunk in pages (0: the engine's default)
    commit_blocks: int = 0
    lanes: int = 1

    @property
    def block_dim(self) -> int:
        return self.template.index("N")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.num_blocks if s == "N" else int(s) for s in self.template)

    @property
    def page_bytes(self) -> int:
        per_layer = int(np.prod([s for s in self.template if s != "N"])) * torch.empty((), dtype=self.torch_dtype).element_size()
        return per_layer * self.layers

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def config(self, path: CopyPath, **overrides) -> TransferConfig:  # noqa: ANN003
        """The engine's settings for this geometry on `path`; the install of device pages is
        staged unless `install_direct=True` is passed (each scenario names the way it runs)."""
        kwargs: dict = {"path": path, "block_dim": self.block_dim, "hash_threads": 4, "install_direct": False}
        if self.chunk_pages:
            kwargs["chunk_bytes"] = self.chunk_pages * self.page_bytes
        if self.commit_blocks:
            kwargs["commit_blocks"] = self.commit_blocks
        kwargs.update(overrides)
        return TransferConfig(**kwargs)


GEOMETRIES = {
    # vLLM GPU layout (N, 2, B, H, D), 16 KiB pages, tiny chunks: staging reused within a copy
    "nfirst-16k": Geometry("nfirst-16k", 2, ("N", 2, 16, 2, 64), "bfloat16", 96, chunk_pages=4, commit_blocks=3,
                           lanes=2),
    # FlashAttention layout (2, N, B, H, D): block dim 1, two runs per layer, 128 KiB pages
    "flash-128k": Geometry("flash-128k", 4, (2, "N", 16, 4, 128), "float16", 64),
    # 512 KiB pages = the pool's page: consecutive pages copy as one
    "nfirst-512k": Geometry("nfirst-512k", 8, ("N", 2, 16, 8, 128), "bfloat16", 64, chunk_pages=8, commit_blocks=5,
                            lanes=2),
}


class Scenario(enum.StrEnum):
    STORE_RAW = "store_raw"  # delay the engine's KV write; the store must copy the written bytes
    STORE_WAR = "store_war"  # delay the store's copy; the engine rewrites the blocks right after store()
    LOAD_RAW = "load_raw"  # delay the load's copy; the engine reads the blocks right after wait_for_load()
    LOAD_WAR = "load_war"  # delay the engine's read of the old blocks; then load into them

    @property
    def edge(self) -> OrderingEdge:
        return {
            Scenario.STORE_RAW: OrderingEdge.STORE_AFTER_WRITE,
            Scenario.STORE_WAR: OrderingEdge.REUSE_AFTER_STORE,
            Scenario.LOAD_RAW: OrderingEdge.READ_AFTER_LOAD,
            Scenario.LOAD_WAR: OrderingEdge.LOAD_AFTER_READ,
        }[self]


def namespace(geom: Geometry, tag: str) -> Namespace:
    return Namespace(f"gpu-{tag}", "r1", "tok", geom.dtype, f"cuda:{'x'.join(map(str, geom.template))}", 16,
                     geom.layers, 2, 64)


# -- the references: block by block, independent of the engine --------------------------------
def make_kv(geom: Geometry, device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(geom.shape, dtype=geom.torch_dtype, device=device) for _ in range(geom.layers)]


def _layer_bytes(t: torch.Tensor, d: int, b: int) -> torch.Tensor:
    return t.select(d, b).view(torch.uint8)


def write_pages(layers: list[torch.Tensor], d: int, blocks: list[int], pages: torch.Tensor) -> None:
    """pages[i] (uint8, on the device) into block blocks[i] of every layer, on the current stream."""
    for i, b in enumerate(blocks):
        off = 0
        for t in layers:
            dst = _layer_bytes(t, d, b)
            dst.copy_(pages[i, off : off + dst.numel()].view(dst.shape))
            off += dst.numel()


def read_pages(layers: list[torch.Tensor], d: int, blocks: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """The page bytes of `blocks`, read on the current stream (what attention would read),
    into `out` (allocated beforehand: an allocation while a stream is held back can
    serialize the streams and hide the race under test)."""
    if out is None:
        out = torch.empty((len(blocks), sum(_layer_bytes(t, d, 0).numel() for t in layers)), dtype=torch.uint8,
                          device=layers[0].device)
    for i, b in enumerate(blocks):
        off = 0
        for t in layers:
            src = _layer_bytes(t, d, b)
            out[i, off : off + src.numel()].view(src.shape).copy_(src)
            off += src.numel()
    return out[: len(blocks)]


def _block_shape(t: torch.Tensor, d: int) -> tuple[int, ...]:
    u = t.view(torch.uint8)
    return tuple(u.shape[:d]) + tuple(u.shape[d + 1 :])


def write_blocks(layers: list[torch.Tensor], d: int, idx: torch.Tensor, pages: torch.Tensor) -> None:
    """pages[i] into block idx[i]: one index_copy_ per layer on the whole KV tensor, as a
    model's KV write touches the tensor (the stream sanitizer tracks whole tensors)."""
    n, off = idx.numel(), 0
    for t in layers:
        shape = _block_shape(t, d)
        nb = int(np.prod(shape))
        t.view(torch.uint8).index_copy_(d, idx, pages[:, off : off + nb].view(n, *shape).movedim(0, d))
        off += nb


def read_scratch(layers: list[torch.Tensor], d: int, n: int) -> list[torch.Tensor]:
    return [torch.empty((*_block_shape(t, d)[:d], n, *_block_shape(t, d)[d:]), dtype=torch.uint8, device=t.device)
            for t in layers]


def read_blocks(layers: list[torch.Tensor], d: int, idx: torch.Tensor, out: torch.Tensor,
                scratch: list[torch.Tensor]) -> torch.Tensor:
    """The page bytes of blocks idx into `out`: one index_select per layer over the whole KV
    tensor (as attention reads it), through `scratch` from read_scratch; nothing allocated."""
    n, off = idx.numel(), 0
    for t, buf in zip(layers, scratch):
        shape = _block_shape(t, d)
        nb = int(np.prod(shape))
        torch.index_select(t.view(torch.uint8), d, idx, out=buf)
        out[:n, off : off + nb].view(n, *shape).copy_(buf.movedim(d, 0))
        off += nb
    return out[:n]


def fill(layers: list[torch.Tensor], d: int, rng: np.random.Generator, page_bytes: int) -> np.ndarray:
    """Random bytes in every block; returns them (num_blocks, page_bytes) on the host."""
    n = layers[0].shape[d]
    host = rng.integers(0, 256, (n, page_bytes), dtype=np.uint8)
    write_pages(layers, d, list(range(n)), torch.from_numpy(host).to(layers[0].device))
    return host


def staged_at_once(geom: Geometry) -> int:
    """Blocks a sketched load of this geometry stages at once (chunk pages times staging
    buffers, at the engine's defaults)."""
    cfg = TransferConfig()
    return (geom.chunk_pages or max(1, cfg.chunk_bytes // geom.page_bytes)) * cfg.load_buffers


def pool_pages(client: PoolClient, ns: Namespace, hashes: list[bytes]) -> np.ndarray | None:
    """The committed pages of `hashes`, read from the arena (None if any is not committed)."""
    hits = client.lookup(ns, hashes).hits
    if len(hits) != len(hashes):
        return None
    return np.stack([np.array(client.arena.page(h.page, h.length)) for h in hits])



def scrubbed(client: PoolClient, timeout_s: float = 60.0) -> dict:
    """The pool's stats once every page committed on trust had its first scrub."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats["scrub_queued"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the pool's scrub did not finish within {timeout_s}s: {stats}"
        time.sleep(0.05)

# -- one scenario ----------------------------------------------------------------------------
EngineFactory = Callable[[list[torch.Tensor], OrderingEdge | None], TransferEngine]


def run_scenario(scenario: Scenario, geom: Geometry, make_engine: EngineFactory, client: PoolClient,
                 ns: Namespace, seed: int, delay_cycles: int, copies: int = 3, drop: bool = False) -> Verdict:
    """Run `copies` transfers under a stream delay; `drop`: with the engine that skips the
    scenario's ordering edge (the negative control)."""
    rng = np.random.default_rng([seed, copies, int(drop)])
    device = torch.device("cuda", torch.cuda.current_device())
    d = geom.block_dim
    pb = geom.page_bytes
    layers = make_kv(geom, device)
    old = fill(layers, d, rng, pb)
    k = int(rng.integers(4, min(16, geom.num_blocks // copies) + 1))
    if scenario == Scenario.LOAD_RAW:
        # Past its staging buffers a sketched load's copies wait for its first scatters, and
        # load() for those copies: the delayed scatters would have run before it returned.
        k = min(k, staged_at_once(geom))
    order = rng.permutation(geom.num_blocks)
    sels = [sorted(int(b) for b in order[i * k : (i + 1) * k]) for i in range(copies)]
    sels = [list(rng.permutation(s)) for s in sels]  # block ids in no particular order
    sels = [[int(b) for b in s] for s in sels]
    new = [rng.integers(0, 256, (k, pb), dtype=np.uint8) for _ in range(copies)]
    base = int(rng.integers(1 << 28))
    hashes = [block_hashes(range(base + i * 10_000, base + i * 10_000 + 16 * k), 16) for i in range(copies)]
    new_dev = [torch.from_numpy(p).to(device) for p in new]
    # Everything the delayed part touches is allocated now (an allocation while a stream is
    # held back can serialize the streams and hide the race under test).
    idx = [torch.tensor(s, dtype=torch.int64, device=device) for s in sels]
    seen_buf = [torch.empty((k, pb), dtype=torch.uint8, device=device) for _ in range(copies)]
    scratch = read_scratch(layers, d, k)
    warm = [int(order[copies * k])]
    warm_idx = torch.tensor(warm, dtype=torch.int64, device=device)
    warm_hashes = block_hashes(range(base + 9_000_000, base + 9_000_016), 16)
    engine = make_engine(layers, scenario.edge if drop else None)
    # The reference pages of a load carry the engine's own digest kind (every load, on
    # either path, installs from staging after its check: the installs are what a
    # read-after-load race can overtake).
    kind = DigestKind(engine.config.digest)

    if scenario in (Scenario.LOAD_RAW, Scenario.LOAD_WAR):
        for h, p in zip(hashes, new):
            res = publish(client, ns, h, list(p), kind=kind).committed
            if res != k:
                engine.close()
                return Verdict(None, f"could not publish the reference pages: {res} of {k} committed")
    torch.cuda.synchronize()

    seen: list[torch.Tensor] = []
    expected: list[np.ndarray] = []
    try:
        # Warm-up, synchronized: every kernel and copy of the engine and of the test runs
        # once before any delay (a first launch loads its module and can serialize streams).
        warm_out = read_blocks(layers, d, warm_idx, seen_buf[0], read_scratch(layers, d, 1))
        write_blocks(layers, d, warm_idx, warm_out)
        torch.cuda.synchronize()
        engine.store(warm, warm_hashes)
        torch.cuda.synchronize()
        engine.drain()
        h = engine.load(warm, warm_hashes)
        engine.wait_for_load(h)
        torch.cuda.synchronize()
        engine.drain()
        stream = torch.cuda.current_stream()
        for i in range(copies):
            if scenario == Scenario.STORE_RAW:
                delay_stream(stream, delay_cycles)
                write_blocks(layers, d, idx[i], new_dev[i])
                engine.store(sels[i], hashes[i])
            elif scenario == Scenario.STORE_WAR:
                for reader in engine.store_read_streams:  # every stream that reads the KV is late
                    delay_stream(reader, delay_cycles)
                engine.store(sels[i], hashes[i])
                write_blocks(layers, d, idx[i], new_dev[i])  # the engine reuses the blocks at once
            elif scenario == Scenario.LOAD_RAW:
                delay_stream(engine.load_write_stream(kind), delay_cycles)  # the writes into the blocks are late
                h = engine.load(sels[i], hashes[i])
                if h.loaded != k:
                    return Verdict(False, f"load {i} installed {h.loaded} of {k} blocks: {h}")
                engine.wait_for_load(h)
                seen.append(read_blocks(layers, d, idx[i], seen_buf[i], scratch))
                expected.append(new[i])
            else:  # LOAD_WAR
                delay_stream(stream, delay_cycles)
                seen.append(read_blocks(layers, d, idx[i], seen_buf[i], scratch))  # reads the old blocks, late
                expected.append(old[sels[i]])
                h = engine.load(sels[i], hashes[i])
                if h.loaded != k:
                    return Verdict(False, f"load {i} installed {h.loaded} of {k} blocks: {h}")
                engine.wait_for_load(h)
        torch.cuda.synchronize()
        outcomes = engine.drain()
    finally:
        engine.close()
    dropped = getattr(engine, "dropped", 0)
    if scenario in (Scenario.STORE_RAW, Scenario.STORE_WAR):
        committed = sum(o.committed for o in outcomes)
        if committed != copies * k:
            return Verdict(False, f"{committed} of {copies * k} stored blocks committed: {outcomes}",
                           {"dropped_edges": dropped})
        want = new if scenario == Scenario.STORE_RAW else [old[s] for s in sels]
        got = [pool_pages(client, ns, h) for h in hashes]
        if any(g is None for g in got):
            return Verdict(False, "a committed block is no longer in the pool", {"dropped_edges": dropped})
    else:
        if any(o.loaded != k or o.stale for o in outcomes):
            return Verdict(False, f"load outcomes: {outcomes}", {"dropped_edges": dropped})
        got = [s.cpu().numpy() for s in seen]
        want = expected
        if scenario == Scenario.LOAD_WAR:  # and the load itself landed
            after = [read_pages(layers, d, s).cpu().numpy() for s in sels]
            if any(not np.array_equal(a, w) for a, w in zip(after, new)):
                return Verdict(False, "the loaded blocks differ from the published pages", {"dropped_edges": dropped})
    stale = sum(int(np.count_nonzero((g != w).any(axis=1))) for g, w in zip(got, want))
    evidence = {"scenario": scenario.value, "geometry": geom.name, "copies": copies, "blocks_per_copy": k,
                "pages": copies * k, "stale_pages": stale, "delay_cycles": delay_cycles, "dropped_edges": dropped,
                "host_memory": engine.capabilities.host_memory.value, "path": engine.capabilities.path.value}
    if stale:
        return Verdict(False, f"{stale} of {copies * k} pages held stale bytes", evidence)
    return Verdict(True, "every page byte-exact under the stream delay", evidence,
                   not_checked="interleavings other than the one the delay forces")


@contextlib.contextmanager
def engine_factory(gpu_pool, client, geom, ns, path: CopyPath, **overrides):  # noqa: ANN001, ANN003
    """make(layers, drop) -> a TransferEngine, or the control that drops `drop`."""
    lanes = [client] + [gpu_pool.client(name=f"lane{i}") for i in range(1, geom.lanes)]

    def make(layers, drop):  # noqa: ANN001, ANN202
        cfg = geom.config(path, **overrides)
        if drop is None:
            return TransferEngine(client, ns, layers, cfg, lanes=lanes)
        return UnorderedTransferEngine(client, ns, layers, cfg, lanes=lanes, drop=drop)

    try:
        yield make
    finally:
        for c in lanes[1:]:
            c.close()


def check_with_control(scenario, geom, make, client, ns, seed, delay_cycles):  # noqa: ANN001, ANN201
    ordered = run_scenario(scenario, geom, make, client, ns, seed, delay_cycles)
    control = run_scenario(scenario, geom, make, client, ns, seed, delay_cycles, drop=True)
    assert ordered.valid is True, f"ordered transfer: {ordered}"
    assert control.evidence.get("dropped_edges", 0) > 0, f"the control never reached its edge: {control}"
    assert control.valid is False and control.evidence.get("stale_pages", 0) > 0, \
        f"negative control NOT caught (the check cannot fail as run): {control}"
    return ordered, control
