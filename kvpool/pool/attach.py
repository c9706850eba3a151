"""The pool daemon's handout of a tenant's segments over the attach socket (mixed into
kvpool.pool.daemon.PoolDaemon).

  SegmentHandout._attach_socket   bind run_dir/attach.sock (mode 0600), non-blocking.
  SegmentHandout._serve_attach    accept; at most `max_unauthenticated` at once, oldest closed.
  SegmentHandout._attach_one      read a ticket; send its tenant's two descriptors, or a refusal.
  SegmentHandout._ticket          mint the single-use ticket of a hello.

Contracts:
  * Tenants are apart in the data plane too: each has its own arena segment (an
    anonymous, size-sealed memfd of its quota of pages, `quotas`; the tenants not named
    there share the rest of `num_pages` evenly) and its own catalog, so its pages, page
    ids, eviction, ghosts, lease and reservation ids, lookup waits and stats are its own
    and another tenant's load cannot evict them. No segment has a name in /dev/shm: a
    client on the daemon's host gets its tenant's two segments (kvpool.pool.arena: the pages,
    and the daemon's private state sealed read-only) as file descriptors over the attach
    socket (run_dir/attach.sock), in exchange for the single-use ticket of its hello
    (valid for `hello_timeout_s`; at most `max_unauthenticated` attach connections at
    once, the oldest closed past it). A client elsewhere (or refused the descriptors)
    moves page bytes in frames. The index a probe reads, the generations and the
    heartbeat are written by the daemon only: its clients can map them read-only and in
    no other way (`arena_factory` makes the segments: kvpool.pool.arena.Arena.anonymous).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import socket
import time
from pathlib import Path

from kvpool.errors import ErrorCode
from kvpool.pool.config import PoolConfig
from kvpool.pool.metrics import PoolMetrics
from kvpool.pool.state import TenantPool

log = logging.getLogger("kvpool.pool.daemon")  # the daemon's logger, whichever of its modules logs
_TICKET_BYTES = 16


class SegmentHandout:
    """The attach socket of PoolDaemon; of the daemon it uses its config, run dir, tenant
    pools, metrics, loop, and its tables of tickets and attach connections."""

    config: PoolConfig
    run_dir: Path
    pools: dict[str, TenantPool]
    metrics: PoolMetrics
    attach_path: Path | None
    _loop: asyncio.AbstractEventLoop | None
    _tickets: dict[bytes, tuple[str, float]]
    _attaching: dict[int, asyncio.Future]

    def _attach_socket(self) -> socket.socket:
        self.attach_path = self.run_dir / "attach.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.attach_path))
        os.chmod(self.attach_path, 0o600)
        sock.listen(64)
        sock.setblocking(False)
        return sock

    async def _serve_attach(self, listener: socket.socket) -> None:
        """Accept attach connections; each gets at most one descriptor, for a valid ticket.
        At most `max_unauthenticated` are served at once: past it the oldest is closed, so
        that idle connections cannot keep a client with a ticket from its segment."""
        loop = self._loop
        ids = itertools.count()
        while True:
            conn, _ = await loop.sock_accept(listener)
            if len(self._attaching) >= self.config.max_unauthenticated:
                oldest = next(iter(self._attaching))
                self.metrics.requests.labels("attach", ErrorCode.BUSY.value).inc()
                self._attaching.pop(oldest).cancel()  # its handler's finally closes the connection
            n = next(ids)
            task = asyncio.ensure_future(self._attach_one(conn))
            self._attaching[n] = task
            task.add_done_callback(lambda t, n=n: self._attached(n, t))

    def _attached(self, n: int, task: asyncio.Future) -> None:
        self._attaching.pop(n, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("attach handler failed", exc_info=task.exception())

    async def _attach_one(self, conn: socket.socket) -> None:
        """Read a ticket (16 bytes, within the hello timeout); answer b"\x00" with the
        ticket's tenant's two segments attached (SCM_RIGHTS: the private one, sealed
        read-only, then the pages), or b"\x01" and nothing."""
        loop = self._loop
        result = "ok"
        try:
            ticket = b""
            async with asyncio.timeout(self.config.hello_timeout_s):
                while len(ticket) < _TICKET_BYTES:
                    chunk = await loop.sock_recv(conn, _TICKET_BYTES - len(ticket))
                    if not chunk:
                        break
                    ticket += chunk
            entry = self._tickets.pop(ticket, None)
            if entry is None or entry[1] <= time.monotonic() or entry[0] not in self.pools:
                result = ErrorCode.UNAUTHENTICATED.value
                await loop.sock_sendall(conn, b"\x01")
                return
            socket.send_fds(conn, [b"\x00"], list(self.pools[entry[0]].arena.handout_fds()))
        except TimeoutError:
            result = "timeout"
        except OSError:  # the peer went away or did not read: it gets nothing, nobody else is touched
            result = "transport_error"
        finally:
            conn.close()
            self.metrics.requests.labels("attach", result).inc()

    def _ticket(self, tenant: str) -> bytes:
        ticket = secrets.token_bytes(_TICKET_BYTES)
        self._tickets[ticket] = (tenant, time.monotonic() + self.config.hello_timeout_s)
        return ticket
