"""Where the GPU engine's pages lie (kvpool.gpu.region), a keeper's mapping as the engine's arena
(kvpool.gpu.tier_backend.TierArena, TierBackend.arena), the engine's classification of a grant
of a replaced keeper (kvpool.gpu.load.Loads._release) and the worker's device for a keeper's
mapping (kvpool.connector.settings): the parts that need no GPU, with fakes where a GPU would
be (a CudaArray is an address and a size; nothing here dereferences it).

  the host pool's arena      a HOST region over exactly its pages_region, copied D2H / H2D,
                             registered, not per session (the engine's host path as it was)
  a keeper's VMM mapping     a DEVICE region over the mapping's page range, copied D2D, not
                             registered, keyed by instance and session
  refusals                   neither range or both, not whole pages, another GPU, a range that
                             is not bytes; a digest the pool or the memory cannot take
  following                  the same segment stays, a new session or instance moves, no arena
                             stays; lanes of another session are named
  release of a replaced grant  WrongInstance -> transport_error; a reaped lease stays timeout
"""

from __future__ import annotations

import mmap
import sys
import types

import numpy as np
import pytest

from kvpool.connector import settings as S
from kvpool.errors import LeaseLost, MissCause, TransportError
from kvpool.gpu.config import PageMemory, TransferError
from kvpool.gpu.handout import HandleKind, TierDescriptor
from kvpool.gpu.load import Loads
from kvpool.gpu.region import PageRegion, check_store_digest, moved_to, off_session, page_region
from kvpool.gpu.tier import WrongInstance
from kvpool.gpu.tier_backend import TierArena, TierBackend
from kvpool.gpu.tier_map import TierMap
from kvpool.gpu.vmm import CudaArray
from kvpool.pool.arena import Arena
from kvpool.pool.digest import DigestKind
from kvpool.pool.records import AcquireResult, ReleaseResult

PAGE = 64 * 1024
PAGES = 8
INSTANCE = bytes(range(16))
BASE = 0x7F00_0000_0000  # a device address: never dereferenced here


class FakeMapping:
    """What kvpool.gpu.vmm.Mapping is to TierMap.pages(): an address, a size, views."""

    def __init__(self, ptr: int, size: int):
        self.ptr, self.size = ptr, size

    def view(self, offset: int, nbytes: int) -> CudaArray:
        assert 0 <= offset and offset + nbytes <= self.size
        return CudaArray(self.ptr + offset, nbytes)


def descriptor(kind: HandleKind, instance: bytes = INSTANCE) -> TierDescriptor:
    return TierDescriptor(instance, b"\x01" * 16, kind, 2 * 2**20, PAGE, PAGES, 2 * 2**20, 8 * PAGES)


class FakeClient:
    """A connected TierClient as TierArena.of reads it."""

    def __init__(self, tier: TierMap, session: int, instance: bytes = INSTANCE):
        self.tier, self.client_id, self.instance = tier, session, instance
        self.hello = object()


def vmm_client(session: int = 3, same_gpu: bool = True, instance: bytes = INSTANCE) -> FakeClient:
    tier = TierMap(descriptor(HandleKind.VMM_POSIX_FD, instance), None, FakeMapping(BASE, 2 * 2**20), None,
                   same_gpu)
    return FakeClient(tier, session, instance)


# -- regions -------------------------------------------------------------------------------------


def test_the_host_pools_arena_is_a_host_region_over_exactly_its_pages():
    arena = Arena.anonymous("region-test", PAGE, PAGES)
    try:
        r = page_region(arena)
        pages = arena.pages_region
        assert (r.memory, r.instance, r.page_size, r.num_pages) == (PageMemory.HOST, arena.instance, PAGE, PAGES)
        assert (r.ptr, r.nbytes) == (pages.ctypes.data, pages.nbytes) and np.shares_memory(r.host, pages)
        assert (r.to_pages, r.from_pages, r.registers, r.session, r.device) == (True, False, True, None, None)
        check_store_digest(r, DigestKind.XXH3, None)  # the host pool takes either kind, as before
        check_store_digest(r, DigestKind.SKETCH, None)
        assert off_session(r, [arena.instance, b"another pool", None]) == []  # a pool's lanes are not checked
        del r, pages  # the views go before the arena
    finally:
        arena.close()


