"""The matrix of GPU copy paths against ordering edges is complete (no GPU needed): every
path the engine's configuration can select is in the registry (kvpool.gpu.paths), every
ordering edge the engine's code issues is registered on the paths that issue it (read
from the code itself), every wait the copy paths make goes through a hook a control can
drop or is listed here with why, and every (path, edge) has a cell
(kvgate.harness.scenarios.gpu_cells) with its scenario, its runner and a negative control
that drops exactly that edge. suites/gpu/test_matrix.py runs the cells on a GPU; its
collection is checked here too. The completeness check is itself shown to fail on a
registry with a path or an edge that has no cell."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import itertools
from collections import Counter
from pathlib import Path

import pytest

from kvgate.harness.scenarios import gpu_cells
from kvgate.harness.scenarios.gpu_cells import SCENARIOS, Cell, Expect, cells
from kvpool.gpu import paths
from kvpool.gpu.config import CopyPath, HostMemory, OrderingEdge
from kvpool.gpu.paths import (
    EDGES,
    OTHER_FIELDS,
    PATH_FIELDS,
    Direction,
    EdgeKind,
    Issue,
    Premise,
    config_fields,
    host_ordered,
    path_edges,
    transfer_paths,
)
from kvpool.pool.digest import DigestKind

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "kvpool" / "gpu"

# Every wait in the GPU engine's modules that does not go through a hook (so no control can
# drop it), by (module, function, call): how many, and why none needs to.
UNHOOKED_WAITS: dict[tuple[str, str, str], tuple[int, str]] = {
    ("store", "_init_sketch", "synchronize"): (1, "set-up: the zeroed staging rows exist before any copy"),
    ("store", "store", "synchronize"): (2, "the error path: what was enqueued finishes before the pages are given back"),
    ("load", "_init_load", "synchronize"): (1, "set-up: the zeroed staging rows exist before any copy"),
    ("load", "load", "synchronize"): (3, "the error path: the lease outlives every copy before its release"),
    ("load", "_copy_in", "wait_event"): (3, "the install after its chunk's copy (already so: the host enqueues it only "
                                            "after the check it waited for, which ran after the copy) and the two "
                                            "waits that make the load's `done` event, the one RELEASE_AFTER_COPY and "
                                            "READ_AFTER_LOAD wait for"),
    ("transfer", "_order", "wait_event"): (1, "the stream hook itself"),
    ("transfer", "_await_copy", "await_event"): (1, "the host hook itself"),
    ("transfer", "_follow_segment", "synchronize"): (1, "a pool restart: nothing reads the old segment's pages"),
    ("transfer", "_init_graphs", "synchronize"): (1, "set-up: the captured graphs"),
    ("transfer", "close", "synchronize"): (5, "teardown"),
    ("staging", "upload", "synchronize"): (1, "an index ring's slot is rewritten after the upload that read it: "
                                              "reached only with more block ids in flight than the ring holds "
                                              "(at least 4096), which no transfer of the matrix has"),
    ("driver", "probe_batched", "synchronize"): (2, "set-up: the batch API's probe copy"),
}
WAITS = {"wait_event", "wait_stream", "synchronize", "await_event"}
HOOKS = {"_order", "_await_copy"}


def _calls(module: str) -> tuple[Counter, list[tuple[str, str, OrderingEdge]]]:
    """(waits by (module, function, call), [(function, hook, edge)]) of kvpool/gpu/<module>.py."""
    tree = ast.parse((GPU / f"{module}.py").read_text())
    waits: Counter = Counter()
    hooked: list[tuple[str, str, OrderingEdge]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call):
                f = child.func
                callee = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if callee in WAITS:
                    waits[(module, func, callee)] += 1
                if callee in HOOKS:
                    arg = child.args[0] if child.args else None
                    assert isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) \
                        and arg.value.id == "OrderingEdge", \
                        f"{module}.{func}: {callee} with an edge that is not an OrderingEdge member: {ast.dump(child)}"
                    hooked.append((func, callee, OrderingEdge[arg.attr]))
            visit(child, name)

    visit(tree, "<module>")
    return waits, hooked


MODULES = sorted(p.stem for p in GPU.glob("*.py") if p.stem != "__init__")


# -- the registry against the engine's configuration and code ---------------------------------


def test_every_combination_of_the_configurations_enumerations_has_a_path():
    found = {(p.engine, p.host, p.digest, p.direction) for p in transfer_paths()}
    assert found == set(itertools.product(CopyPath, HostMemory, DigestKind, Direction))
    assert {p.issue for p in transfer_paths()} == set(Issue)
    assert len({p.name for p in transfer_paths()}) == len(transfer_paths())
    for p in transfer_paths():
        cfg = p.config()
        assert set(cfg) <= set(PATH_FIELDS), cfg
        assert cfg["path"] is p.engine and cfg["digest"] is p.digest


def test_every_config_field_selects_a_path_or_says_why_not():
    assert not set(PATH_FIELDS) & set(OTHER_FIELDS)
    assert config_fields() == set(PATH_FIELDS) | set(OTHER_FIELDS), \
        "a TransferConfig field is neither a path dimension nor listed, with its reason, in OTHER_FIELDS"
    assert all(why.strip() for why in [*PATH_FIELDS.values(), *OTHER_FIELDS.values()])


def test_every_edge_is_registered_and_issued_on_some_path():
    assert set(EDGES) == set(OrderingEdge)
    on_paths = {e for p in transfer_paths() for e in path_edges(p)}
    assert on_paths == set(OrderingEdge)
    for p in transfer_paths():
        assert len(set(p.edges)) == len(p.edges)
        assert all(EDGES[e].direction is p.direction for e in p.edges), p.name
    assert {EDGES[e].kind for e in OrderingEdge} == set(EdgeKind)
    assert all(EDGES[e].hook in HOOKS for e in OrderingEdge)


def test_the_engine_issues_exactly_the_registered_edges_through_their_hooks():
    """Read from the code: store.py issues the store edges, load.py the load edges, each
    through the hook the registry names; no module issues an unregistered edge."""
    by_module = {m: _calls(m)[1] for m in MODULES}
    want = {"store": Direction.STORE, "load": Direction.LOAD}
    for module, hooked in by_module.items():
        issued = {edge for _, _, edge in hooked}
        expected = {e for e, spec in EDGES.items() if spec.direction is want.get(module)}
        assert issued == expected, f"{module}.py issues {sorted(issued)}; the registry: {sorted(expected)}"
        for func, hook, edge in hooked:
            assert hook == EDGES[edge].hook, f"{module}.{func}: {edge} through {hook}, registered {EDGES[edge].hook}"


def test_every_other_wait_of_the_engine_is_listed_with_its_reason():
    """A wait that bypasses the hooks is an ordering no control can drop: each is listed."""
    waits: Counter = Counter()
    for m in MODULES:
        waits.update(_calls(m)[0])
    listed = {key: count for key, (count, _) in UNHOOKED_WAITS.items()}
    assert dict(waits) == listed, "a wait outside _order/_await_copy: route it through a hook (and register its " \
        f"edge), or list it with its reason. Found {dict(waits)}"


def test_the_tier_has_no_gpu_copy_path():
    """The network tier moves pages between host memory and a store; if it ever copies
    GPU memory, its paths belong in kvpool.gpu.paths (and the matrix)."""
    for path in sorted((ROOT / "kvpool" / "tier").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.split(".")[0] in ("torch", "cuda") and not name.startswith("kvpool.gpu"), \
                    f"{path.name} imports {name}: a tier path on the GPU needs its place in the registry"


def test_host_ordering_is_claimed_only_on_pageable_paths_with_a_premise():
    for p in transfer_paths():
        for e in OrderingEdge:
            h = host_ordered(p, e)
            if h is None:
                continue
            assert p.host is HostMemory.PAGEABLE and e in p.edges and h.reason.strip(), (p.name, e)
            assert h.premise is (Premise.PAGEABLE_D2H_COMPLETES if p.direction is Direction.STORE
                                 else Premise.PAGEABLE_H2D_WAITS_STREAM), (p.name, e)
    # the torch path's staged store and the driver path's sketch stay asynchronous
    p = paths.TransferPath(Direction.STORE, CopyPath.DRIVER, Issue.PER_COPY, HostMemory.PAGEABLE, DigestKind.SKETCH)
    assert host_ordered(p, OrderingEdge.REUSE_AFTER_STORE) is None
    assert host_ordered(p, OrderingEdge.COMMIT_AFTER_COPY) is None


# -- every path and edge has a cell, and every cell a control -----------------------------------


def missing_cells(registry: dict[paths.TransferPath, tuple[OrderingEdge, ...]], table: list[Cell]) -> list[str]:
    """What the matrix lacks for `registry` (path -> its edges): a (path, edge) without a
    cell or with more than one, a cell without its scenario, runner or control, a control
    that does not drop the cell's edge, a host ordering without its premise."""
    from kvgate.faults.gpu_controls import CONTROLS, DROPS
    from kvgate.harness.scenarios.gpu_matrix import RUNNERS
    from kvpool.gpu.transfer import TransferEngine

    problems = []
    by_key = Counter((c.path, c.edge) for c in table)
    for path, edges in registry.items():
        for edge in edges:
            if by_key[(path, edge)] != 1:
                problems.append(f"{path.name} x {edge}: {by_key[(path, edge)]} cells")
    for c in table:
        if c.edge not in registry.get(c.path, ()):
            problems.append(f"{c.id}: a cell of no registered (path, edge)")
        if SCENARIOS.get(c.edge) is None or SCENARIOS[c.edge].name != c.scenario or c.scenario not in RUNNERS:
            problems.append(f"{c.id}: no scenario or runner {c.scenario!r}")
        cls = CONTROLS.get(c.control)
        if cls is None or not issubclass(cls, TransferEngine):
            problems.append(f"{c.id}: no negative control {c.control!r}")
            continue
        drops = DROPS.get(c.control, frozenset())
        if drops is not None and c.edge not in drops:
            problems.append(f"{c.id}: control {c.control} does not drop {c.edge}")
        hook = EDGES[c.edge].hook
        owner = next(k for k in cls.__mro__ if hook in vars(k))
        if owner is TransferEngine:
            problems.append(f"{c.id}: control {c.control} does not replace {hook}")
        if (c.path.host is HostMemory.PAGEABLE) != ("refused" in c.control):
            problems.append(f"{c.id}: control {c.control} on {c.path.host} memory")
        if c.expect is Expect.HOST_ORDERED and (c.premise is None or not c.why):
            problems.append(f"{c.id}: host-ordered without a premise and its reason")
    return problems


