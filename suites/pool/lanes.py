"""Holding a copier's lane, for the tests of copier controls (kvgate.faults.controls)."""

import threading

from kvpool.connector.copier import LANE_THREADS


def hold(copier, lane):
    """Occupy every thread of the copier's lane until the returned event is set. A control
    reports its job done while the job waits behind these, so the engine's reuse (or read)
    comes before the copy by construction: the test decides the race the control exists to
    lose, not the stream delay's timer (a stalled test thread once let a 300 ms delay win it)."""
    threads = LANE_THREADS[lane]
    release, running = threading.Event(), threading.Barrier(threads + 1)

    def blocker():
        running.wait(timeout=30)
        assert release.wait(timeout=30), "the held lane was never released"

    for _ in range(threads):
        copier.inner.submit(blocker, lane)
    running.wait(timeout=30)
    return release
