"""The transport nemesis: a frame-aware fault proxy between pool clients and the daemon.

  FaultProxy(upstream, listen, control_file, seed, history)
      listens on "unix:PATH" or "tcp:HOST:PORT" (port 0 picks a free one) and forwards
      every accepted connection to the daemon at `upstream`. It parses the framing both
      ways, so each fault strikes one whole frame: request frames (client -> daemon) and
      reply frames (daemon -> client, attributed to their request's op by request id);
      the page payloads inside `write` requests and `pages_ok` replies are located
      exactly. `.start()` / `.stop()` (its own thread and event loop), `.address` (a
      PoolClient address), `.configure(faults)` / `.heal()`, `.fired()`, `.stats()`,
      `.records()` (every fired fault, as written to the history).
  python -m kvgate.faults.proxy --upstream ADDR --listen ADDR --control FILE --seed N
      the same proxy as a process, for live replicas: point the connector's `pool`
      setting at the proxy's address (kvgate.harness.system.proxy.ProxyProcess starts it).
  TrustingLoader (kvgate.faults.transport_controls) is the negative control these faults need.

Control file: JSON `{kind: {param: value, ...}, ...}`, off by default; re-read when it
changes (checked on every frame and every 10 ms); `{}` or no file heals. Every kind takes

  p          probability a matching frame fires (drawn from the kind's seeded generator)
  ops        request ops it applies to ("lookup", "acquire", "read", "write", ...; a
             reply counts as its request's op); default all
  direction  "request", "reply" or "both" (default; drop_reply: "reply" only)
  after      matching frames let through before the fault may fire (default 0)
  times      at most this many firings per control version (default unlimited)
  seed       the fault's own seed for its draws (default: the proxy's seed and the
             control version), so a scenario replays its draws from its own seed
  schedule_seed, schedule_kind
             BUGGIFY-style: whether the n-th matching frame (after `after`) fires is the
             run's fault schedule's decision, kvgate.faults.schedule.fires(schedule_seed,
             schedule_kind, n, p), the same answer the schedule gives the scenario

and the kinds, applied to a frame in this order:

  reset       both sockets closed abruptly (SO_LINGER 0: an RST on TCP); frame not sent
  truncate    {"bytes": k}: the first k bytes of the frame go through (default: k drawn
              from [1, frame-1]), then both sockets close
  drop_reply  the reply frame is swallowed; the connection stays open (client times out)
  stall       {"seconds": s}: the frame is held s seconds (default 30); a control change
              or the connection closing ends the stall early
  bitflip     one drawn bit of one page payload flipped (only `write` / `pages_ok`
              frames carry pages); the frame is otherwise untouched
  slow        {"bytes_per_s": r, "latency_s": l}: the frame waits l, then goes out at r

Contracts:
  * A fired fault is counted (`fired()`) and recorded with kind, direction, op,
    frame_bytes, its heal step and what it did (bytes forwarded, bit flipped, delay).
  * Same seed, same control writes, same frames => the same firings with the same drawn
    parameters. A seed cannot fix the interleaving of concurrent connections.
  * `remote` (default: on for a TCP listener) presents the daemon as if on another host:
    HelloOk's arena name is replaced so the client cannot map the arena, and page bytes
    travel through the proxy as ReadPages / WritePages frames (where bitflip and slow
    act on them). Over a Unix listener without it, clients on this host copy pages
    through shared memory and only control frames cross the proxy.
  * Nothing else is rewritten. A length prefix over `max_frame` is passed on and what
    follows it on that connection is discarded (the daemon answers OVERSIZED, closes).
  * Internal errors are kept and raised by `stop()` / `check()`; a control file that
    does not parse keeps the previous faults in force and sets `control_error`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import stat
import struct
import sys
import threading
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from kvgate.faults import control
from kvgate.faults.schedule import fires as schedule_fires
from kvpool.pool import protocol as P
from kvpool.client.backend import parse_address
from kvpool.connector.history import HistoryWriter

KINDS = ("reset", "truncate", "drop_reply", "stall", "bitflip", "slow")  # application order
DIRECTIONS = ("request", "reply")
OPS = frozenset(t.__struct_config__.tag for t in typing.get_args(P.Request))
HEAL: dict[str, str] = {
    "reset": "rewrite the control file to {}; the client reconnects on its next request",
    "truncate": "rewrite the control file to {}; the client reconnects on its next request",
    "drop_reply": "rewrite the control file to {}; the timed-out client reconnects on its next request",
    "stall": "rewrite the control file to {} (held frames are released); the timed-out client reconnects",
    "bitflip": "rewrite the control file to {}; the next load reads the committed page again",
    "slow": "rewrite the control file to {}; frames go out at link speed",
}
_COMMON = {"p", "ops", "direction", "after", "times", "seed", "schedule_seed", "schedule_kind"}
_PARAMS = {"reset": set(), "truncate": {"bytes"}, "drop_reply": set(), "stall": {"seconds"},
           "bitflip": set(), "slow": {"bytes_per_s", "latency_s"}}
_PAGE_FRAMES = {("request", "write"), ("reply", "pages_ok")}
_BIN_HEADER = {0xC4: 2, 0xC5: 3, 0xC6: 5}  # msgpack bin8 / bin16 / bin32
_HIGH_WATER = 8 * 1024 * 1024
_WATCH_S = 0.01


class ProxyError(Exception):
    """The proxy failed internally, or could not start."""


@dataclasses.dataclass(frozen=True)
class LinkFault:
    """One fault kind of the control file, typed and validated."""

    kind: str
    p: float = 1.0
    ops: frozenset[str] | None = None
    direction: str = "both"
    after: int = 0
    times: int | None = None
    seconds: float = 30.0  # stall
    bytes: int | None = None  # truncate
    bytes_per_s: float | None = None  # slow
    latency_s: float = 0.0  # slow
    seed: int | None = None  # this fault's own draws (else the proxy's seed and the control version)
    schedule_seed: int | None = None  # the decision to fire is the fault schedule's (kvgate.faults.schedule.fires)
    schedule_kind: str | None = None  # the schedule's kind for it (default: this kind)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {', '.join(KINDS)}")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"{self.kind}: p={self.p} is not a probability")
        if self.ops is not None and not self.ops <= OPS:
            raise ValueError(f"{self.kind}: unknown ops {sorted(self.ops - OPS)}; known: {sorted(OPS)}")
        if self.direction not in (*DIRECTIONS, "both"):
            raise ValueError(f"{self.kind}: direction {self.direction!r} is not request, reply or both")
        if self.kind == "drop_reply" and self.direction == "request":
            raise ValueError("drop_reply: only reply frames can be dropped")
        if self.after < 0 or (self.times is not None and self.times < 0):
            raise ValueError(f"{self.kind}: after and times must not be negative")
        if self.seconds < 0 or self.latency_s < 0 or (self.bytes is not None and self.bytes < 0):
            raise ValueError(f"{self.kind}: seconds, latency_s and bytes must not be negative")
        if self.kind == "slow" and not self.bytes_per_s and not self.latency_s:
            raise ValueError("slow: give bytes_per_s and/or latency_s")
        if self.bytes_per_s is not None and self.bytes_per_s <= 0:
            raise ValueError("slow: bytes_per_s must be positive")

    def applies(self, direction: str) -> bool:
        if self.kind == "drop_reply":
            return direction == "reply"
        return self.direction in ("both", direction)

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k == "kind" or k in _COMMON | _PARAMS[self.kind]}
        if self.ops is not None:
            out["ops"] = sorted(self.ops)
        return out


def parse_control(data: object) -> dict[str, LinkFault]:
    """The control file's content as {kind: LinkFault}; ValueError names what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"the control file must hold a JSON object, not {type(data).__name__}")
    faults: dict[str, LinkFault] = {}
    for kind, params in data.items():
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")
        if not isinstance(params, dict):
            raise ValueError(f"{kind}: parameters must be a JSON object, not {params!r}")
        unknown = set(params) - _COMMON - _PARAMS[kind]
        if unknown:
            raise ValueError(f"{kind}: unknown parameters {sorted(unknown)}; known: {sorted(_COMMON | _PARAMS[kind])}")
        fields = dict(params)
        if fields.get("ops") is not None:
            if not isinstance(fields["ops"], list) or not all(isinstance(o, str) for o in fields["ops"]):
                raise ValueError(f"{kind}: ops must be a list of op names")
            fields["ops"] = frozenset(fields["ops"])
        try:
            faults[kind] = LinkFault(kind=kind, **fields)
        except TypeError as exc:
            raise ValueError(f"{kind}: {exc}") from exc
    return faults