def test_every_path_and_edge_has_one_cell_with_a_control():
    pytest.importorskip("torch")
    table = list(cells())
    registry = {p: p.edges for p in transfer_paths()}
    assert missing_cells(registry, table) == []
    assert len({c.id for c in table}) == len(table)
    assert set(SCENARIOS) == set(OrderingEdge)


def test_the_completeness_check_fails_on_a_path_or_an_edge_without_a_cell():
    """The negative control of the completeness check: a registry with one more path, or
    a cell whose control drops nothing, or a scenario gone, is reported."""
    pytest.importorskip("torch")
    table = list(cells())
    registry = {p: p.edges for p in transfer_paths()}
    extra = dataclasses.replace(transfer_paths()[0], digest="kv-sketch-2")  # a new digest kind, say
    assert missing_cells({**registry, extra: extra.edges}, table) != []
    first = table[0]
    wrong = dataclasses.replace(first, control="host_read")  # checks elsewhere, drops no edge
    assert any("does not" in m for m in missing_cells(registry, [wrong, *table[1:]]))
    assert missing_cells(registry, table[1:]) == [f"{first.path.name} x {first.edge}: 0 cells"]


def test_an_edge_without_a_scenario_has_no_cell(monkeypatch):
    gone = OrderingEdge.COMMIT_AFTER_COPY
    monkeypatch.setattr(gpu_cells, "SCENARIOS", {e: s for e, s in SCENARIOS.items() if e is not gone})
    with pytest.raises(KeyError):
        gpu_cells.cells()


