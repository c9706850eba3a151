"""The GPU engine over tiers in lookup order (kvpool.gpu.tiered_engine.TieredEngine), on member
engines that stand in for TransferEngine without a GPU: each holds some blocks' pages, installs
them as a load of its own, and puts its installs on a model of the device where work on
different streams runs in any order its waits allow (here: the latest issued first, the order
that exposes a missing wait). Oracles: the blocks installed, byte for byte, against the pages
the run's hashes name; the loaded count and the miss; where each block of a store was placed.
Controls (kvgate.faults.tiered_controls): FirstTierOnlyEngine (caught by the loaded count and
the miss cause), UnorderedTieredEngine (caught by the byte-exact oracle)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("torch")

from kvgate.faults.tiered_controls import FirstTierOnlyEngine, UnorderedTieredEngine  # noqa: E402
from kvpool.errors import MissCause, TransportError  # noqa: E402
from kvpool.errors import ArenaError, InvalidRequest  # noqa: E402
from kvpool.gpu.config import RegionRefused  # noqa: E402
from kvpool.gpu.tiered import MemberLeftOut  # noqa: E402
from kvpool.gpu import tiered_engine  # noqa: E402
from kvpool.gpu.config import KVLayoutError, TransferConfig, TransferError  # noqa: E402
from kvpool.gpu.load import LoadHandle, LoadOutcome  # noqa: E402
from kvpool.gpu.store import StoreHandle, StoreOutcome  # noqa: E402
from kvpool.gpu.tiered_engine import TieredEngine, TieredLoadHandle  # noqa: E402
from kvpool.pool.records import Miss  # noqa: E402

GARBAGE = b"\x00garbage"


def page(h: bytes) -> bytes:
    return b"page-of-" + h


class Device:
    """Blocks, and the work enqueued on them: an op runs once the ops it waits for ran; among
    those ready, the latest enqueued runs first (the reordering a missing wait allows)."""

    def __init__(self):
        self.blocks: dict[int, bytes] = {}
        self.ops: list[tuple[int, set[int], dict[int, bytes]]] = []  # (load id, waits, writes)
        self.current_waits: set[int] = set()  # the engine's current stream: loads it waits for
        self.done: set[int] = set()
        self.log: list[tuple[str, str, int]] = []

    def run(self) -> None:
        while self.ops:
            ready = [op for op in self.ops if op[1] <= self.done]
            op = ready[-1]
            self.ops.remove(op)
            self.blocks.update(op[2])
            self.done.add(op[0])


class FakeEngine:
    """A member engine: `holds` its pages by hash; `corrupt` hashes fail their check (a direct
    install has then written the bad page into its block: GARBAGE); `raises` on every load."""

    ids = iter(range(1, 10**6))

    def __init__(self, name: str, device: Device, holds: set[bytes], corrupt: set[bytes] = frozenset(),
                 raises: BaseException | None = None, capacity: int = 10**6, unreached_at: int | None = None,
                 stale: tuple[int, ...] = (), refused_at: int | None = None):
        self.name, self.device, self.holds, self.corrupt = name, device, holds, corrupt
        self.raises, self.capacity, self.unreached_at, self.stale = raises, capacity, unreached_at, stale
        self.refused_at = refused_at
        self.layout = types.SimpleNamespace(num_blocks=64)
        self.capabilities = types.SimpleNamespace(path=name)
        self.stored: list[tuple[list[int], int | None]] = []
        self.closed = False

    def _check_ids(self, block_ids, hashes):  # noqa: ANN001, ANN202
        return tuple(block_ids)

    def load(self, block_ids, hashes, deadline_s=None) -> LoadHandle:  # noqa: ANN001
        if self.raises is not None:
            raise self.raises
        n = 0
        while n < len(hashes) and hashes[n] in self.holds and hashes[n] not in self.corrupt:
            n += 1
        writes = {block_ids[i]: page(hashes[i]) for i in range(n)}
        miss = None
        if n < len(hashes):
            if hashes[n] in self.corrupt:
                writes[block_ids[n]] = GARBAGE  # the direct install wrote it before its check failed
                miss = Miss(n, MissCause.CORRUPT)
            else:
                miss = Miss(n, MissCause.NEVER_PUBLISHED)
        hid = next(self.ids)
        self.device.ops.append((hid, set(self.device.current_waits), writes))
        self.device.log.append(("load", self.name, hid))
        h = LoadHandle(hid, tuple(block_ids), n, miss, None, 0.0)
        stale = tuple(i for i in self.stale if i < n)
        h.result.set_result(LoadOutcome(hid, len(block_ids), min([n, *stale]), miss, stale, (), 0.0))
        return h

    def wait_for_load(self, h: LoadHandle) -> None:
        self.device.current_waits.add(h.id)
        self.device.log.append(("wait", self.name, h.id))

    def store(self, block_ids, hashes, boundary=None) -> StoreHandle:  # noqa: ANN001
        self.stored.append((list(block_ids), boundary))
        h = StoreHandle(next(self.ids), tuple(block_ids), 0.0)
        reach = len(block_ids)
        if self.unreached_at is not None:
            reach = h.answered = h.unreached_from = self.unreached_at
            h.errors.append("reserve: TransportError: the keeper is gone")
        elif self.refused_at is not None:
            reach = h.answered = self.refused_at
            h.errors.append("reserve: InvalidRequest: refused")
        committed = min(self.capacity, reach)
        h.spilled = list(range(committed, reach))
        h.result.set_result(StoreOutcome(h.id, len(block_ids), committed, 0, 0, 0, len(h.spilled), 0,
                                         tuple(h.errors), committed * 8, 0.0))
        return h

    def poll(self):  # noqa: ANN201
        return []

    def close(self) -> None:
        self.closed = True


def keys(n: int) -> list[bytes]:
    return [f"h{i}".encode() for i in range(n)]


class Late:
    """A member not up at the start: building its engine raises until `up` holds its engine."""

    def __init__(self, exc: BaseException):
        self.exc, self.up, self.builds, self.graphs = exc, None, 0, []


def engine(cls=TieredEngine, **members):  # noqa: ANN001, ANN003, ANN201
    """A tiered engine over FakeEngines built from `members` (name -> FakeEngine, exception, or Late)."""
    backend = types.SimpleNamespace(names=tuple(members), members=tuple(members.values()))
    backend._member = lambda k: backend.members[k]

    def build(member, ns, layers, config):  # noqa: ANN001, ANN202
        if isinstance(member, Late):
            member.builds += 1
            member.graphs.append(config.graphs)
            if member.up is None:
                raise member.exc
            return member.up
        if isinstance(member, BaseException):
            raise member
        return member

    return cls(backend, None, [], TransferConfig(), build=build)


def installed(dev: Device, ids: list[int], hs: list[bytes], n: int) -> list[int]:
    """The byte-exact oracle: the blocks among the first n whose bytes are not their hash's page."""
    dev.run()
    return [i for i in range(n) if dev.blocks.get(ids[i]) != page(hs[i])]