def write_control(path: str | Path, faults: Mapping[str, Mapping[str, Any]]) -> None:
    """Validate and write a control file atomically (kvgate.faults.control.write_control)."""
    parse_control(json.loads(json.dumps(faults)))
    control.write_control(path, dict(faults))


# -- frames ---------------------------------------------------------------------------------
class _Tagged(msgspec.Struct):
    type: str = "?"


class _PageData(msgspec.Struct):
    data: list[msgspec.Raw] = []


_envelope = msgspec.msgpack.Decoder(P.Envelope)
_tagged = msgspec.msgpack.Decoder(_Tagged)
_page_data = msgspec.msgpack.Decoder(_PageData)


def classify(payload: bytes) -> tuple[int | None, str]:
    """(request id, body tag) of a frame's payload; (None, "?") if it does not decode."""
    try:
        env = _envelope.decode(payload)
        return env.id, _tagged.decode(env.body).type
    except msgspec.DecodeError:
        return None, "?"


def page_spans(payload: bytes) -> list[tuple[int, int]]:
    """(start, end) of each page's bytes inside a `write` or `pages_ok` payload.

    `data` is the body's last field and the body the envelope's last element, so the
    pages are the payload's tail; each span is checked against the decoded bytes."""
    env = _envelope.decode(payload)
    raws = _page_data.decode(env.body).data
    spans: list[tuple[int, int]] = []
    end = len(payload)
    for raw in reversed(raws):
        encoded = memoryview(raw)
        start = end - len(encoded)
        header = _BIN_HEADER.get(encoded[0]) if len(encoded) else None
        if header is None or payload[start:end] != encoded:
            raise ProxyError("page payloads are not where the framing puts them; the protocol's layout changed")
        spans.append((start + header, end))
        end = start
    spans.reverse()
    return spans


