"""The GPU transfer engine over tiers in lookup order (kvpool.gpu.tiered.TieredBackend: a keeper's
tier, then the host pool). One TransferEngine copies through one mapped region, and the composite
has two (the tier's device pages, the host pool's host pages): so each member gets an engine of
its own, over that member alone, and this class gives the connector's CUDA copier the one
engine's interface over them (kvpool.connector.gpu_copier.CudaCopier builds it for a TieredBackend).

  TieredEngine(backend, ns, layers, config, build=TransferEngine)
      An engine per member, built at the start with `build(member, ns, layers, config)`. A member
      that could not be reached (the composite's late member: a keeper not up yet, whose link has
      no mapping to copy through; or TransportError, PoolTimeout, Busy while building) is absent:
      it is not asked (its blocks' misses keep the causes the present members give), and it
      joins once it answers: at a load or a store at least JOIN_EVERY_S after the last try, the
      composite's own join (TieredBackend._member: a member of another page size is left out
      for good) and then its engine's build, with CUDA graphs off (none is captured while the
      replica's forward may run). A member that answers but whose engine cannot be built there
      (a TransferError, a layout error) is left out for good, logged (`left_out`); one whose
      build fails in torch (CUDA out of memory) stays absent and is tried again. At the start,
      any error but an unreachable member's is raised (a layout error, a configuration the
      member refuses); so is the last one where no member's engine could be built.
  .load(block_ids, hashes, deadline_s)   kvpool.gpu.tier.fall_through over the member engines'
      loads, as TieredBackend.acquire falls through over the members' acquires: each member engine
      is asked for the blocks from the first one not installed yet, the first that installs a
      run serves it, and where its run stops the first member is asked again. Each member's load
      leases, checks and installs its own run (each page by its member's digest kind); the
      loaded counts, the miss (the first block no member installed, its cause the first one other
      than never_published in member order) and the failed blocks are final at the return, as for
      one engine. Before a member is asked for blocks an earlier member's load was asked for (the
      whole tail of the run each time), the engine's current stream waits for that earlier load's
      copies: a direct install (kvpool.gpu.load) may have written a failed page into a block the
      next member then fills, and the later install must follow it (a stream wait, no host sync;
      only where a load falls through). A member's pool error is its miss for its run
      (kvpool.gpu.tiered.miss_cause_of; corrupt for pages its engine cannot take or address:
      KVLayoutError, ArenaError, CorruptPage), and the next member is asked; where every member
      raised at the first block, the last error is raised; so is a member's segment this engine
      cannot copy through (RegionRefused: a keeper restarted on another GPU, say), a miss of
      that member (transport_error). A TransferError of the device itself raises, as from one
      engine.
      The handle (TieredLoadHandle, a LoadHandle) resolves to one LoadOutcome once every member's
      lease was released: `loaded` the leading blocks installed and not stale, `stale` the block
      indexes any member found reused under its lease (in the run's numbering), and where a
      member's outcome cut the run short, the miss there (corrupt, or that member's cause).
  .store(block_ids, hashes, boundary)   the first present member's store; the blocks it answered
      NO_CAPACITY (a keeper's tier evicts nothing to make room) and, where its reserve could not
      reach its pool (TransportError, PoolTimeout, Busy) or the pool restarted under it, the
      blocks from that unit on, are
      stored by the next member's engine in the same call (the spilled first and admitted, the
      unreached after them under what is left of the boundary), and so on. Each member's store
      orders its copies after the engine's writes and the engine's later writes after its reads
      before it returns, so the caller may reuse the blocks at once, as with one engine. The
      handle resolves to one StoreOutcome after every member's last commit, each block counted
      once: a block one member answered NO_CAPACITY and the next placed counts as the next
      answered it, and a block no member could be asked about counts NO_CAPACITY (as
      TieredBackend.reserve answers it).
  .wait_for_load(handle), .poll(), .drain(), .close(), .layout, .ns, .capabilities (the first
      present member's; `member_capabilities` names each)   as TransferEngine's, over the members.

What it is not: a path through a wrapper of the composite backend. The member engines speak to the
members themselves (as one engine speaks to its backend), so a wrapper around the TieredBackend
(the audit's, a fault injector's) sees the lookups the scheduler makes, not the member engines'
leases and reservations.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from kvpool.errors import ArenaError, CorruptPage, MissCause, PoolError
from kvpool.gpu.config import KVLayoutError, RegionRefused, TransferConfig, TransferError
from kvpool.gpu.events import resolve_when_all
from kvpool.gpu.load import LoadHandle, LoadOutcome
from kvpool.gpu.store import StoreHandle, StoreOutcome
from kvpool.gpu.tier import UNREACHABLE, MemberCall, ask_in_order, fall_through, raise_first
from kvpool.gpu.tiered import MemberLeftOut, TieredBackend, miss_cause_of
from kvpool.gpu.transfer import TransferEngine
from kvpool.pool.keys import Namespace
from kvpool.pool.records import Miss

log = logging.getLogger("kvpool.gpu.transfer")

JOIN_EVERY_S = 5.0  # an absent member is tried again at most this often

EngineBuilder = Callable[..., TransferEngine]


def _cause(exc: PoolError) -> MissCause | None:
    """A member engine's error as its miss (kvpool.gpu.tier.ask_in_order), or None for the
    device's own failure, raised as from one engine."""
    if isinstance(exc, TransferError) and not isinstance(exc, (KVLayoutError, RegionRefused)):
        return None
    if isinstance(exc, (KVLayoutError, ArenaError, CorruptPage)):
        return MissCause.CORRUPT  # pages the member's engine cannot take or address
    return miss_cause_of(exc)  # RegionRefused (a restarted member's segment refused here): transport_error


