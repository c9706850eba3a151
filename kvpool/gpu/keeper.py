"""The GPU tier's owner: one process per GPU (or the pool daemon's host, a keeper per GPU)
allocates each tenant's device buffer, keeps the tier's bookkeeping (kvpool.gpu.tier) and hands
the buffers out over its attach socket (kvpool.gpu.handout). The replicas never own tier
memory: a replica that dies takes nothing of it with it, and the keeper's buffers outlive
every replica.

  GpuKeeper(config, run_dir, allocate, *, name, ticket_ttl_s, handout_timeout_s, clock)
      allocate(label, size) -> Allocation for each tenant (vmm_allocator(device) in production:
      cuMemCreate + one exported POSIX descriptor; memfd_allocation for the tests without a
      GPU: host memory behind the same protocol), plus its private state (generations, heartbeat).
      clock() (time.monotonic by default) dates the tickets: a test passes a clock of its own,
      so that a ticket expires when the test says, not when a slow start of a replica happens
      to outlast `ticket_ttl_s`.
      .start()                   bind run_dir/gpu-attach.sock (mode 0600; the run dir checked as
                                 the pool's: kvpool.pool.private_dir) and serve it on a thread.
      .mint_ticket(tenant)       a single-use ticket for one handout of that tenant's buffer,
                                 valid `ticket_ttl_s` by `clock` (the control plane's hello,
                                 kvpool.gpu.keeper_server, gives it out once the replica's tenant
                                 token checked, as the pool's hello does).
      .tier                      the GpuTier (its catalogs use the private states' generations).
      .peer_of(pid)              the tenant a process attached to, by SO_PEERCRED pid.
      .beat()                    the heartbeat into every private state.
      .register_client(client, pid, pidfd=None)
                                 a replica's tier client id and its process, by a pidfd: the
                                 socket's own (SO_PEERPIDFD, taken over) or one opened while it is
                                 connected (SO_PEERCRED's pid at its hello): no pid reuse can make
                                 the keeper watch another process.
      .client_gone(client)       its connection ended: GpuTier.disconnect; True if its
                                 reservations are quarantined until its process exits.
      .reap_exited()             the quarantined clients whose process has exited since (the
                                 pidfd readable): GpuTier.exited for each; returns them.
      .tier_lock                 every call into .tier holds it (these three and .demote take it
                                 themselves): the control plane's handlers and its maintenance
                                 thread (kvpool.gpu.keeper_server) never interleave on a catalog.
      .outcomes                  handouts by outcome (ok, refused, malformed, timeout, ...).
      .served(n)                 the outcomes once at least n handouts have ended (their
                                 connections closed), waiting for them.
      .demote(tenant, host, now, read_page=None)
                                 the demotion (kvpool.gpu.tier): when the tenant's free pages are
                                 below the low watermark, its least recently used pages are
                                 pinned, published to the host pool through `host` (a PoolClient
                                 of that tenant) under their keys with their kv-sketch-1 digests
                                 (`read_page(page, dst)` copies a page's bytes into the host
                                 reservation; by default the allocation's read: a
                                 device-to-host copy from the keeper's own mapping, or a
                                 memcpy from a host stand-in), and leave the GPU
                                 tier once the host pool committed them. Returns the outcomes.
                                 The tier lock is held for the bookkeeping only, not across the
                                 copy and the host pool's calls (the pages are pinned meanwhile).
      .stop()                    the serving thread ended (waited for: every step of its loop is
                                 bounded by the handout timeout), the socket closed and removed,
                                 the heartbeat set to 0 in every private state (stale at once for
                                 any replica still mapping it), the owner's handles dropped: the
                                 memory lives on in the replicas that mapped it until they unmap.
      .instance                  16 random bytes, new for every keeper: its hello, its descriptors
                                 and its private states carry it (a restarted keeper is another
                                 instance, with an empty tier).

Ordering across processes (kvpool.gpu.tier's docstring has the whole model): the keeper accepts
a commit only as the producer's statement that its host saw the copy into the pages and the
sketch of them complete, and frees a page only after every lease on it was released, which a
consumer does after its host saw its copy out complete. Both edges are host-side completions,
not interprocess events, because the digests must reach the host anyway (the producer's to
commit, the consumer's verdict to install or recompute): the wait costs nothing extra.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import mmap
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from kvpool.client.pool_client import PoolClient
from kvpool.errors import PoolError
from kvpool.gpu.handout import HandleKind, HandoutError, PrivateState, TierDescriptor, serve_handout
from kvpool.gpu.tier import Demotion, GpuTier, GpuTierConfig
from kvpool.gpu.vmm import DeviceBuffer, Vmm
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.pool.private_dir import ensure_private_dir
from kvpool.pool.records import EvictOutcome, SlotStatus

HOST_GRANULARITY = 4096


@dataclasses.dataclass
class Allocation:
    """A tenant's buffer as the keeper holds it: the descriptor it hands out (kept open; SCM_RIGHTS
    duplicates it into each replica), the keeper's own read of its bytes (`read(offset, dst)`:
    into a contiguous uint8 array, synchronously; what demotion copies) and how to drop the
    keeper's own handle and mapping."""

    kind: HandleKind
    fd: int
    size: int
    granularity: int
    device_uuid: bytes
    read: Callable[[int, np.ndarray], None]
    release: Callable[[], None]