# -- sockets --------------------------------------------------------------------------------
class _Eof(Exception):
    def __init__(self, partial: bytes):
        super().__init__(f"end of stream after {len(partial)} bytes of a frame")
        self.partial = partial


class _Side(asyncio.Protocol):
    """One socket of a link: buffers what arrives, hands out exact byte counts."""

    def __init__(self, on_made: typing.Callable[[_Side], None] | None = None):
        self.on_made = on_made
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need = 0
        self.eof = False
        self.paused = False
        self.readable = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.lost = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.on_made is not None:
            self.on_made(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) >= self.need:
            self.readable.set()
            if len(self.buf) >= _HIGH_WATER and not self.paused:
                self.paused = True
                self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        self.readable.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.readable.set()
        self.writable.set()
        self.lost.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    async def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            if self.eof:
                partial = bytes(self.buf)
                self.buf.clear()
                raise _Eof(partial)
            self.need = n
            self.readable.clear()
            self._resume()
            await self.readable.wait()
        self.need = 0
        out = bytes(self.buf[:n])
        del self.buf[:n]
        if len(self.buf) < _HIGH_WATER:
            self._resume()
        return out

    async def read_some(self) -> bytes:
        return await self.read(max(1, len(self.buf)))

    def _resume(self) -> None:
        if self.paused and not self.eof:
            self.paused = False
            self.transport.resume_reading()

    async def write(self, data: bytes) -> bool:
        """False if this side is gone (the link is over)."""
        if self.lost.is_set() or self.transport.is_closing():
            return False
        self.transport.write(data)
        await self.writable.wait()
        return not self.lost.is_set()

    @property
    def is_tcp(self) -> bool:
        sock = self.transport.get_extra_info("socket") if self.transport else None
        return sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)

    def reset(self) -> None:
        if self.transport is None or self.lost.is_set():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


@dataclasses.dataclass
class _KindState:
    rng: random.Random
    seen: int = 0
    fired: int = 0


