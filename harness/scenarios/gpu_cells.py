"""The matrix of the GPU engine's copy paths against their ordering edges: one cell per
(path, edge) of the registry (kvpool.gpu.paths), each with the scenario that holds back
the work the edge orders (a seeded stream delay) and the control that drops that edge.
No torch here: the completeness test (suites/unit/test_gpu_matrix.py) reads it on any host;
the runner is kvgate.harness.scenarios.gpu_matrix, the test suites/gpu/test_matrix.py.

  Expect     how a cell's control must come out:
               caught           the byte-exact oracle sees it (a page's bytes or its
                                committed digest at the moment it became visible, a
                                block's bytes as the engine read it or after the load);
               host_ordered     the host itself waits for the work the edge orders on this
                                path (kvpool.gpu.paths.host_ordered, and the premise it
                                rests on, probed on the GPU): the control stays byte-exact;
                                where the premise is one CUDA leaves open (a copy from
                                pageable memory waiting for its stream) the control is not
                                run, and where the probe finds the premise false the cell
                                expects `caught`;
               caught_by_lease  the pool's lease accounting sees it: the pages of a load
                                still in flight can be evicted. The load's bytes are already
                                ordered by its check (the host waited for the check of every
                                chunk, after its copy) before the release is even enqueued.
  Scenario   per ordering edge: what is delayed, what the engine then does, what the oracle
             compares (SCENARIOS).
  Cell       path, edge, scenario, control (a name of kvgate.faults.gpu_controls.CONTROLS),
             expect, premise, why (the host ordering's reason); .id
  cells()    every cell of every path, in the registry's order.
  control_for(path)   the control of a path's cells: the engine that drops the cell's edge,
             with registration refused on pageable paths.
"""

from __future__ import annotations

import dataclasses
import enum

from kvpool.gpu.config import HostMemory, OrderingEdge
from kvpool.gpu.paths import EDGES, Direction, EdgeKind, Premise, TransferPath, host_ordered, transfer_paths


class Expect(enum.StrEnum):
    CAUGHT = "caught"
    HOST_ORDERED = "host_ordered"
    CAUGHT_BY_LEASE = "caught_by_lease"


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str  # the runner's name in kvgate.harness.scenarios.gpu_matrix.RUNNERS
    delayed: str  # what the seeded stream delay holds back
    oracle: str  # what the oracle compares


SCENARIOS: dict[OrderingEdge, Scenario] = {
    OrderingEdge.STORE_AFTER_WRITE: Scenario(
        "store_after_write", "the engine's stream, before it writes new bytes into the blocks; then store()",
        "every page, as it became visible (at its commit), holds the new bytes, under their digest"),
    OrderingEdge.REUSE_AFTER_STORE: Scenario(
        "reuse_after_store", "the streams that read the KV for the store; the engine rewrites the blocks "
        "right after store()", "every page at its commit holds the bytes the blocks had at store()"),
    OrderingEdge.COPY_AFTER_GATHER: Scenario(
        "copy_after_gather", "the gather into the staging buffers", "every page at its commit holds its block"),
    OrderingEdge.GATHER_AFTER_COPY: Scenario(
        "gather_after_copy", "the copies out of the staging buffers; two stores of two chunks each, so the "
        "second store's gathers reuse the first's buffers", "every page at its commit holds its block"),
    OrderingEdge.COMMIT_AFTER_COPY: Scenario(
        "commit_after_copy", "the copies to the pages, and each sketch before its copy to the host "
        "(kvgate.faults.gpu_controls.SketchDelayedEngine); the pages are read the moment they are committed",
        "every page at its commit holds its block, under the block's digest"),
    OrderingEdge.LOAD_AFTER_READ: Scenario(
        "load_after_read", "the engine's stream, before it reads the blocks; then a load into them",
        "the engine read the blocks' old bytes; the blocks then hold the pages"),
    OrderingEdge.REFILL_AFTER_INSTALL: Scenario(
        "refill_after_install", "the installs of a load; the next load copies into the same staging buffers",
        "every block of both loads holds its page"),
    OrderingEdge.CHECK_AFTER_COPY: Scenario(
        "check_after_copy", "the copy of a load whose staging buffers still hold the same pages from an earlier "
        "load, after one pooled page changed", "every block the load reports loaded holds the page as "
        "committed; every other block its old bytes"),
    OrderingEdge.VERIFY_AFTER_CHECK: Scenario(
        "verify_after_check", "the check of a load (sketches, read-back) whose host buffers still hold an "
        "earlier load's digests of the same pages, after one pooled page changed",
        "every block the load reports loaded holds the page as committed; every other block its old bytes"),
    OrderingEdge.READ_AFTER_LOAD: Scenario(
        "read_after_load", "the installs of a load; the engine reads the blocks right after wait_for_load()",
        "the engine read the pages"),
    OrderingEdge.RELEASE_AFTER_COPY: Scenario(
        "release_after_copy", "the installs of a load; its pages are evicted while they run",
        "the pool refuses to evict a page of a load whose copies or installs are still in flight"),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    path: TransferPath
    edge: OrderingEdge
    scenario: str
    control: str
    expect: Expect
    premise: Premise | None = None
    why: str = ""

    @property
    def id(self) -> str:
        return f"{self.path.name}-{self.edge.value}"


def control_for(path: TransferPath) -> str:
    return "refused_unordered" if path.host is HostMemory.PAGEABLE else "unordered"


def cell(path: TransferPath, edge: OrderingEdge) -> Cell:
    """The cell of `edge` on `path` (KeyError: the edge has no scenario yet)."""
    scenario = SCENARIOS[edge].name
    ordered = host_ordered(path, edge)
    if ordered is not None:
        return Cell(path, edge, scenario, control_for(path), Expect.HOST_ORDERED, ordered.premise, ordered.reason)
    if EDGES[edge].kind is EdgeKind.RELEASE_AFTER_COPY and EDGES[edge].direction is Direction.LOAD:
        return Cell(path, edge, scenario, control_for(path), Expect.CAUGHT_BY_LEASE)
    return Cell(path, edge, scenario, control_for(path), Expect.CAUGHT)


def cells() -> tuple[Cell, ...]:
    return tuple(cell(p, e) for p in transfer_paths() for e in p.edges)