def test_a_load_falls_through_to_the_host_pool_where_the_tier_stops_and_back():
    dev, hs = Device(), keys(10)
    tier = FakeEngine("gpu", dev, set(hs[:4]) | set(hs[6:]))
    host = FakeEngine("host", dev, set(hs[4:6]))
    e = engine(gpu=tier, host=host)
    ids = list(range(20, 30))
    h = e.load(ids, hs)
    assert isinstance(h, TieredLoadHandle) and h.loaded == 10 and h.miss is None and h.failed_block_ids == ()
    assert [(e.names[k], s, p.loaded) for k, s, p in h.parts] == [
        ("gpu", 0, 4), ("gpu", 4, 0), ("host", 4, 2), ("gpu", 6, 4)]
    assert installed(dev, ids, hs, 10) == []
    o = h.result.result()
    assert (o.loaded, o.stale, o.miss) == (10, (), None)


def test_control_first_tier_only_is_caught_by_the_loaded_count_and_the_miss():
    dev, hs = Device(), keys(10)
    tier, host = FakeEngine("gpu", dev, set(hs[:4])), FakeEngine("host", dev, set(hs))
    h = engine(FirstTierOnlyEngine, gpu=tier, host=host).load(list(range(10)), hs)
    assert h.loaded == 4 and h.miss.cause == MissCause.NEVER_PUBLISHED  # caught: the host held the rest