class _Link:
    def __init__(self, proxy: FaultProxy, number: int, client: _Side):
        self.proxy = proxy
        self.number = number
        self.client = client
        self.upstream: _Side | None = None
        self.requests: dict[int, str] = {}
        self.over = asyncio.Event()

    def end(self, how: str) -> None:
        self.over.set()
        for side in (self.client, self.upstream):
            if side is None:
                continue
            side.reset() if how == "reset" else side.close()

    async def run(self) -> None:
        proxy = self.proxy
        try:
            self.upstream = await proxy._connect_upstream()
        except OSError as exc:
            proxy._count("upstream_failures")
            proxy._history("proxy_upstream_unreachable", conn=self.number, error=str(exc))
            self.end("reset")
            return
        request = asyncio.create_task(self._pump(self.client, self.upstream, "request"))
        reply = asyncio.create_task(self._pump(self.upstream, self.client, "reply"))
        over = asyncio.create_task(self.over.wait())
        waiting = {request, reply, over}
        try:
            # The link ends with the reply stream, a fault, or the client going away. If
            # only the daemon side stopped taking requests, what it still sends (e.g. its
            # answer to an oversized frame) is delivered before the link closes.
            while True:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if request not in done or request.exception() is not None or request.result() != "gone":
                    break
                waiting.discard(request)
        finally:
            self.over.set()
            for task in (request, reply, over):
                task.cancel()
            results = await asyncio.gather(request, reply, return_exceptions=True)
            self.end("close")
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, (asyncio.CancelledError, ConnectionError)):
                proxy._internal_error(f"connection {self.number}: {type(result).__name__}: {result}")

    async def _pump(self, src: _Side, dst: _Side, direction: str) -> str:
        """Forward frames until `src` ends ("eof"), `dst` is gone ("gone") or a fault ends
        the link ("fault")."""
        while True:
            try:
                header = await src.read(P.LENGTH.size)
            except _Eof as eof:
                await dst.write(eof.partial)
                return "eof"
            (n,) = P.LENGTH.unpack(header)
            if n > self.proxy.max_frame:
                # Not a frame anyone will read: pass the length on (the daemon answers
                # OVERSIZED and closes) and discard the rest, so that writing into the
                # closed socket cannot tear down the read side before that answer is in.
                if not await dst.write(header):
                    return "gone"
                while True:
                    try:
                        await src.read_some()
                    except _Eof:
                        return "eof"
            try:
                payload = await src.read(n)
            except _Eof as eof:
                await dst.write(header + eof.partial)
                return "eof"
            outcome = await self.proxy._frame(self, direction, header + payload, dst)
            if outcome != "sent":
                return outcome


