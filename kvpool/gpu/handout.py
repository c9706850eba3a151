"""The GPU tier's handout: a tenant's device buffer (and the keeper's private state for it)
travels as file descriptors over a Unix socket, as the host pool's segments do
(kvpool.pool.attach), with a descriptor that says what they are. No CUDA here: the
descriptors are plain file descriptors (SCM_RIGHTS), a VMM export (kvpool.gpu.vmm) in
production, a memfd in the tests that run without a GPU.

  request  (client -> keeper)  REQUEST: magic b"KVGT", version, 0, the 16-byte ticket.
  answer   (keeper -> client)  ANSWER: magic, version, status, body length; then the body.
           status OK: the body is a DESCRIPTOR and the one message carries exactly
           TierDescriptor.FDS descriptors (SCM_RIGHTS): the device buffer, then the
           private state (a sealed memfd the client maps read-only).
           status REFUSED (an unknown, expired or used ticket) or WRONG_VERSION: no body,
           no descriptor.

  serve_handout(loop, conn, resolve, timeout_s) -> str   the keeper's side of one connection:
        read the request within the timeout, `resolve(ticket)` to (TierDescriptor, fds) or
        None, answer, close. Returns the outcome ("ok", "refused", "malformed", "timeout",
        "transport_error"); never raises for what a peer sends.
  fetch_handout(path, ticket, timeout_s, trusted_uids) -> (TierDescriptor, fds)
        the client's side: SO_PEERCRED first (the listener must run as a trusted user, or
        nothing is sent), then the request, then the answer checked field by field; on any
        failure every descriptor received is closed and a typed error raised: HandoutRefused,
        MalformedHandout (a frame that is not the protocol's, a truncated one, the wrong
        number of descriptors, a descriptor whose fields do not add up), UntrustedPool
        (kvpool.errors), TransportError (no socket there, a reset, a timeout).

The private state (PrivateState, the keeper's; PrivateView, a replica's): a memfd of a 4 KiB
header (magic, layout version, page size, pages, the keeper's instance id; at byte 512 the
keeper's heartbeat, CLOCK_MONOTONIC nanoseconds; 0 once the keeper stopped) and the generation of every page (uint64,
from byte 4096): the catalog's own array (kvpool.gpu.tier), so a replica checks that a page
still holds what it leased without asking. Sealed as the host pool's private segment is
(kvpool.pool.arena): its size cannot change, and after the keeper mapped it, nobody can write
it (F_SEAL_FUTURE_WRITE): a replica maps it read-only or not at all.

TierDescriptor: the keeper's instance id, the GPU's UUID (a replica compares it with its own
device's: the same GPU loads by device-to-device copy, another by a peer copy), the handle
kind (VMM_POSIX_FD, or MEMFD where the pages are host memory: the tests' stand-in), the bytes
of the buffer, its page size and number of pages (page i at i x page_size), the allocation
granularity (the buffer's size is a multiple of it) and the private state's bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import fcntl
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from kvpool.errors import PoolError, TransportError, UntrustedPool

MAGIC = b"KVGT"
VERSION = 1
TICKET_BYTES = 16
REQUEST = struct.Struct("<4sHH16s")  # magic, version, reserved (0), ticket
ANSWER = struct.Struct("<4sHHI")  # magic, version, status, body length
DESCRIPTOR = struct.Struct("<16s16sIIQQQQQ")  # instance, device uuid, kind, 0, size, page, pages, granularity, private
_UCRED = struct.Struct("3i")


class HandoutError(PoolError):
    """The GPU tier's handout failed; the client maps nothing (every descriptor it received
    is closed)."""


class HandoutRefused(HandoutError):
    """The keeper refused the ticket (unknown, expired, used, or its tenant is gone)."""


class MalformedHandout(HandoutError):
    """The keeper's answer is not the protocol's: bad magic, version or status, a truncated
    frame, the wrong number of descriptors, or a descriptor whose fields do not add up."""


class Status(enum.IntEnum):
    OK = 0
    REFUSED = 1
    WRONG_VERSION = 2


class HandleKind(enum.IntEnum):
    VMM_POSIX_FD = 1  # cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    MEMFD = 2  # host memory: the stand-in of the tests without a GPU


@dataclasses.dataclass(frozen=True)
class TierDescriptor:
    instance: bytes
    device_uuid: bytes
    kind: HandleKind
    size: int
    page_size: int
    num_pages: int
    granularity: int
    private_size: int

    FDS = 2  # the device buffer, then the private state

    def check(self) -> None:
        """MalformedHandout unless the fields add up."""
        problems = []
        if len(self.instance) != 16 or len(self.device_uuid) != 16:
            problems.append("instance and device uuid are 16 bytes each")
        if self.page_size <= 0 or self.num_pages <= 0:
            problems.append(f"page size {self.page_size} and pages {self.num_pages} must be positive")
        if self.granularity <= 0 or self.size <= 0 or self.size % self.granularity:
            problems.append(f"size {self.size} is not a positive multiple of the granularity {self.granularity}")
        if self.page_size * self.num_pages > self.size:
            problems.append(f"{self.num_pages} pages of {self.page_size} bytes do not fit {self.size} bytes")
        if self.private_size < 8 * self.num_pages:
            problems.append(f"a private state of {self.private_size} bytes holds no generation per page")
        if problems:
            raise MalformedHandout("the tier's descriptor does not add up: " + "; ".join(problems))

    def pack(self) -> bytes:
        return DESCRIPTOR.pack(self.instance, self.device_uuid, int(self.kind), 0, self.size, self.page_size,
                               self.num_pages, self.granularity, self.private_size)

    @classmethod
    def unpack(cls, body: bytes) -> TierDescriptor:
        if len(body) != DESCRIPTOR.size:
            raise MalformedHandout(f"a descriptor of {len(body)} bytes, expected {DESCRIPTOR.size}")
        instance, uuid, kind, _, size, page, pages, gran, private = DESCRIPTOR.unpack(body)
        try:
            kind = HandleKind(kind)
        except ValueError as exc:
            raise MalformedHandout(f"unknown handle kind {kind}") from exc
        desc = cls(instance, uuid, kind, size, page, pages, gran, private)
        desc.check()
        return desc


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


Resolver = Callable[[bytes, int], "tuple[TierDescriptor, Sequence[int]] | None"]


async def serve_handout(loop: asyncio.AbstractEventLoop, conn: socket.socket, resolve: Resolver,
                        timeout_s: float) -> str:
    """One handout connection, closed on return. `resolve(ticket, peer_pid)` gives the
    ticket's (descriptor, fds) or None; the fds stay the caller's (SCM_RIGHTS duplicates
    them into the peer). What a peer sends never raises here: the outcome says what it was."""
    try:
        conn.setblocking(False)
        request = b""
        try:
            async with asyncio.timeout(timeout_s):
                while len(request) < REQUEST.size:
                    chunk = await loop.sock_recv(conn, REQUEST.size - len(request))
                    if not chunk:
                        break
                    request += chunk
        except TimeoutError:
            return "timeout"
        if len(request) != REQUEST.size:
            return "malformed"
        magic, version, _, ticket = REQUEST.unpack(request)
        if magic != MAGIC:
            return "malformed"
        if version != VERSION:
            await loop.sock_sendall(conn, ANSWER.pack(MAGIC, VERSION, Status.WRONG_VERSION, 0))
            return "wrong_version"
        pid, _, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        found = resolve(ticket, pid)
        if found is None:
            await loop.sock_sendall(conn, ANSWER.pack(MAGIC, VERSION, Status.REFUSED, 0))
            return "refused"
        desc, fds = found
        body = desc.pack()
        conn.setblocking(True)  # one sendmsg with the descriptors; the answer is small
        conn.settimeout(timeout_s)
        socket.send_fds(conn, [ANSWER.pack(MAGIC, VERSION, Status.OK, len(body)) + body], list(fds))
        return "ok"
    except OSError:  # the peer went away or did not read: it gets nothing, nobody else is touched
        return "transport_error"
    finally:
        conn.close()


def verify_listener(sock: socket.socket, what: str, trusted_uids: Collection[int]) -> None:
    """The kernel's word (SO_PEERCRED) on who listens: one of `trusted_uids`, or UntrustedPool."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if uid not in trusted_uids:
        raise UntrustedPool(f"{what}: the process listening there (pid {pid}) runs as uid {uid}, not as "
                            f"{' or '.join(map(str, sorted(trusted_uids)))}: nothing was sent to it")


