"""The keeper's heartbeat raced as a race: the keeper's private state (kvpool.gpu.handout.PrivateState)
beating in this process while a replica's view of it (PrivateView) reads it in another process
(spawned, mapping the same sealed memfd read-only, as a replica maps what the handout passes it).
The keeper beats two values that differ in every byte (0x00ffffffffffffff and
0x0100000000000000), so any read that mixes the bytes of two beats is a value never written.
The oracle: every value read is one the keeper wrote. Control: BytewiseBeatState and
BytewiseBeatView (struct.pack_into and unpack_from, one byte at a time, as the heartbeat was
moved before) caught by the same oracle: a torn value read. The reader reads for READ_S after the
first beat it sees (the control until its first torn read, for at most CONTROL_READ_S: on a loaded
machine the two processes may seldom run at once); the writer beats until the reader is done. A run whose reader saw no beat, or whose writer was not beating through the reads,
proves nothing and fails as such (never a pass)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from kvgate.faults.keeper_controls import BytewiseBeatState, BytewiseBeatView
from kvpool.gpu.handout import HandleKind, PrivateState, PrivateView, TierDescriptor

A, B = 0x00FF_FFFF_FFFF_FFFF, 0x0100_0000_0000_0000  # every byte differs
PAGES = 4
READ_S = 3.0
CONTROL_READ_S = 60.0  # the control reads until its first torn read, at most this (a loaded machine's slices)


def _desc(size: int) -> TierDescriptor:
    return TierDescriptor(instance=b"i" * 16, device_uuid=bytes(16), kind=HandleKind.MEMFD, size=4096 * PAGES,
                          page_size=4096, num_pages=PAGES, granularity=4096, private_size=size)


def _reader(path: str, size: int, bytewise: bool, first, done, reads, torn, read_s: float) -> None:  # noqa: ANN001
    """A replica's process: maps the keeper's private state read-only and reads its heartbeat."""
    view_cls = BytewiseBeatView if bytewise else PrivateView
    fd = os.open(path, os.O_RDONLY)
    view = view_cls(fd, _desc(size))
    try:
        while view.heartbeat_ns() not in (A, B):  # the keeper's first beat
            time.sleep(0.0005)
        first.set()
        t0, n, bad = time.monotonic(), 0, 0
        while time.monotonic() - t0 < read_s and not bad:
            for _ in range(2000):
                if view.heartbeat_ns() not in (A, B):
                    bad += 1
            n += 2000
        reads.value, torn.value = n, bad
    finally:
        done.set()
        view.close()
        os.close(fd)


def _race(state_cls: type[PrivateState], bytewise: bool) -> tuple[int, int, int]:
    """(reads, torn reads, beats the keeper wrote while the reader read)."""
    state = state_cls("kvgt-heartbeat-race", 4096, PAGES, b"i" * 16)
    ctx = mp.get_context("spawn")
    first, done = ctx.Event(), ctx.Event()
    reads, torn = ctx.Value("q", 0), ctx.Value("q", 0)
    proc = ctx.Process(target=_reader, args=(f"/proc/{os.getpid()}/fd/{state.fd}", state.size, bytewise, first, done,
                                             reads, torn, CONTROL_READ_S if bytewise else READ_S), daemon=True)
    beats = 0
    try:
        proc.start()
        state.beat(A)
        give_up = time.monotonic() + 60
        while not first.is_set():  # the reader's start (a spawned interpreter) and its first read
            if not proc.is_alive() or time.monotonic() > give_up:
                raise RuntimeError(f"the reader never saw a beat (exit {proc.exitcode})")
            time.sleep(0.01)
        while not done.is_set():
            for _ in range(1000):
                state.beat(B if beats & 1 else A)
                beats += 1
        proc.join(30 + CONTROL_READ_S)
    finally:
        if proc.is_alive():
            proc.kill()
        state.close()
    if proc.exitcode != 0:
        raise RuntimeError(f"the reader exited {proc.exitcode}")
    return reads.value, torn.value, beats


@pytest.mark.parametrize("state_cls,bytewise,checked", [
    (PrivateState, False, True),
    (BytewiseBeatState, True, False),
], ids=["word", "control-bytewise"])
def test_a_replica_never_reads_half_of_one_heartbeat_and_half_of_another(state_cls, bytewise, checked):
    reads, torn, beats = _race(state_cls, bytewise)
    if checked:  # the whole READ_S of reads beside the keeper's beats, none torn
        assert reads > 0 and beats > 1000, f"{reads} reads beside {beats} beats: proves nothing"
        assert torn == 0, f"{torn} torn heartbeats in {reads} reads"
    else:  # a torn read needs a beat under way: caught, it proves the two ran together
        assert torn > 0, (f"negative control NOT caught: {reads} reads beside {beats} beats saw no torn heartbeat"
                          + ("" if beats > 1000 else " (too few beats: proves nothing)"))
