"""What the pool bench's timed steps contain (kvgate.harness.bench.pool), judged without a clock.

The bench's own clock reads are numbered (its module's `time` replaced by a counting one), so
each thing that happens is booked to the step between two reads: a step is timed when its two
reads time a lookup, ping or probe (bench_lookup) or a memcpy, publish or load
(bench_throughput), four reads a round, the step after the fourth read untimed.

  - No garbage collection starts inside a timed step, with the collector set to run at
    nearly every allocation. (A full collection of the ~600,000 objects vLLM and torch bring
    into the bench process takes 0.3-0.5 s of CPU; it came due inside the first 64 KiB row's
    publish, then its load, and read as a 4-10x regression of the pool.)
  - A timed publish faults in fewer pages than it publishes: the arena was touched by an
    untimed round first, as the memcpy baseline's buffers are.

Each oracle runs a negative control first: the same bench without the pause, or without the
warm-up round, and the oracle must see what it is there to catch.
"""

from __future__ import annotations

import contextlib
import gc
import resource
import time

import pytest

from kvgate.harness.bench import pool as bench

READS_PER_ROUND = 4  # t0..t3: three timed steps, then the round's untimed bookkeeping
PAGE = 64 * 1024
PAGES = 64


class CountingClock:
    """The bench's `time`: each perf_counter() read is numbered; collections that start and
    the process's minor faults are booked to the step the latest read opened."""

    def __init__(self) -> None:
        self.reads = 0
        self.collections: list[tuple[int, int]] = []  # (reads so far, generation)
        self.faults_at: list[int] = []  # the process's minor faults at each read

    def perf_counter(self) -> float:
        self.faults_at.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        self.reads += 1
        return time.perf_counter()

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.collections.append((self.reads, info["generation"]))

    def in_timed_steps(self) -> list[tuple[int, int]]:
        return [(r, g) for r, g in self.collections if r % READS_PER_ROUND != 0]

    def faults_in_step(self, round_: int, step: int) -> int:
        """Minor faults between the reads that open and close `step` (0 memcpy, 1 publish,
        2 load) of `round_`."""
        first = round_ * READS_PER_ROUND + step
        return self.faults_at[first + 1] - self.faults_at[first]


@contextlib.contextmanager
def eager_collector():
    """The collector run at (nearly) every allocation of a tracked object, and back after."""
    before = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _run_counted(monkeypatch: pytest.MonkeyPatch, run, eager: bool = True) -> CountingClock:
    clock = CountingClock()
    monkeypatch.setattr(bench, "time", clock)
    gc.callbacks.append(clock.on_gc)
    try:
        with eager_collector() if eager else contextlib.nullcontext():
            run()
    finally:
        gc.callbacks.remove(clock.on_gc)
    return clock


def _lookup() -> None:
    bench.bench_lookup(20)


def _throughput() -> None:
    bench.bench_throughput(PAGE, PAGE * PAGES, 2)


@pytest.mark.parametrize("run", [_lookup, _throughput], ids=["lookup", "throughput"])
def test_no_collection_starts_inside_a_timed_step(monkeypatch: pytest.MonkeyPatch, run) -> None:
    with monkeypatch.context() as m:  # negative control: the same steps with the collector left on
        m.setattr(bench, "collector_paused", contextlib.nullcontext)
        control = _run_counted(m, run)
    assert control.in_timed_steps(), "the oracle saw no collection inside a timed step without the pause"
    clock = _run_counted(monkeypatch, run)
    assert clock.reads and clock.reads % READS_PER_ROUND == 0, clock.reads
    assert clock.collections, "the collector did not run at all around the bench: the oracle proves nothing"
    assert not clock.in_timed_steps(), f"collections (reads so far, generation) inside timed steps: " \
                                       f"{clock.in_timed_steps()[:10]}"


def test_timed_publishes_fault_in_no_arena_page(monkeypatch: pytest.MonkeyPatch) -> None:
    faults_per_page = PAGE // resource.getpagesize()
    with monkeypatch.context() as m:  # negative control: no untimed round before the timed ones
        m.setattr(bench, "warm_up", lambda c, src, dst: None)
        control = _run_counted(m, _throughput, eager=False)
    assert control.faults_in_step(0, 1) >= PAGES * faults_per_page, \
        f"a first publish into a fresh arena faulted {control.faults_in_step(0, 1)} pages in"
    clock = _run_counted(monkeypatch, _throughput, eager=False)
    for round_ in range(2):
        assert clock.faults_in_step(round_, 1) < PAGES, \
            f"round {round_}: the timed publish of {PAGES} pages faulted {clock.faults_in_step(round_, 1)} in"


def test_the_pause_restores_the_collector() -> None:
    gc.enable()
    with bench.collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with bench.collector_paused():
            pass
        assert not gc.isenabled(), "a collector that was off before the pause was turned on by it"
    finally:
        gc.enable()
