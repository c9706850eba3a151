"""Stream delay on the producing stream, for stores and loads, both copy paths, three
layouts, three transfers in flight: every page byte-exact. Each test also runs its
negative control, the same transfers with the one ordering edge dropped
(kvgate.faults.gpu_controls.UnorderedTransferEngine), and fails unless the control is caught."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvpool.gpu.config import CopyPath  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, Scenario, check_with_control, engine_factory, namespace  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fault_stream_delay,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("scenario", list(Scenario))
def test_stream_delay_byte_exact_and_control_caught(scenario, path, geometry, gpu_pool, client, delay_cycles,
                                                    test_seed, tag):
    geom = GEOMETRIES[geometry]
    ns = namespace(geom, tag)
    with engine_factory(gpu_pool, client, geom, ns, path) as make:
        check_with_control(scenario, geom, make, client, ns, test_seed, delay_cycles)


@pytest.mark.parametrize("scenario", [Scenario.STORE_RAW, Scenario.LOAD_RAW])
def test_driver_path_without_batching(scenario, gpu_pool, client, delay_cycles, test_seed, tag):
    """The one-copy-per-call fallback of the raw-pointer path keeps the same ordering."""
    geom = GEOMETRIES["flash-128k"]
    ns = namespace(geom, tag)
    with engine_factory(gpu_pool, client, geom, ns, CopyPath.DRIVER, batched=False) as make:
        check_with_control(scenario, geom, make, client, ns, test_seed, delay_cycles)