# -- the proxy ------------------------------------------------------------------------------
class FaultProxy:
    def __init__(self, upstream: str, listen: str, control_file: str | Path, seed: int,
                 history: HistoryWriter | None = None, *, remote: bool | None = None,
                 max_frame: int = P.DEFAULT_MAX_FRAME):
        self.upstream = upstream
        self.listen = listen
        self.control_file = Path(control_file)
        self.seed = int(seed)
        self.history = history
        self.max_frame = max_frame
        self._up_family, self._up_addr = parse_address(upstream)
        self._family, self._listen_addr = parse_address(listen)
        self.remote = self._family != socket.AF_UNIX if remote is None else remote
        self._lock = threading.Lock()
        self._fired = dict.fromkeys(KINDS, 0)
        self._records: list[dict[str, Any]] = []
        self._stats: dict[str, float] = dict.fromkeys(
            ("connections", "request_frames", "reply_frames", "request_bytes", "reply_bytes", "slow_frames",
             "slow_bytes", "slow_delay_s", "hello_rewritten", "control_versions", "upstream_failures"), 0)
        self._errors: list[str] = []
        self.control_error: str | None = None
        self._faults: dict[str, LinkFault] = {}
        self._states: dict[str, _KindState] = {}
        self._control = control.ControlFile(self.control_file)
        self._control_generation = 0
        self._changed: asyncio.Event | None = None
        self._links: set[asyncio.Task] = set()
        self._numbers = 0
        self._port: int | None = None
        self._label = listen  # the listening address, in history records
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        if self._family == socket.AF_UNIX:
            return f"unix:{self._listen_addr}"
        if self._port is None:
            raise ProxyError("the proxy is not listening yet (start() it)")
        host = self._listen_addr[0]
        return f"tcp:[{host}]:{self._port}" if ":" in host else f"tcp:{host}:{self._port}"

    def start(self, timeout: float = 10.0) -> FaultProxy:
        if self._thread is not None:
            raise ProxyError("the proxy was already started")
        self._thread = threading.Thread(target=self._thread_main, name=f"kvgate-proxy-{self.listen}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise ProxyError(f"the proxy did not start listening on {self.listen} within {timeout}s")
        if self._start_error is not None:
            raise ProxyError(f"the proxy could not listen on {self.listen}: {self._start_error}") from self._start_error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and every connection; raise ProxyError if the proxy failed."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ProxyError(f"the proxy on {self.address} did not stop within {timeout}s")
        self.check()

    def check(self) -> None:
        with self._lock:
            errors = list(self._errors)
        if errors:
            raise ProxyError(f"{len(errors)} internal proxy errors; first: {errors[0]}")

    def __enter__(self) -> FaultProxy:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start() or kept for stop()
            if not self._ready.is_set():
                self._start_error = exc
                self._ready.set()
            else:
                self._internal_error(f"event loop: {type(exc).__name__}: {exc}")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self._poll_control()
        if self._family == socket.AF_UNIX:
            path = Path(self._listen_addr)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()  # a stale socket of a proxy that died
            server = await self._loop.create_unix_server(lambda: _Side(self._accepted), path=str(path))
        else:
            host, port = self._listen_addr
            server = await self._loop.create_server(lambda: _Side(self._accepted), host=host, port=port)
            self._port = server.sockets[0].getsockname()[1]
        self._label = self.address
        watcher = asyncio.create_task(self._watch())
        self._history("proxy_start", upstream=self.upstream, listen=self.address, seed=self.seed, remote=self.remote)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            watcher.cancel()
            server.close()
            for task in list(self._links):
                task.cancel()
            await asyncio.gather(*self._links, watcher, return_exceptions=True)
            await server.wait_closed()
            if self._family == socket.AF_UNIX:
                Path(self._listen_addr).unlink(missing_ok=True)
            self._history("proxy_stop", fired=self.fired(), stats=self.stats())

    def _accepted(self, client: _Side) -> None:
        self._numbers += 1
        self._count("connections")
        link = _Link(self, self._numbers, client)
        task = asyncio.get_running_loop().create_task(self._run_link(link))
        self._links.add(task)
        task.add_done_callback(self._links.discard)

    async def _run_link(self, link: _Link) -> None:
        try:
            await link.run()
        except asyncio.CancelledError:
            link.end("close")

    async def _connect_upstream(self) -> _Side:
        if self._up_family == socket.AF_UNIX:
            _, side = await self._loop.create_unix_connection(_Side, path=self._up_addr)
        else:
            _, side = await self._loop.create_connection(_Side, host=self._up_addr[0], port=self._up_addr[1])
        return side

    # -- control ------------------------------------------------------------------------------
    def configure(self, faults: Mapping[str, Mapping[str, Any]]) -> None:
        """Write the control file (validated, atomically) and wait until the proxy runs it."""
        write_control(self.control_file, faults)
        self._sync_control()

    def heal(self) -> None:
        self.configure({})

    def _sync_control(self) -> None:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return
        done = threading.Event()

        def poll() -> None:
            try:
                self._poll_control()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(poll)
        if not done.wait(10.0):
            raise ProxyError("the proxy's event loop did not pick up the control file within 10s")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            self._poll_control()

    def _poll_control(self) -> None:
        try:
            doc, generation = self._control.read()
            if generation == self._control_generation:
                return
            self._control_generation = generation
            faults = parse_control(doc)
        except ValueError as exc:  # ControlFileError, or a fault the file describes wrongly
            generation = getattr(exc, "generation", self._control_generation)
            if generation == self._control_generation and self.control_error is not None:
                return  # this content was reported already; the previous faults stay in force
            self._control_generation = generation
            self.control_error = str(exc) if isinstance(exc, control.ControlFileError) else f"{self.control_file}: {exc}"
            self._history("proxy_control_error", error=self.control_error)
            return
        self.control_error = None
        with self._lock:
            self._stats["control_versions"] += 1
            version = int(self._stats["control_versions"])
            self._faults = faults
            self._states = {k: _KindState(random.Random(f"{f.seed}:proxy:{k}" if f.seed is not None
                                                        else f"{self.seed}:proxy:{k}:{version}"))
                            for k, f in faults.items()}
        self._history("proxy_control", version=version, healed=not faults,
                      faults={k: f.as_json() for k, f in faults.items()})
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # -- accounting ---------------------------------------------------------------------------
    def fired(self) -> dict[str, int]:
        with self._lock:
            return dict(self._fired)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._records]

    def _count(self, key: str, n: float = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _internal_error(self, message: str) -> None:
        with self._lock:
            self._errors.append(message)
        self._history("proxy_error", error=message)

    def _history(self, event: str, **fields: object) -> None:
        if self.history is not None:
            self.history.write(event, site="proxy", proxy=self._label, **fields)

    def _record(self, fault: LinkFault, link: _Link, direction: str, op: str, request_id: int | None,
                frame_bytes: int, **detail: object) -> None:
        record = {"kind": fault.kind, "direction": direction, "op": op, "frame_bytes": frame_bytes,
                  "heal": HEAL[fault.kind], "conn": link.number, "request_id": request_id, **detail}
        with self._lock:
            self._fired[fault.kind] += 1
            self._records.append(record)
        self._history("fault", **record)

    def _fires(self, fault: LinkFault, direction: str, op: str) -> bool:
        if not fault.applies(direction) or (fault.ops is not None and op not in fault.ops):
            return False
        state = self._states[fault.kind]
        state.seen += 1
        if state.seen <= fault.after or (fault.times is not None and state.fired >= fault.times):
            return False
        if fault.schedule_seed is not None:  # the schedule decides this opportunity, as it told the scenario
            if not schedule_fires(fault.schedule_seed, fault.schedule_kind or fault.kind,
                                  state.seen - fault.after - 1, fault.p):
                return False
        elif state.rng.random() >= fault.p:
            return False
        state.fired += 1
        return True

    # -- one frame ----------------------------------------------------------------------------
    async def _frame(self, link: _Link, direction: str, frame: bytes, dst: _Side) -> str:
        """Apply the faults to one whole frame and forward what is left of it. "sent" (or
        dropped) keeps the link; "gone" (dst lost) and "fault" (a fault ended it) do not."""
        self._poll_control()
        request_id, tag = classify(memoryview(frame)[P.LENGTH.size:])
        if direction == "request":
            op = tag
            if request_id is not None:
                link.requests[request_id] = op
        else:
            op = link.requests.pop(request_id, "?") if request_id is not None else "?"
            if op == "hello" and tag == "hello_ok" and self.remote:
                frame = self._hide_arena(frame)
        self._count(f"{direction}_frames")
        self._count(f"{direction}_bytes", len(frame))
        faults = self._faults
        where = dict(link=link, direction=direction, op=op, request_id=request_id, frame_bytes=len(frame))
        if direction == "reply":
            where["reply"] = tag
        for kind in KINDS:
            fault = faults.get(kind)
            if fault is None:
                continue
            if kind == "bitflip":  # only frames that carry page bytes are eligible
                spans = page_spans(frame[P.LENGTH.size:]) if (direction, tag) in _PAGE_FRAMES else []
                spans = [s for s in spans if s[1] > s[0]]
                if not spans:
                    continue
            if not self._fires(fault, direction, op):
                continue
            state = self._states[kind]
            if kind == "reset":
                self._record(fault, **where, rst=link.client.is_tcp or link.upstream.is_tcp)
                link.end("reset")
                return "fault"
            if kind == "truncate":
                k = fault.bytes if fault.bytes is not None else state.rng.randrange(1, len(frame))
                k = min(k, len(frame) - 1)
                self._record(fault, **where, forwarded_bytes=k)
                await dst.write(frame[:k])
                link.end("close")
                return "fault"
            if kind == "drop_reply":
                self._record(fault, **where)
                return "sent"
            if kind == "stall":
                self._record(fault, **where, seconds=fault.seconds)
                if not await self._hold(link, fault.seconds, self._changed):
                    return "gone"
            elif kind == "bitflip":
                page = state.rng.randrange(len(spans))
                start, end = spans[page]
                offset = state.rng.randrange(end - start)
                bit = state.rng.randrange(8)
                flipped = bytearray(frame)
                flipped[P.LENGTH.size + start + offset] ^= 1 << bit
                frame = bytes(flipped)
                self._record(fault, **where, page=page, byte=offset, bit=bit, page_bytes=end - start)
            elif kind == "slow":
                return await self._send_slowly(fault, link, frame, dst, where)
        return "sent" if await dst.write(frame) else "gone"

    async def _hold(self, link: _Link, seconds: float, *also: asyncio.Event | None) -> bool:
        """Wait `seconds`, less if the link ends (either socket lost) or one of `also` is
        set; False if the link ended."""
        ends = (link.over, link.client.lost, link.upstream.lost)
        waits = [asyncio.ensure_future(e.wait()) for e in (*ends, *also) if e is not None]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return not any(e.is_set() for e in ends)

    async def _send_slowly(self, fault: LinkFault, link: _Link, frame: bytes, dst: _Side,
                           where: dict[str, Any]) -> str:
        rate = fault.bytes_per_s
        delay = fault.latency_s + (len(frame) / rate if rate else 0.0)
        self._record(fault, **where, delay_s=delay, bytes_per_s=rate, latency_s=fault.latency_s)
        with self._lock:
            self._stats["slow_frames"] += 1
            self._stats["slow_bytes"] += len(frame)
            self._stats["slow_delay_s"] += delay
        if fault.latency_s and not await self._hold(link, fault.latency_s):
            return "gone"
        if not rate:
            return "sent" if await dst.write(frame) else "gone"
        chunk = max(512, int(rate / 100))  # ~10 ms slices
        for at in range(0, len(frame), chunk):
            piece = frame[at : at + chunk]
            if not await dst.write(piece) or not await self._hold(link, len(piece) / rate):
                return "gone"
        return "sent"

    def _hide_arena(self, frame: bytes) -> bytes:
        request_id, hello = P.decode_reply(frame[P.LENGTH.size:])
        assert isinstance(hello, P.HelloOk)
        hidden = msgspec.structs.replace(hello, arena=f"{hello.arena}.behind-proxy")
        self._count("hello_rewritten")
        return P.encode_reply(request_id, hidden)


# -- as a process ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.faults.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the pool daemon: unix:PATH or tcp:HOST:PORT")
    parser.add_argument("--listen", required=True, help="where clients connect: unix:PATH or tcp:HOST:PORT (port 0: any)")
    parser.add_argument("--control", required=True, help="the JSON control file (missing or {}: no faults)")
    parser.add_argument("--seed", required=True, type=int, help="root seed of every drawn fault parameter")
    parser.add_argument("--history", default="", help="directory of the run's history (JSON lines)")
    parser.add_argument("--replica", default="proxy", help="name of this proxy in the history")
    parser.add_argument("--remote", action=argparse.BooleanOptionalAction, default=None,
                        help="hide the arena so page bytes cross the proxy (default: on for a TCP listener)")
    parser.add_argument("--ready-file", default="", help="written (JSON: address, pid) once the proxy listens")
    args = parser.parse_args(argv)
    history = HistoryWriter(args.history or None, args.replica, "proxy")
    proxy = FaultProxy(args.upstream, args.listen, args.control, args.seed, history, remote=args.remote)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    proxy.start()
    ready = json.dumps({"address": proxy.address, "pid": os.getpid(), "remote": proxy.remote})
    print(ready, flush=True)
    if args.ready_file:
        tmp = Path(f"{args.ready_file}.tmp")
        tmp.write_text(ready)
        tmp.replace(args.ready_file)
    reported = None
    while not stop.wait(0.5):
        if proxy.control_error != reported:
            reported = proxy.control_error
            if reported:
                print(f"control error (previous faults stay): {reported}", file=sys.stderr, flush=True)
    try:
        proxy.stop()
    finally:
        print(json.dumps({"fired": proxy.fired(), "stats": proxy.stats()}), flush=True)
        history.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
