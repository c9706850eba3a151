"""The keeper's heartbeat raced as a race: the keeper's private state (kvpool.gpu.handout.PrivateState)
beating in one process while a replica's view of it (PrivateView) reads it in another, over one
shared mapping (a sealed memfd, as the handout passes it). The keeper's clock is made to step
between two values that differ in every byte (0x00ffffffffffffff and 0x0100000000000000), so any
read that mixes the bytes of two beats is a value never written. The oracle: every value read is
one the keeper wrote. Control: BytewiseBeatState and BytewiseBeatView (the struct.pack_into and
unpack_from the heartbeat used before, one byte at a time) caught by the same oracle: a torn
value read. The run lasts until the control shows a torn read or ROUND_S pass; the writer and
reader each report their own span, and a run whose two processes overlapped for less than
MIN_OVERLAP_S proves nothing and fails as such (never a pass)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from kvgate.faults.keeper_controls import BytewiseBeatState, BytewiseBeatView
from kvpool.gpu import handout as H
from kvpool.gpu.handout import HandleKind, PrivateState, PrivateView, TierDescriptor

A, B = 0x00FF_FFFF_FFFF_FFFF, 0x0100_0000_0000_0000  # every byte differs
PAGES = 4
ROUND_S = 4.0
MIN_OVERLAP_S = 0.5


def _writer(state: PrivateState, stop, span) -> None:  # noqa: ANN001 - mp Event, mp Array
    values = (A, B)
    i = 0
    H.time.monotonic_ns = lambda: values[i & 1]  # the keeper's clock, in this process only
    span[0] = time.monotonic()
    while not stop.is_set():
        for _ in range(1000):
            i += 1
            state.beat()
    span[1] = time.monotonic()


def _race(state_cls: type[PrivateState], view_cls: type[PrivateView]) -> tuple[int, int, float]:
    """(reads, torn reads, seconds the writer and the reader overlapped)."""
    state = state_cls("kvgt-heartbeat-race", 4096, PAGES, b"i" * 16)
    desc = TierDescriptor(instance=b"i" * 16, device_uuid=bytes(16), kind=HandleKind.MEMFD, size=4096 * PAGES,
                          page_size=4096, num_pages=PAGES, granularity=4096, private_size=state.size)
    ctx = mp.get_context("fork")
    stop, span = ctx.Event(), ctx.Array("d", 2)
    proc = ctx.Process(target=_writer, args=(state, stop, span), daemon=True)
    view = PrivateView(os.dup(state.fd), desc)
    reads = torn = 0
    try:
        proc.start()
        while view.heartbeat_ns() not in (A, B):  # the writer's first beat: from here on only A or B
            if not proc.is_alive():
                raise RuntimeError(f"the writer exited {proc.exitcode} before its first beat")
            time.sleep(0.001)
        t0 = time.monotonic()
        while time.monotonic() - t0 < ROUND_S and not torn:
            for _ in range(2000):
                if view.heartbeat_ns() not in (A, B):
                    torn += 1
            reads += 2000
        t1 = time.monotonic()
    finally:
        stop.set()
        proc.join(10)
        view.close()
        state.close()
    overlap = min(t1, span[1]) - max(t0, span[0])
    return reads, torn, overlap


@pytest.mark.parametrize("state_cls,view_cls,checked", [
    (PrivateState, PrivateView, True),
    (BytewiseBeatState, BytewiseBeatView, False),
], ids=["word", "control-bytewise"])
def test_a_replica_never_reads_half_of_one_heartbeat_and_half_of_another(state_cls, view_cls, checked):
    reads, torn, overlap = _race(state_cls, view_cls)
    if checked:
        assert overlap >= MIN_OVERLAP_S, f"the writer and the reader overlapped {overlap:.2f} s: proves nothing"
        assert torn == 0, f"{torn} torn heartbeats in {reads} reads"
    else:
        assert torn > 0 or overlap >= MIN_OVERLAP_S, \
            f"the control ran only {overlap:.2f} s beside its writer: proves nothing"
        assert torn > 0, f"negative control NOT caught: {reads} reads over {overlap:.2f} s saw no torn heartbeat"
