"""Every GPU copy path under delay: one test per cell of the matrix of the engine's copy
paths (kvpool.gpu.paths: torch and driver engines, their issues, registered and pageable
host memory, each digest kind, store and load) against every ordering edge each path has
(kvgate.harness.scenarios.gpu_cells). Each cell runs its scenario under a seeded stream
delay with the engine (byte-exact, and issuing exactly the registry's edges on its path),
then with its control, the engine that drops that one edge, which the oracle must catch
(kvgate.harness.scenarios.gpu_matrix.check_cell). Where the host itself orders the edge on
a pageable path, the premise is probed on this GPU first (`premises`) and the control must
stay byte-exact. suites/unit/test_gpu_matrix.py fails where a path or an edge has no cell."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvgate.harness.scenarios.gpu_cells import cells  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import namespace  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fault_stream_delay,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

CELLS = cells()


@pytest.fixture(scope="module")
def premises(cycles_per_ms):
    from kvgate.harness.scenarios.gpu_matrix import probe_premises

    found = probe_premises(cycles_per_ms)
    print({f"{p}/{e}": v for (p, e), v in found.items()})
    return found


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_copy_path_edge_under_delay(cell, gpu_pool, client, delay_cycles, premises, test_seed, tag):
    from kvgate.harness.scenarios.gpu_matrix import MATRIX, check_cell

    ordered, control = check_cell(cell, gpu_pool, client, namespace(MATRIX, tag), test_seed, delay_cycles, premises)
    print(cell.id, cell.expect.value, ordered.evidence)
    print("control:", "not run (the host orders the edge)" if control is None else (control.reason, control.evidence))