def test_a_corrupt_tier_page_is_loaded_from_the_host_pool_after_the_direct_install_wrote_it():
    """The tier's check fails at block 3 after its direct install wrote the page into the
    block; the host pool's load of blocks 3.. must land after that write."""
    dev, hs = Device(), keys(8)
    tier = FakeEngine("gpu", dev, set(hs), corrupt={hs[3]})
    host = FakeEngine("host", dev, set(hs))
    ids = list(range(8))
    h = engine(gpu=tier, host=host).load(ids, hs)
    assert h.loaded == 8 and h.miss is None
    assert installed(dev, ids, hs, 8) == []
    first_tier = h.parts[0][2].id
    host_load = dev.log.index(("load", "host", h.parts[-1][2].id))
    assert ("wait", "gpu", first_tier) in dev.log[:host_load]


def test_control_an_unordered_fall_through_is_caught_by_the_byte_exact_oracle():
    dev, hs = Device(), keys(8)
    tier = FakeEngine("gpu", dev, set(hs), corrupt={hs[3]})
    host = FakeEngine("host", dev, set(hs))
    ids = list(range(8))
    h = engine(UnorderedTieredEngine, gpu=tier, host=host).load(ids, hs)
    assert h.loaded == 8  # it claims every block
    assert installed(dev, ids, hs, 8) == [3]  # caught: block 3 holds the tier's failed page


def test_a_member_that_raises_is_its_miss_and_the_next_serves_every_member_raising_raises():
    dev, hs = Device(), keys(5)
    tier = FakeEngine("gpu", dev, set(hs), raises=TransportError("the keeper is gone"))
    host = FakeEngine("host", dev, set(hs[:3]))
    h = engine(gpu=tier, host=host).load(list(range(5)), hs)
    # at block 3 the tier raised again and the host never had it: the cause is the tier's
    assert h.loaded == 3 and h.miss.cause == MissCause.TRANSPORT_ERROR and h.miss.index == 3
    h = engine(gpu=tier, host=FakeEngine("host", dev, set())).load(list(range(5)), hs)
    assert h.loaded == 0 and h.miss.cause == MissCause.TRANSPORT_ERROR  # the first cause not never_published
    both = engine(gpu=tier, host=FakeEngine("host", dev, set(), raises=TransportError("and the pool")))
    with pytest.raises(TransportError, match="and the pool") as got:
        both.load(list(range(5)), hs)
    assert any("the keeper is gone" in n for n in got.value.__notes__)


def test_a_member_not_up_is_absent_not_asked_and_joins_once_it_answers(monkeypatch):
    monkeypatch.setattr(tiered_engine, "JOIN_EVERY_S", 0.0)
    dev, hs = Device(), keys(4)
    late = Late(TransferError("the GPU transfer engine needs the pool's arena mapped"))
    e = engine(gpu=late, host=FakeEngine("host", dev, set(hs[:2])))
    assert list(e.absent) == ["gpu"] and e.capabilities.path == "host"
    late.exc = TransportError("still down")  # what the composite's join raises while the keeper is down
    h = e.load(list(range(4)), hs)
    # served by the host pool; the miss is the host pool's (never_published), not the absent tier's
    assert h.loaded == 2 and {e.names[k] for k, _, _ in h.parts} == {"host"}
    assert h.miss.cause == MissCause.NEVER_PUBLISHED and list(e.absent) == ["gpu"]
    late.up = FakeEngine("gpu", dev, set(hs))  # the keeper answers
    h = e.load(list(range(4)), hs)
    assert h.loaded == 4 and {e.names[k] for k, _, _ in h.parts} == {"gpu"} and not e.absent
    assert late.graphs[-1] is False  # built with no graph captured beside the replica's forward


