"""One client connection of the pool daemon: the framing layer (kvpool.pool.daemon).

  Connection          an asyncio.Protocol: length-prefixed frames in, one reply each out,
                      in order; the pre-hello bounds; the hang-up of a client.
  ConnectionHost      what a connection uses of its daemon (PoolDaemon is one).

Contracts:
  * Every frame gets exactly one reply. A malformed, wrong-version or unauthenticated
    frame is answered with a typed Error and the connection stays usable; an oversized
    length prefix is answered and that connection is closed (its stream cannot be
    resynchronised). Other clients are never affected.
  * Bounded: at most `max_clients` authenticated connections and `max_queue` requests
    waiting for the thread pool; past either the reply is BUSY. Before its hello a
    connection takes no client slot: at most `max_unauthenticated` of them (a new one
    closes the oldest, with a BUSY error), each frame at most `max_hello_frame` bytes (a
    larger length prefix is answered and the connection closed before its bytes are
    read), and one that has not authenticated within `hello_timeout_s` gets an
    Unauthenticated error and is closed.
  * A client's open reservations and leases are dropped when its connection closes,
    and expire after their TTL in any case (an abandoned publish is reclaimed).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterator
from typing import Protocol

from kvpool.errors import Busy, ErrorCode, OversizedFrame, PoolError, Unauthenticated
from kvpool.pool import protocol as P
from kvpool.pool.config import PoolConfig
from kvpool.pool.metrics import PoolMetrics
from kvpool.pool.state import Session, TenantPool


class ConnectionHost(Protocol):
    """What a Connection uses of the daemon that accepted it (kvpool.pool.daemon.PoolDaemon)."""

    config: PoolConfig
    metrics: PoolMetrics
    pools: dict[str, TenantPool]
    _sessions: Iterator[int]
    _clients: dict[int, Connection]  # authenticated connections
    _unauthenticated: dict[int, Connection]  # connections still to say hello

    def _dispatch(self, session: Session, payload: bytes) -> bytes | Awaitable[bytes]: ...

    def _error(self, request_id: int, op_name: str, err: PoolError) -> bytes: ...

    def _wake_closed(self, tp: TenantPool) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection: frames are answered in order, one at a time. Ops whose work
    runs in the thread pool pause reading until their reply is written; a client that
    does not read its replies pauses reading too (the kernel buffers bound the queue).
    A lookup parked on a pending publish keeps reading, so that its client's hang-up is
    seen at once (and the lookup dropped); what the client sends meanwhile is buffered,
    up to one maximal frame, then reading pauses as for any other op."""

    def __init__(self, daemon: ConnectionHost):
        self.daemon = daemon
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.pending: asyncio.Future | None = None
        self.closed = False
        self.write_paused = False
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        d = self.daemon
        self.transport = transport  # type: ignore[assignment]
        self.session = Session(next(d._sessions), str(transport.get_extra_info("peername") or "unix"))
        if len(d._unauthenticated) >= d.config.max_unauthenticated:
            # Full of connections that have not said who they are: the oldest goes, so that a
            # flood of idle ones cannot keep a client that says hello at once from getting in.
            oldest = d._unauthenticated.pop(next(iter(d._unauthenticated)))
            d.metrics.requests.labels("connect", ErrorCode.BUSY.value).inc()
            oldest.transport.write(d._error(0, "hello", Busy(
                f"{d.config.max_unauthenticated} connections awaiting their hello: the oldest is closed")))
            oldest.close()
        d._unauthenticated[self.session.client] = self
        self._hello_timer = asyncio.get_running_loop().call_later(d.config.hello_timeout_s, self._hello_expired)

    def _hello_expired(self) -> None:
        if self.closed or self.session is None or self.session.tenant is not None:
            return
        d = self.daemon
        err = Unauthenticated(f"no successful hello within {d.config.hello_timeout_s} s")
        self.transport.write(d._error(0, "hello", err))
        self.close()

    def _authenticated(self) -> None:
        """The hello succeeded: the connection leaves the pre-auth pool for a client slot."""
        d = self.daemon
        d._unauthenticated.pop(self.session.client, None)
        d._clients[self.session.client] = self
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.pending is not None and len(self.buf) > self.daemon.config.frame_limit + P.LENGTH.size:
            self.transport.pause_reading()  # pipelined behind a parked lookup: bound the buffer
        self._pump()

    def _pump(self) -> None:
        d = self.daemon
        while self.pending is None and not self.closed and not self.write_paused:
            if len(self.buf) < P.LENGTH.size:
                return
            (n,) = P.LENGTH.unpack_from(self.buf)
            pre_auth = self.session.tenant is None
            limit = d.config.max_hello_frame if pre_auth else d.config.frame_limit
            if n > limit:
                err = OversizedFrame(f"frame of {n} bytes exceeds the limit of {limit}"
                                     + (" before a successful hello" if pre_auth else ""))
                self.transport.write(d._error(0, "frame", err))
                self.close()
                return
            if len(self.buf) < P.LENGTH.size + n:
                return
            payload = bytes(self.buf[P.LENGTH.size : P.LENGTH.size + n])
            del self.buf[: P.LENGTH.size + n]
            if pre_auth and len(d._clients) >= d.config.max_clients:
                self._refuse(payload)  # no client slot for it: BUSY, then closed
                return
            reply = d._dispatch(self.session, payload)
            if pre_auth and self.session.tenant is not None:
                self._authenticated()
            if isinstance(reply, bytes):
                self.transport.write(reply)
                continue
            if not self.session.waiting:
                self.transport.pause_reading()
            self.pending = asyncio.ensure_future(reply)
            self.pending.add_done_callback(self._replied)

    def _replied(self, task: asyncio.Future) -> None:
        self.pending = None
        if self.closed or task.cancelled():
            return
        self.transport.write(task.result())  # _finish turns every PoolError into a reply
        if not self.write_paused:
            self.transport.resume_reading()
        self._pump()

    def _refuse(self, payload: bytes) -> None:
        request_id = 0
        with contextlib.suppress(PoolError):
            request_id = P.decode_request(payload)[0]
        d = self.daemon
        err = Busy(f"too many clients (limit {d.config.max_clients})")
        self.transport.write(d._error(request_id, "connect", err))
        self.close()

    def pause_writing(self) -> None:
        self.write_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.pending is None:
            self.transport.resume_reading()
        self._pump()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        d = self.daemon
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self.session is not None:
            d._unauthenticated.pop(self.session.client, None)
        if self.session is not None:
            d._clients.pop(self.session.client, None)
            if self.session.waiting and self.pending is not None:
                self.pending.cancel()  # a lookup parked on a pending publish: nobody reads its answer
            tp = d.pools.get(self.session.tenant) if self.session.tenant is not None else None
            if tp is not None and tp.catalog is not None:
                tp.catalog.drop_client(self.session.client)
                d._wake_closed(tp)