def test_a_keepers_vmm_mapping_is_a_device_region_keyed_by_instance_and_session():
    client = vmm_client(session=7)
    arena = TierArena.of(client)
    assert arena.instance == INSTANCE + (7).to_bytes(8, "big") and arena.session == 7
    assert arena.pages_region is None and arena.device_pages == CudaArray(BASE, PAGES * PAGE)
    r = page_region(arena)
    assert (r.memory, r.instance, r.session, r.page_size, r.num_pages) == \
        (PageMemory.DEVICE, arena.instance, 7, PAGE, PAGES)
    assert (r.ptr, r.nbytes, r.host) == (BASE, PAGES * PAGE, None)
    assert (r.to_pages, r.from_pages, r.registers) == (None, None, False)  # device to device, nothing to register
    # page i of the region is the page TierMap hands out for i
    assert all(client.tier.page_view(i).ptr == r.ptr + i * r.page_size for i in range(PAGES))
    check_store_digest(r, DigestKind.SKETCH, DigestKind.SKETCH)


def test_a_keepers_memfd_mapping_is_a_host_region_over_the_mapped_pages():
    host = mmap.mmap(-1, 2 * 2**20)
    tier = TierMap(descriptor(HandleKind.MEMFD), None, None, host, False)
    arena = TierArena.of(FakeClient(tier, 2))
    r = page_region(arena)
    assert (r.memory, r.session, r.nbytes, r.registers) == (PageMemory.HOST, 2, PAGES * PAGE, True)
    page = np.frombuffer(tier.page_view(5), dtype=np.uint8)
    page[:4] = [1, 2, 3, 4]
    assert list(r.host[5 * PAGE : 5 * PAGE + 4]) == [1, 2, 3, 4]  # the same memory, not a copy
    with pytest.raises(TransferError, match="kv-sketch-1 digests only"):
        check_store_digest(r, DigestKind.XXH3, DigestKind.SKETCH)  # the keeper takes one kind