def memfd_allocation(label: str, size: int) -> Allocation:
    """Host memory behind the GPU tier's protocol: the stand-in of the tests without a GPU."""
    size = (size + HOST_GRANULARITY - 1) // HOST_GRANULARITY * HOST_GRANULARITY
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError as exc:
        os.close(fd)
        raise HandoutError(f"cannot create a host stand-in buffer for {label!r}: {exc}") from exc

    def read(offset: int, dst: np.ndarray) -> None:
        dst[:] = np.frombuffer(mm, dtype=np.uint8, count=dst.size, offset=offset)

    def release() -> None:
        mm.close()
        os.close(fd)

    return Allocation(HandleKind.MEMFD, fd, size, HOST_GRANULARITY, bytes(16), read, release)


def vmm_allocator(device_index: int) -> Callable[[str, int], Allocation]:
    """Device memory on `device_index`, exported once as a POSIX descriptor."""
    vmm = Vmm(device_index)
    vmm.require_export()

    def allocate(label: str, size: int) -> Allocation:
        buf = DeviceBuffer.create(vmm, size)
        fd = buf.export_fd()
        mine = buf.map()  # the keeper's own view: demotion reads committed pages through it

        def read(offset: int, dst: np.ndarray) -> None:
            """Device to host, synchronous: the pages read are committed, so every write into
            them completed before their commit (the tier's commit edge)."""
            if not dst.flags.c_contiguous or offset < 0 or offset + dst.nbytes > mine.size:
                raise HandoutError(f"a read of {dst.nbytes} bytes at {offset} outside the buffer or into "
                                   f"a non-contiguous array")
            vmm.ensure_context()
            vmm._check(vmm.d.cuMemcpyDtoH(dst.ctypes.data, vmm.d.CUdeviceptr(mine.ptr + offset), dst.nbytes),
                       "cuMemcpyDtoH")

        def release() -> None:
            mine.close()
            os.close(fd)
            buf.release()

        return Allocation(HandleKind.VMM_POSIX_FD, fd, buf.size, vmm.granularity, vmm.uuid, read, release)

    allocate.vmm = vmm  # the keeper's own driver handle, for its mapping (demotion, scrub)
    return allocate