def test_a_late_member_is_tried_at_most_every_join_interval_and_one_that_cannot_fit_is_left_out(monkeypatch):
    dev, hs = Device(), keys(2)
    late = Late(TransportError("not up"))
    e = engine(gpu=late, host=FakeEngine("host", dev, set(hs)))
    for _ in range(3):
        e.load(list(range(2)), hs)
    assert late.builds == 1  # the start's try only: the next is JOIN_EVERY_S later
    monkeypatch.setattr(tiered_engine, "JOIN_EVERY_S", 0.0)
    e._next_join[0] = 0.0
    late.exc = KVLayoutError("a block is 9 bytes, the pool's pages 8")
    e.load(list(range(2)), hs)
    assert "gpu" in e.left_out and not e.absent
    n = late.builds
    e.load(list(range(2)), hs)
    assert late.builds == n  # left out for good


def test_a_member_that_answers_with_a_configuration_it_refuses_fails_the_start():
    dev = Device()
    refusing = FakeEngine("gpu", dev, set())
    refusing.arena = object()  # it answered: a mapping exists

    def build(member, ns, layers, config):  # noqa: ANN001, ANN202
        if member is refusing:
            raise TransferError("kv-sketch-1 stores only: the pages are device memory")
        return member

    backend = types.SimpleNamespace(names=("gpu", "host"), members=(refusing, FakeEngine("host", dev, set())))
    with pytest.raises(TransferError, match="device memory"):
        TieredEngine(backend, None, [], TransferConfig(), build=build)


def test_a_device_error_raises_and_pages_a_member_cannot_address_are_its_corrupt_miss():
    dev, hs = Device(), keys(3)
    broken = FakeEngine("gpu", dev, set(hs), raises=TransferError("cudaMemcpyAsync failed: error 700"))
    with pytest.raises(TransferError, match="error 700"):
        engine(gpu=broken, host=FakeEngine("host", dev, set(hs))).load(list(range(3)), hs)
    lying = FakeEngine("gpu", dev, set(hs), raises=ArenaError("pages -1..-1 lie outside the mapping"))
    h = engine(gpu=lying, host=FakeEngine("host", dev, set(hs[:1]))).load(list(range(3)), hs)
    assert h.loaded == 1 and h.miss.cause == MissCause.CORRUPT and h.miss.index == 1
    with pytest.raises(KVLayoutError):
        engine(gpu=KVLayoutError("a block is 9 bytes, the pool's pages 8"), host=FakeEngine("host", dev, set()))
    closed = FakeEngine("host", dev, set())
    with pytest.raises(KVLayoutError):  # raised after the members built before it
        engine(host=closed, gpu=KVLayoutError("a block is 9 bytes"))
    assert closed.closed
    with pytest.raises(TransportError, match="no pool") as got:  # the last member's error, the others noted
        engine(gpu=TransferError("no arena"), host=TransportError("no pool"))
    assert any("no arena" in n for n in got.value.__notes__)


def test_a_stale_page_cuts_the_outcome_in_the_run_numbering():
    dev, hs = Device(), keys(6)
    tier = FakeEngine("gpu", dev, set(hs[:2]))
    host = FakeEngine("host", dev, set(hs), stale=(1,))  # its block 1 is the run's block 3
    h = engine(gpu=tier, host=host).load(list(range(6)), hs)
    o = h.result.result()
    assert h.miss is None and o.loaded == 3 and o.stale == (3,)
    assert o.miss is not None and (o.miss.index, o.miss.cause) == (3, MissCause.CORRUPT)


def test_a_store_spills_what_the_tier_cannot_place_to_the_host_pool():
    dev = Device()
    tier, host = FakeEngine("gpu", dev, set(), capacity=3), FakeEngine("host", dev, set())
    e = engine(gpu=tier, host=host)
    o = e.store(list(range(10, 16)), keys(6)).result.result()
    assert tier.stored == [(list(range(10, 16)), None)] and host.stored == [([13, 14, 15], None)]
    assert (o.committed, o.no_capacity) == (6, 0)
    gone = FakeEngine("host", dev, set(), unreached_at=0)  # the host pool cannot be reached either
    o = engine(gpu=FakeEngine("gpu", dev, set(), capacity=3), host=gone).store(list(range(6)), keys(6)).result.result()
    assert (o.committed, o.no_capacity) == (3, 3)  # each block counted once: the 3 spilled nowhere placed
    refusing = FakeEngine("host", dev, set(), refused_at=0)  # it answered nothing: its reserve was refused
    o = engine(gpu=FakeEngine("gpu", dev, set(), capacity=3), host=refusing).store(list(range(6)), keys(6)).result.result()
    assert (o.committed, o.no_capacity) == (3, 3)  # the tier's no_capacity stands for what the host never answered
    full = FakeEngine("host", dev, set(), capacity=1)
    o = engine(gpu=FakeEngine("gpu", dev, set(), capacity=3), host=full).store(list(range(6)), keys(6)).result.result()
    assert (o.committed, o.no_capacity) == (4, 2)  # what the last member could not place stays no_capacity