@pytest.mark.parametrize("what,arena,match", [
    ("neither", types.SimpleNamespace(instance=b"i", page_size=PAGE), "neither"),
    ("both", types.SimpleNamespace(instance=b"i", page_size=PAGE, pages_region=np.zeros(PAGE, np.uint8),
                                   device_pages=CudaArray(BASE, PAGE), same_gpu=True), "both"),
    ("torn pages", types.SimpleNamespace(instance=b"i", page_size=PAGE, device_pages=CudaArray(BASE, PAGE + 1),
                                         same_gpu=True), "whole pages"),
    ("another gpu", types.SimpleNamespace(instance=b"i", page_size=PAGE, device_pages=CudaArray(BASE, PAGE),
                                          same_gpu=False), "another GPU"),
    ("not cuda", types.SimpleNamespace(instance=b"i", page_size=PAGE, device_pages=object(), same_gpu=True),
     "not a CUDA array"),
    ("not bytes", types.SimpleNamespace(
        instance=b"i", page_size=PAGE, same_gpu=True, device_pages=types.SimpleNamespace(
            __cuda_array_interface__={"shape": (PAGE // 2,), "typestr": "<u2", "data": (BASE, False), "version": 3})),
     "one run of bytes"),
    ("host not bytes", types.SimpleNamespace(instance=b"i", page_size=PAGE, pages_region=np.zeros(PAGE, np.uint16)),
     "contiguous numpy uint8"),
])
def test_an_arena_the_engine_cannot_copy_through_is_refused(what, arena, match):
    with pytest.raises(TransferError, match=match):
        page_region(arena)


def test_device_pages_take_kv_sketch_1_stores_only():
    r = page_region(TierArena.of(vmm_client()))
    with pytest.raises(TransferError, match="host cannot read them"):
        check_store_digest(r, DigestKind.XXH3, None)
    with pytest.raises(TransferError, match="kv-sketch-1 digests only"):
        check_store_digest(r, DigestKind.XXH3, DigestKind.SKETCH)
    check_store_digest(r, DigestKind.SKETCH, None)


def test_the_engine_moves_on_a_new_session_or_instance_and_stays_otherwise():
    first = page_region(TierArena.of(vmm_client(session=1)))
    assert moved_to(first, None) is None  # no arena: the op's own call fails or reconnects
    assert moved_to(first, TierArena.of(vmm_client(session=1))) is None  # the same mapping
    session = moved_to(first, TierArena.of(vmm_client(session=2)))  # the same keeper, another mapping
    assert session is not None and session.session == 2 and session.instance != first.instance
    restarted = moved_to(first, TierArena.of(vmm_client(session=1, instance=b"\x09" * 16)))  # ids restart at 1
    assert restarted is not None and restarted.instance[:16] == b"\x09" * 16
    with pytest.raises(TransferError, match="another GPU"):  # a new instance on another GPU is refused
        moved_to(first, TierArena.of(vmm_client(session=1, same_gpu=False, instance=b"\x08" * 16)))


def test_lanes_of_another_session_are_named():
    r = page_region(TierArena.of(vmm_client(session=4)))
    other = TierArena.of(vmm_client(session=5)).instance
    assert off_session(r, [r.instance, r.instance]) == []
    assert off_session(r, [r.instance, other, None]) == [1, 2]
    assert isinstance(r, PageRegion)


# -- TierBackend.arena ------------------------------------------------------------------------------


def test_the_backends_arena_is_its_links_current_session():
    link = types.SimpleNamespace(client=None)
    b = TierBackend(link)
    assert b.arena is None  # not connected: the engine has nothing to copy through
    link.client = vmm_client(session=1)
    a1 = b.arena
    assert a1 is b.arena and a1.session == 1  # named once per session
    link.client = vmm_client(session=2)
    a2 = b.arena
    assert a2.session == 2 and a2.instance != a1.instance
    link.client.tier = None  # a client whose mapping is gone names nothing
    assert b.arena is None


# -- the engine's release of a grant through a replaced keeper --------------------------------------


class RefusingBackend:
    def __init__(self, exc: Exception):
        self.exc = exc

    def release(self, lease_id: int) -> ReleaseResult:
        raise self.exc


@pytest.mark.parametrize("exc,cause", [
    (WrongInstance("lease of instance 1 presented to instance 2"), MissCause.TRANSPORT_ERROR),
    (LeaseLost("reaped"), MissCause.TIMEOUT),  # the host pool's reaped lease: as before
    (TransportError("gone"), MissCause.TRANSPORT_ERROR),
])
def test_a_release_refused_for_a_replaced_instance_is_a_transport_error(exc, cause):
    engine = types.SimpleNamespace(backend=RefusingBackend(exc))
    lease = AcquireResult(5, None, None)
    stale, error, unverified = Loads._release(engine, lease)  # noqa: SLF001
    assert stale == () and unverified is cause and type(exc).__name__ in error


# -- the worker's device for a keeper's mapping -----------------------------------------------------


def fake_torch(initialized: bool, device: int) -> types.ModuleType:
    mod = types.ModuleType("torch")
    mod.cuda = types.SimpleNamespace(is_initialized=lambda: initialized, current_device=lambda: device)
    return mod


def test_the_worker_maps_a_keepers_buffer_on_its_own_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True, 3))
    assert S.tier_device_index("worker") == 3
    assert S.tier_device_index("scheduler") is None  # the scheduler copies nothing
    monkeypatch.setitem(sys.modules, "torch", fake_torch(False, 3))
    assert S.tier_device_index("worker") is None  # no CUDA here (a CPU replica on a memfd keeper)
    monkeypatch.delitem(sys.modules, "torch")
    assert S.tier_device_index("worker") is None


def test_connect_backend_hands_the_device_to_the_keepers_link(monkeypatch, tmp_path):
    import kvpool.gpu.tier_client as tc

    made = []

    class RecordingLink:
        def __init__(self, address_dir, tenant, token, **kw):  # noqa: ANN001, ANN003
            made.append((str(address_dir), tenant, token, kw))
            self.client = None

        def connect(self):  # noqa: ANN201
            return self

    monkeypatch.setattr(tc, "TierLink", RecordingLink)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True, 1))
    settings = S.ConnectorSettings(pool=f"keeper:{tmp_path}", token="t")
    for role in ("worker", "scheduler"):
        b = S.connect_backend(settings, role, None)
        assert isinstance(b, TierBackend) and b.arena is None
    (_, _, _, worker), (_, _, _, scheduler) = made
    assert made[0][:3] == (str(tmp_path), "default", "t")
    assert worker["device_index"] == 1 and scheduler["device_index"] is None