def fetch_handout(path: str, ticket: bytes, timeout_s: float = 5.0,
                  trusted_uids: Collection[int] | None = None) -> tuple[TierDescriptor, list[int]]:
    """Trade `ticket` for the tier's descriptor and its descriptors (the caller owns them)."""
    if len(ticket) != TICKET_BYTES:
        raise HandoutError(f"a ticket has {TICKET_BYTES} bytes, got {len(ticket)}")
    trusted = frozenset({os.geteuid(), 0} if trusted_uids is None else trusted_uids)
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            verify_listener(sock, f"the GPU tier's attach socket {path!r}", trusted)
            sock.sendall(REQUEST.pack(MAGIC, VERSION, 0, ticket))
            data, fds, flags, _ = socket.recv_fds(sock, ANSWER.size + DESCRIPTOR.size, TierDescriptor.FDS + 1)
            if flags & socket.MSG_CTRUNC:
                raise MalformedHandout("the answer carried more descriptors than the protocol's (truncated)")
            if len(data) < ANSWER.size:
                raise MalformedHandout(f"an answer of {len(data)} bytes, shorter than its header")
            magic, version, status, length = ANSWER.unpack_from(data)
            if magic != MAGIC or version != VERSION:
                raise MalformedHandout(f"an answer with magic {magic!r} and version {version}")
            if status == Status.REFUSED:
                raise HandoutRefused(f"the GPU tier at {path!r} refused the ticket")
            if status == Status.WRONG_VERSION:
                raise MalformedHandout(f"the GPU tier at {path!r} does not speak version {VERSION}")
            if status != Status.OK:
                raise MalformedHandout(f"an answer with unknown status {status}")
            body = data[ANSWER.size:]
            if length != DESCRIPTOR.size or len(body) != length:
                raise MalformedHandout(f"an answer announcing {length} bytes of body with {len(body)} "
                                       f"(a descriptor has {DESCRIPTOR.size})")
            desc = TierDescriptor.unpack(body)
            if len(fds) != TierDescriptor.FDS:
                raise MalformedHandout(f"an answer with {len(fds)} descriptors, expected {TierDescriptor.FDS}")
            return desc, list(fds)
    except (HandoutError, UntrustedPool):
        _close_all(fds)
        raise
    except TimeoutError as exc:
        _close_all(fds)
        raise TransportError(f"the GPU tier's attach socket {path!r} did not answer within {timeout_s}s") from exc
    except OSError as exc:
        _close_all(fds)
        raise TransportError(f"the GPU tier's attach socket {path!r}: {exc}") from exc