def test_a_store_the_tier_could_not_reach_goes_on_with_what_is_left_of_the_boundary():
    dev = Device()
    tier = FakeEngine("gpu", dev, set(), capacity=1, unreached_at=2)  # placed 0, spilled 1, unreached 2..5
    host = FakeEngine("host", dev, set())
    o = engine(gpu=tier, host=host).store(list(range(6)), keys(6), boundary=4).result.result()
    assert host.stored == [([1, 2, 3, 4, 5], 3)]  # the spilled one admitted, then 2 of the unreached
    assert o.committed == 6 and "the keeper is gone" in o.errors[0]
    host2 = FakeEngine("host", dev, set())
    engine(gpu=FakeEngine("gpu", dev, set(), unreached_at=0), host=host2).store(list(range(3)), keys(3))
    assert host2.stored == [([0, 1, 2], None)]


def test_close_closes_every_member_engine():
    dev = Device()
    tier, host = FakeEngine("gpu", dev, set()), FakeEngine("host", dev, set())
    e = engine(gpu=tier, host=host)
    e.close()
    assert tier.closed and host.closed
    with pytest.raises(TransferError, match="closed"):
        e.load([0], keys(1))


def test_wait_for_load_waits_on_every_member_load():
    dev, hs = Device(), keys(4)
    e = engine(gpu=FakeEngine("gpu", dev, set(hs[:2])), host=FakeEngine("host", dev, set(hs)))
    h = e.load(list(range(4)), hs)
    dev.log.clear()
    e.wait_for_load(h)
    assert dev.log == [("wait", e.names[k], p.id) for k, _, p in h.parts]


def test_a_member_segment_refused_here_is_its_miss_not_a_failed_load():
    """A keeper restarted on another GPU: the tier engine's load refuses its new segment
    (RegionRefused); the host pool serves, and the tier's cause stays where it stopped."""
    dev, hs = Device(), keys(3)
    moved = FakeEngine("gpu", dev, set(hs), raises=RegionRefused("the tier's buffer lives on another GPU"))
    h = engine(gpu=moved, host=FakeEngine("host", dev, set(hs))).load(list(range(3)), hs)
    assert h.loaded == 3 and h.miss is None
    h = engine(gpu=moved, host=FakeEngine("host", dev, set())).load(list(range(3)), hs)
    assert h.loaded == 0 and h.miss.cause == MissCause.TRANSPORT_ERROR


def test_a_join_never_fails_the_load_that_tries_it(monkeypatch):
    monkeypatch.setattr(tiered_engine, "JOIN_EVERY_S", 0.0)
    dev, hs = Device(), keys(2)
    late = Late(TransportError("not up"))
    e = engine(gpu=late, host=FakeEngine("host", dev, set(hs)))
    late.exc = RuntimeError("CUDA out of memory")  # torch's, while the KV cache fills the GPU
    assert e.load(list(range(2)), hs).loaded == 2 and "gpu" in e.absent and "out of memory" in e.absent["gpu"]
    assert e.store(list(range(2)), hs).result.result().committed == 2
    late.exc = TransferError("the GPU transfer engine needs the pool's arena mapped")  # no mapping yet: absent
    e.load(list(range(2)), hs)
    assert "gpu" in e.absent and not e.left_out
    e.backend._member = lambda k: (_ for _ in ()).throw(InvalidRequest("refused"))
    e.load(list(range(2)), hs)
    assert "gpu" in e.absent and not e.left_out
    e.backend._member = lambda k: (_ for _ in ()).throw(MemberLeftOut("joined with pages of 9 bytes"))
    e.load(list(range(2)), hs)
    assert "gpu" in e.left_out and not e.absent  # the composite left it out: so does the engine