class GpuKeeper:
    def __init__(self, config: GpuTierConfig, run_dir: str | os.PathLike,
                 allocate: Callable[[str, int], Allocation], *, name: str = "gpu-tier",
                 ticket_ttl_s: float = 5.0, handout_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.run_dir = ensure_private_dir(run_dir)
        self.instance = secrets.token_bytes(16)
        self.ticket_ttl_s = ticket_ttl_s
        self.handout_timeout_s = handout_timeout_s
        self.buffers: dict[str, Allocation] = {}
        self.private: dict[str, PrivateState] = {}
        self._pidfds: dict[int, int] = {}  # tier client id -> pidfd of its process (-1: gone already)
        self.tier_lock = threading.RLock()  # held by every call into self.tier
        try:
            for tenant, pages in config.pages.items():
                label = f"kvgate:{name}:{tenant}"
                self.buffers[tenant] = allocate(label, pages * config.page_size)
                self.private[tenant] = PrivateState(label, config.page_size, pages, self.instance)
        except Exception:
            self._release()
            raise
        self.tier = GpuTier(config, {t: p.generations for t, p in self.private.items()})
        self.attach_path = self.run_dir / "gpu-attach.sock"
        self.outcomes: dict[str, int] = {}
        self._tickets: dict[bytes, tuple[str, float]] = {}
        self._peers: dict[int, str] = {}
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # a handout's connection ended (outcomes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None

    # -- tickets and handouts -------------------------------------------------------------
    def mint_ticket(self, tenant: str) -> bytes:
        if tenant not in self.buffers:
            raise HandoutError(f"tenant {tenant!r} has no buffer in this GPU tier")
        ticket = secrets.token_bytes(16)
        now = self.clock()
        with self._lock:
            # tickets never redeemed (a hello then a hang-up, an attach that failed) expire here:
            # a peer looping hellos cannot grow the table past what one TTL's hellos mint
            for old in [t for t, (_, deadline) in self._tickets.items() if deadline <= now]:
                del self._tickets[old]
            self._tickets[ticket] = (tenant, now + self.ticket_ttl_s)
        return ticket

    def descriptor(self, tenant: str) -> TierDescriptor:
        buf = self.buffers[tenant]
        desc = TierDescriptor(self.instance, buf.device_uuid, buf.kind, buf.size, self.config.page_size,
                              self.config.pages[tenant], buf.granularity, self.private[tenant].size)
        desc.check()
        return desc

    def _resolve(self, ticket: bytes, pid: int) -> tuple[TierDescriptor, list[int]] | None:
        with self._lock:
            entry = self._tickets.pop(ticket, None)
            if entry is None or entry[1] <= self.clock() or entry[0] not in self.buffers:
                return None
            self._peers[pid] = entry[0]
        tenant = entry[0]
        return self.descriptor(tenant), [self.buffers[tenant].fd, self.private[tenant].fd]

    def peer_of(self, pid: int) -> str | None:
        with self._lock:
            return self._peers.get(pid)

    def beat(self) -> None:
        for p in self.private.values():
            p.beat()

    # -- a replica's process --------------------------------------------------------------
    def register_client(self, client: int, pid: int, pidfd: int | None = None) -> None:
        """Watch `client`'s process: `pidfd` (taken over: the socket's SO_PEERPIDFD) or, without
        one, a pidfd of `pid` opened now (call while it is connected). A process already gone
        is recorded as exited."""
        if pidfd is None:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                pidfd = -1
        with self.tier_lock:
            old = self._pidfds.pop(client, None)
            if old is not None and old >= 0:
                os.close(old)
            self._pidfds[client] = pidfd

    def client_gone(self, client: int) -> bool:
        with self.tier_lock:
            self.tier.disconnect(client)
            if client in self.tier.quarantined():
                return True
            self._forget(client)
            return False

    def reap_exited(self) -> list[int]:
        ended = []
        with self.tier_lock:
            for client in sorted(self.tier.quarantined()):
                if not self.tier.holds_reservations(client):  # all expired (GpuTier.reap): nothing held
                    self.tier.exited(client)
                    self._forget(client)  # its pidfd too: a peer looping reserve-and-hang-up holds no fds
                    ended.append(client)
                    continue
                fd = self._pidfds.get(client)
                if fd is None:
                    continue  # never registered: held until its reservations' TTL (GpuTier.reap)
                if fd >= 0 and not select.select([fd], [], [], 0)[0]:
                    continue  # still running: its copies may still write
                self.tier.exited(client)
                self._forget(client)
                ended.append(client)
        return ended

    def _forget(self, client: int) -> None:
        fd = self._pidfds.pop(client, None)
        if fd is not None and fd >= 0:
            os.close(fd)

    # -- demotion to the host pool ---------------------------------------------------------
    def demote(self, tenant: str, host: PoolClient, now: float,
               read_page: Callable[[int, np.ndarray], None] | None = None) -> dict[str, int]:
        """One round of demotion for `tenant` (see the class docstring). A block the host pool
        has already counts as demoted; one it cannot take now (no capacity, not admitted, a
        publish of it in flight there, a failed call) stays on the GPU. `read_page(page, dst)`:
        by default the allocation's own read of the page."""
        if read_page is None:
            buf = self.buffers[tenant]

            def read_page(page: int, dst: np.ndarray) -> None:
                buf.read(self.tier.page_offset(page), dst)
        out = {"demoted": 0, "kept": 0, "failed": 0}
        by_ns: dict[Namespace, list[Demotion]] = {}
        with self.tier_lock:
            due = self.tier.demotion_due(tenant)
            if not due:
                return out
            for d in self.tier.begin_demotion(tenant, due, now):
                by_ns.setdefault(d.page.ns, []).append(d)
        for ns, batch in by_ns.items():
            for d, committed in zip(batch, self._publish_to_host(ns, batch, host, read_page)):
                with self.tier_lock:
                    outcome = self.tier.finish_demotion(d, committed)
                key = "failed" if outcome is None else ("demoted" if outcome == EvictOutcome.EVICTED else "kept")
                out[key] += 1
        return out

    def _publish_to_host(self, ns: Namespace, batch: list[Demotion], host: PoolClient,
                         read_page: Callable[[int, np.ndarray], None]) -> list[bool]:
        """Whether the host pool holds each block of `batch` once this returns."""
        try:
            res = host.reserve(ns, [d.page.key for d in batch], [d.page.length for d in batch])
        except PoolError:
            return [False] * len(batch)
        held = [s.status == SlotStatus.EXISTS for s in res.slots]
        placed = [i for i, s in enumerate(res.slots) if s.status == SlotStatus.RESERVED]
        if not placed:
            return held
        try:
            for i in placed:
                d = batch[i]
                view = host.reserved_view(res, i)
                if view is not None:
                    read_page(d.page.page, view[: d.page.length])
                else:  # the host pool's segment is not mapped here: the bytes go in a frame
                    buf = np.empty(d.page.length, dtype=np.uint8)
                    read_page(d.page.page, buf)
                    host.write_page(res, i, buf)
            result = host.commit(res.reservation_id, [batch[i].page.digest for i in placed], DigestKind.SKETCH)
        except PoolError:
            try:
                host.abort(res.reservation_id)
            except PoolError:
                pass  # the pool reclaims it at its TTL or when this connection drops
            return held
        rejected = {placed[j] for j in result.rejected}
        for i in placed:
            held[i] = i not in rejected
        return held

    # -- serving --------------------------------------------------------------------------
    def start(self) -> GpuKeeper:
        if self.attach_path.exists():
            self.attach_path.unlink()  # a socket a crashed keeper left behind
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.attach_path))
        os.chmod(self.attach_path, 0o600)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="gpu-keeper", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)

        async def accept() -> None:
            ready.set()
            while True:
                conn, _ = await loop.sock_accept(self._listener)
                task = loop.create_task(serve_handout(loop, conn, self._resolve, self.handout_timeout_s))
                task.add_done_callback(self._count)

        async def beat() -> None:
            while True:
                self.beat()
                await asyncio.sleep(0.1)

        loop.create_task(beat())
        try:
            loop.run_until_complete(accept())
        except asyncio.CancelledError:
            pass
        finally:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    def _count(self, task: asyncio.Task) -> None:
        outcome = "cancelled" if task.cancelled() else task.result()
        with self._ended:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self._ended.notify_all()

    def served(self, n: int, timeout: float | None = None) -> dict[str, int]:
        """The outcomes once at least `n` handouts have ended (each connection closed by then),
        or as they are when `timeout` (None: no bound) runs out first."""
        with self._ended:
            self._ended.wait_for(lambda: sum(self.outcomes.values()) >= n, timeout)
            return dict(self.outcomes)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            def cancel() -> None:
                for task in asyncio.all_tasks(self._loop):
                    task.cancel()
            self._loop.call_soon_threadsafe(cancel)
            # no bound: the loop runs nothing unbounded (a handout's blocking send is bounded by
            # handout_timeout_s), and the buffers below must outlive every step of it
            self._thread.join()
            self._thread = self._loop = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                self.attach_path.unlink()
            except FileNotFoundError:
                pass
        self._release()

    def _release(self) -> None:
        with self.tier_lock:
            for client in list(self._pidfds):
                self._forget(client)
        for buf in self.buffers.values():
            buf.release()
        for p in self.private.values():
            p.retire()  # a replica still mapping it judges this keeper stale at once
            p.close()
        self.buffers, self.private = {}, {}

    def __enter__(self) -> GpuKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