# -- the private state --------------------------------------------------------------------------

PRIVATE_MAGIC = b"KVGTPRIV"
PRIVATE_VERSION = 1
PRIVATE_HEADER = struct.Struct("<8sIQQ16s")  # magic, version, page size, pages, instance
HEARTBEAT_OFF = 512
GENERATIONS_OFF = 4096
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux >= 5.1
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def heartbeat_word(buf: mmap.mmap) -> np.ndarray:
    """The heartbeat as one aligned 64-bit word of the mapping: the keeper writes it and a replica
    reads it with a single 8-byte store and load, so a reader never sees half of one beat and
    half of another. (struct.pack_into and unpack_from move the bytes one at a time: on the
    H200 a replica once read a beating keeper's heartbeat as more than 30 s old, and the same
    check a moment later as 0.00 s, and failed a transfer with KeeperStale.)"""
    return np.frombuffer(buf, dtype=np.uint64, count=1, offset=HEARTBEAT_OFF)


def private_size(num_pages: int) -> int:
    return (GENERATIONS_OFF + 8 * num_pages + 4095) // 4096 * 4096


class PrivateState:
    """The keeper's private state of one tenant's buffer: it alone writes it."""

    def __init__(self, label: str, page_size: int, num_pages: int, instance: bytes):
        self.size = private_size(num_pages)
        self.fd = os.memfd_create(f"{label}:private", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            PRIVATE_HEADER.pack_into(self._map, 0, PRIVATE_MAGIC, PRIVATE_VERSION, page_size, num_pages, instance)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SIZE_SEALS | F_SEAL_FUTURE_WRITE)
        except OSError as exc:
            os.close(self.fd)
            raise HandoutError(f"cannot create the GPU tier's private state for {label!r}: {exc}") from exc
        self.generations = np.frombuffer(self._map, dtype=np.uint64, count=num_pages, offset=GENERATIONS_OFF)
        self._heartbeat = heartbeat_word(self._map)
        self.beat()

    def beat(self, now_ns: int | None = None) -> None:
        """The heartbeat is now (CLOCK_MONOTONIC, one clock for the host), or `now_ns`."""
        self._heartbeat[0] = time.monotonic_ns() if now_ns is None else now_ns

    def retire(self) -> None:
        """The heartbeat set to 0 (never): a keeper that stops says so at once to every replica that
        still maps this state, which judges it stale without waiting out the bound."""
        self._heartbeat[0] = 0

    def close(self) -> None:
        self.generations = self._heartbeat = None  # the arrays' exports of the mapping go first
        try:
            self._map.close()
        except BufferError:
            pass  # a view still exists: the mapping goes with it
        os.close(self.fd)


