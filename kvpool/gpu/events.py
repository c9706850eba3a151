"""The host's waits for CUDA work in the GPU transfer engine: the events a worker thread
sleeps on instead of spinning.

  host_event()   a blocking-sync CUDA event, marked so that await_event sleeps on it.
  await_event(event, poll_s, keepalive=None) -> PoolError | None
        block the calling thread until `event` completed: through cudaEventSynchronize of
        the loaded CUDA runtime, called with ctypes (the GIL is released, and the wait is
        not one of torch's, which its stream sanitizer would take for an ordering), for a
        host event; else by polling every `poll_s`. With a `keepalive`
        (kvpool.client.keepalive), the wait is bounded by its renewal interval, in a loop
        that renews the pool grants the waiter holds (the blocking sync runs on a helper
        thread, the caller waits on it with a timeout): a renewal the pool refuses ends the
        renewals, never the wait, and is returned once the event completed.
  resolve_when_all(futures, result, outcome)
        set `result` (a Future) to outcome() once every one of `futures` is done (on the
        thread that finished the last; at once if there are none), or to the exception
        outcome() raised: how a transfer's handle resolves over its parts.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvpool.client.keepalive import Keepalive
from kvpool.errors import PoolError
from kvpool.gpu.config import TransferError

_EVENT_POLL_S = 100e-6  # background workers poll CUDA events (a blocking sync would spin a core)


def host_event() -> torch.cuda.Event:
    """An event a host thread waits for: blocking-sync, so the waiting thread sleeps in the
    driver (no spinning, no GIL held) instead of polling."""
    event = torch.cuda.Event(blocking=True)
    event.kvpool_blocking = True
    return event


@functools.cache
def _event_sync() -> Any:  # noqa: ANN401 - a ctypes function, or None
    """cudaEventSynchronize of the CUDA runtime this process loaded (found in its maps),
    called through ctypes: the GIL is released while it waits, and the wait is not one of
    torch's (a background thread's wait is no ordering for the thread that enqueues, and
    torch's stream sanitizer must not take it for one). None: not found (the caller polls)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaEventSynchronize
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def await_event(event: torch.cuda.Event, poll_s: float = _EVENT_POLL_S,
                keepalive: Keepalive | None = None) -> PoolError | None:
    if keepalive is None or event.query():
        _until_done(event, poll_s)
        return None
    done: cf.Future = cf.Future()

    def run() -> None:
        try:
            _until_done(event, poll_s)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, which raises it
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=run, name="kvpool-event-wait", daemon=True).start()

    def wait(timeout_s: float | None) -> bool:
        try:
            done.result(timeout_s)  # raises what the sync raised (TransferError)
        except cf.TimeoutError:
            return False
        return True

    return keepalive.hold(wait)


def _until_done(event: torch.cuda.Event, poll_s: float) -> None:
    sync = _event_sync() if getattr(event, "kvpool_blocking", False) else None
    if sync is not None:
        err = sync(event.cuda_event)
        if err != 0:
            raise TransferError(f"cudaEventSynchronize failed: error {err}")
        return
    while not event.query():
        time.sleep(poll_s)


def resolve_when_all(futures: Sequence[cf.Future], result: cf.Future, outcome: Callable[[], Any]) -> None:
    remaining = [len(futures)]
    lock = threading.Lock()

    def settle() -> None:
        try:
            result.set_result(outcome())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the result
            result.set_exception(exc)

    def part_done(_: cf.Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            settle()

    if not futures:
        settle()
    for f in futures:
        f.add_done_callback(part_done)