def test_the_cells_expectations():
    table = cells()
    assert {c.expect for c in table} == set(Expect)
    for c in table:
        if c.edge is OrderingEdge.RELEASE_AFTER_COPY:
            assert c.expect is Expect.CAUGHT_BY_LEASE
        elif host_ordered(c.path, c.edge) is None:
            assert c.expect is Expect.CAUGHT, c.id
    registered = [c for c in table if c.path.host is HostMemory.REGISTERED]
    assert all(c.expect is not Expect.HOST_ORDERED for c in registered)


def test_the_gpu_suite_has_one_test_per_cell_skipped_without_a_gpu():
    """suites/gpu/test_matrix.py parametrizes over every cell, marked gpu, skipped (with its
    reason) where CUDA is not available; `pytest suites/gpu --collect-only` lists them anywhere."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gpu_test_matrix", ROOT / "suites" / "gpu" / "test_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [c.id for c in module.CELLS] == [c.id for c in cells()]
    (param,) = [m for m in module.test_copy_path_edge_under_delay.pytestmark if m.name == "parametrize"]
    assert list(param.kwargs["ids"]) == [c.id for c in cells()]
    marks = {m.name: m for m in module.pytestmark}
    assert "gpu" in marks and "fault_stream_delay" in marks
    assert "CUDA" in marks["skipif"].kwargs["reason"]