class PrivateView:
    """A replica's read-only view of the keeper's private state."""

    def __init__(self, fd: int, desc: TierDescriptor):
        """Maps `fd` read-only (the caller keeps and closes `fd`); MalformedHandout unless it is
        sealed and its header is the descriptor's."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise MalformedHandout(f"the private state handed over is not a sealed memfd: {exc}") from exc
        if seals & SIZE_SEALS != SIZE_SEALS or not seals & F_SEAL_FUTURE_WRITE:
            raise MalformedHandout(f"the private state handed over is not sealed (seals {seals:#x})")
        if size != desc.private_size or size < private_size(desc.num_pages):
            raise MalformedHandout(f"a private state of {size} bytes, the descriptor says {desc.private_size}")
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        magic, version, page, pages, instance = PRIVATE_HEADER.unpack_from(self._map, 0)
        if (magic, version, page, pages, instance) != (PRIVATE_MAGIC, PRIVATE_VERSION, desc.page_size,
                                                       desc.num_pages, desc.instance):
            self._map.close()
            raise MalformedHandout("the private state's header is not the descriptor's (magic, version, "
                                   "geometry or instance)")
        self.generations = np.frombuffer(self._map, dtype=np.uint64, count=pages, offset=GENERATIONS_OFF)
        self._heartbeat = heartbeat_word(self._map)

    def generation(self, page: int) -> int:
        return int(self.generations[page])

    def heartbeat_ns(self) -> int:
        """The keeper's last heartbeat, CLOCK_MONOTONIC nanoseconds (one clock for the host)."""
        return int(self._heartbeat[0])

    def heartbeat_age_s(self) -> float:
        return (time.monotonic_ns() - self.heartbeat_ns()) / 1e9

    def close(self) -> None:
        self.generations = self._heartbeat = None
        try:
            self._map.close()
        except BufferError:
            pass