class TieredLoadHandle(LoadHandle):
    """A load over the members: `parts` are (member, first block, the member engine's handle)."""

    __slots__ = ("parts",)

    def __init__(self, hid: int, block_ids: tuple[int, ...], loaded: int, miss: Miss | None, t0: float,
                 parts: list[tuple[int, int, LoadHandle]]):
        super().__init__(hid, block_ids, loaded, miss, None, t0)  # type: ignore[arg-type] - its parts' events
        self.parts = parts


class TieredEngine:
    def __init__(self, backend: TieredBackend, ns: Namespace, layers: Sequence[torch.Tensor],
                 config: TransferConfig = TransferConfig(), build: EngineBuilder = TransferEngine):
        self.backend = backend
        self.ns = ns
        self.config = config
        self.names = tuple(backend.names)
        self._build, self._layers = build, list(layers)
        self.engines: list[TransferEngine | None] = []
        self.absent: dict[str, str] = {}  # member name -> why it has no engine yet (it joins when it answers)
        self.left_out: dict[str, str] = {}  # member name -> why it never will
        self._next_join: dict[int, float] = {}
        errors: list[BaseException] = []
        try:
            for k, (name, member) in enumerate(zip(self.names, backend.members)):
                try:
                    self.engines.append(build(member, ns, layers, config))
                except UNREACHABLE as exc:
                    errors.append(self._absent(k, exc))
                except TransferError as exc:
                    if isinstance(exc, KVLayoutError) or getattr(member, "arena", None) is not None:
                        raise  # it answered: its pages or the configuration do not fit
                    errors.append(self._absent(k, exc))  # no mapping yet: a keeper not up
            if not any(e is not None for e in self.engines):
                raise_first(errors[::-1], "no member's engine could be built")
        except BaseException:
            self._close_engines()
            raise
        first = next(e for e in self.engines if e is not None)
        self.layout = first.layout
        self.capabilities = first.capabilities
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def direct_loads(self) -> int:
        """The member loads that took the direct install (TransferEngine.direct_loads), all members."""
        return sum(getattr(e, "direct_loads", 0) for e in self.engines if e is not None)

    @property
    def member_capabilities(self) -> dict[str, object]:
        return {n: e.capabilities for n, e in zip(self.names, self.engines) if e is not None}

    def _absent(self, k: int, exc: BaseException) -> BaseException:
        name = self.names[k]
        exc.add_note(f"the engine of tier member {name!r}")
        self.engines.append(None)
        self.absent[name] = f"{type(exc).__name__}: {exc}"
        self._next_join[k] = time.monotonic() + JOIN_EVERY_S
        log.warning("kvpool GPU transfer: tier member %r has no engine yet (%s): the other members serve until "
                    "it answers", name, self.absent[name])
        return exc

    def _engine(self, k: int) -> TransferEngine | None:
        """Member k's engine; an absent member tried again (at most every JOIN_EVERY_S). A join
        never fails the load or store that tries it: what it meets is logged and kept in
        `absent` (tried again) or `left_out` (never again)."""
        engine = self.engines[k]
        name = self.names[k]
        if engine is not None or name in self.left_out or time.monotonic() < self._next_join.get(k, 0.0):
            return engine
        self._next_join[k] = time.monotonic() + JOIN_EVERY_S
        try:
            member = self.backend._member(k)  # noqa: SLF001 - the composite's own join (page size, left out)
        except MemberLeftOut as exc:  # the composite left it out (another page size): so does the engine
            return self._leave_out(name, exc)
        except PoolError as exc:  # not up yet, or its answer refused: asked again later
            self.absent[name] = f"{type(exc).__name__}: {exc}"
            return None
        try:
            engine = self._build(member, self.ns, self._layers, dataclasses.replace(self.config, graphs=False))
        except UNREACHABLE as exc:
            self.absent[name] = f"{type(exc).__name__}: {exc}"
            return None
        except TransferError as exc:
            if not isinstance(exc, KVLayoutError) and getattr(member, "arena", None) is None:
                self.absent[name] = f"{type(exc).__name__}: {exc}"  # no mapping yet
                return None
            return self._leave_out(name, exc)  # it answered, and its pages do not fit this engine
        except (RuntimeError, MemoryError) as exc:  # torch's (CUDA out of memory, a stream): asked again later
            self.absent[name] = f"{type(exc).__name__}: {exc}"
            log.warning("kvpool GPU transfer: tier member %r answered, and building its engine failed (%s): tried "
                        "again in %.0f s", name, self.absent[name], JOIN_EVERY_S)
            return None
        if engine.layout != self.layout:
            engine.close()
            return self._leave_out(name, KVLayoutError("its engine's layout differs from the other members'"))
        self.engines[k] = engine
        self.absent.pop(name, None)
        log.info("kvpool GPU transfer: tier member %r answered: its engine serves from now on", name)
        return engine

    def _leave_out(self, name: str, exc: BaseException) -> None:
        self.left_out[name] = f"{type(exc).__name__}: {exc}"
        self.absent.pop(name, None)
        log.error("kvpool GPU transfer: tier member %r cannot have an engine here (%s): left out", name,
                  self.left_out[name])

    @property
    def present(self) -> list[tuple[int, TransferEngine]]:
        return [(k, e) for k, e in enumerate(self.engines) if e is not None]

    def _check_ids(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> tuple[int, ...]:
        if self._closed:
            raise TransferError("the transfer engine is closed")
        return self.present[0][1]._check_ids(block_ids, hashes)

    # -- loads ----------------------------------------------------------------------------------
    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes], deadline_s: float | None = None) -> LoadHandle:
        ids = self._check_ids(block_ids, hashes)
        t0 = time.monotonic()
        parts: list[tuple[int, int, LoadHandle]] = []  # every member load made, installed or not

        def call_of(k: int) -> MemberCall:
            def call(tail: Sequence[bytes], start: int) -> tuple[int, Miss | None, LoadHandle]:
                self._after(parts)
                left = None if deadline_s is None else max(0.0, deadline_s - (time.monotonic() - t0))
                h = self.engines[k].load(ids[start:], tail, deadline_s=left)
                parts.append((k, start, h))
                return h.loaded, h.miss, h
            return call

        asked = [k for k in range(len(self.engines)) if self._engine(k) is not None]
        try:
            served, miss = ask_in_order(hashes, [(self.names[k], call_of(k)) for k in asked], _cause, [],
                                        self._fall_through)
        except BaseException:
            self._settle_parts(parts)
            raise
        handle = TieredLoadHandle(next(self._ids), ids, served, miss, t0, parts)
        self._resolve_load(handle)
        return handle

    def _fall_through(self, hashes: Sequence[bytes], runs: list):  # noqa: ANN202 - a FallThrough
        """The lookup order over the member engines' loads (kvpool.gpu.tier.fall_through)."""
        return fall_through(hashes, runs)

    def _after(self, parts: Sequence[tuple[int, int, LoadHandle]]) -> None:
        """The next member load installs after the earlier ones of this run: each was asked for
        every block from its start to the run's end, and a direct install may have written a
        failed page into a block the next one fills."""
        for k, _, h in parts:
            self.engines[k].wait_for_load(h)

    def _settle_parts(self, parts: Sequence[tuple[int, int, LoadHandle]]) -> None:
        """Wait for the member loads already made (a load that raised midway): their leases are
        released by their own engines; nothing of them is installed past what they counted."""
        cf.wait([h.result for _, _, h in parts])

    def _resolve_load(self, handle: TieredLoadHandle) -> None:
        resolve_when_all([h.result for _, _, h in handle.parts], handle.result, lambda: self._load_outcome(handle))

    def _load_outcome(self, handle: TieredLoadHandle) -> LoadOutcome:
        loaded, miss, stale, errors = handle.loaded, handle.miss, set(), []
        for _, start, h in handle.parts:
            o: LoadOutcome = h.result.result()  # a member engine's own error re-raises here
            stale.update(start + i for i in o.stale)
            errors.extend(o.errors)
            if o.loaded < h.loaded and start + o.loaded < loaded:  # cut there: reused under the lease, unverified
                loaded = start + o.loaded
                cause = o.miss.cause if o.miss is not None else MissCause.CORRUPT
                miss = Miss(loaded, cause)
        return LoadOutcome(handle.id, handle.requested, loaded, miss, tuple(sorted(stale)), tuple(errors),
                           time.monotonic() - handle._t0)

    def wait_for_load(self, handle: LoadHandle) -> None:
        """The engine's current stream waits for every member load's copies (no host sync)."""
        for k, _, h in handle.parts:  # type: ignore[attr-defined]
            self.engines[k].wait_for_load(h)

    wait = wait_for_load

    # -- stores ---------------------------------------------------------------------------------
    def store(self, block_ids: Sequence[int], hashes: Sequence[bytes], boundary: int | None = None) -> StoreHandle:
        ids = self._check_ids(block_ids, hashes)
        handle = StoreHandle(next(self._ids), ids, time.monotonic())
        parts: list[StoreHandle] = []
        todo, bound = list(range(len(ids))), boundary  # positions in `ids` still to place
        counted: set[int] = set()  # positions an earlier member counted NO_CAPACITY
        twice = 0  # of those, the ones a later member answered (counted again there)
        try:
            for k in range(len(self.engines)):
                engine = self._engine(k)
                if engine is None or not todo:
                    continue
                h = engine.store([ids[i] for i in todo], [hashes[i] for i in todo], bound)
                parts.append(h)
                cut = h.unreached_from
                answered = set(todo[: h.answered])
                twice += len(counted & answered)
                spilled = [todo[i] for i in h.spilled]
                counted = (counted - answered) | set(spilled)
                unreached = [] if cut is None else todo[cut:]
                # the spilled were admitted where they were offered; the unreached keep what is left of the boundary
                bound = len(spilled) + max(0, bound - cut) if unreached and bound is not None else None
                todo = spilled + unreached
        except BaseException:
            cf.wait([h.result for h in parts])
            raise
        nowhere = len(set(todo) - counted)  # no member answered them: NO_CAPACITY, as the composite's reserve says
        self._resolve_store(handle, parts, nowhere - twice)
        return handle

    def _resolve_store(self, handle: StoreHandle, parts: Sequence[StoreHandle], no_capacity_delta: int) -> None:
        def outcome() -> StoreOutcome:
            outs: list[StoreOutcome] = [h.result.result() for h in parts]
            return StoreOutcome(
                handle.id, handle.requested, sum(o.committed for o in outs), sum(o.exists for o in outs),
                sum(o.pending for o in outs), sum(o.not_admitted for o in outs),
                sum(o.no_capacity for o in outs) + no_capacity_delta, sum(o.rejected for o in outs),
                tuple(e for o in outs for e in o.errors), sum(o.bytes_committed for o in outs),
                time.monotonic() - handle._t0)

        resolve_when_all([h.result for h in parts], handle.result, outcome)

    # -- the rest of the engine's interface -----------------------------------------------------
    def poll(self) -> list[StoreOutcome | LoadOutcome]:
        return [o for _, e in self.present for o in e.poll()]

    def drain(self, timeout_s: float | None = None) -> list[StoreOutcome | LoadOutcome]:
        return [o for _, e in self.present for o in e.drain(timeout_s)]

    def _close_engines(self) -> None:
        errors: list[BaseException] = []
        for name, engine in zip(self.names, self.engines):
            if engine is None:
                continue
            try:
                engine.close()
            except BaseException as exc:  # noqa: BLE001 - raised below, once every engine was closed
                exc.add_note(f"closing the engine of tier member {name!r}")
                errors.append(exc)
        raise_first(errors, "closing")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_engines()

    def __enter__(self) -> TieredEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
