"""The connector's GPU engine (kvpool.gpu.transfer.TransferEngine) storing into and loading from a
GPU keeper's tier in device memory: `python -m kvpool keeper --backing vmm` in its own process (as
an operator runs it), two sessions of it in this process (a producer's and a consumer's, each its
own TierLink, TierBackend and VMM mapping of the buffer), the engine's pool being a TierBackend
(kvpool.gpu.tier_backend), its copies device to device. Scenarios and oracles:
kvgate.harness.scenarios.gpu_tier_engine.

  guard (edge)             fault                          oracle                        control
  store after write        the engine's KV write delayed   each page at its commit (read  UnorderedTransferEngine
                                                           out of the tier on a stream     dropping the edge:
                                                           of its own) byte-exact under    stale pages at the
                                                           its block's digest; then       commit
                                                           loaded byte-exact by the
                                                           other session's engine
  commit after copy        the store's copy into the tier  the same                        the same (the commit
                           and its sketch delayed                                          sent before the copy)
  load after read          the engine's read delayed       the engine's reads see the old  the same (the load
                                                           blocks; then the loaded ones    overwrites them first)
  read after load          the load's installs delayed     the engine's reads after        the same (the reads see
                                                           wait_for_load see the pages     the old blocks)
  the sketch check         a byte of a committed page      the load stops there, corrupt;  BlindLoadEngine: the
                           flipped in the tier             the pages before it exact       flipped page installed
  release after copy       the load's installs delayed     its pages leased at the keeper  EagerReleaseEngine: none
                                                           while they run                  leased
  following a restart      the keeper killed and started   the old grants refused, the     StuckSegmentEngine: its
                           again under a live engine, a    new buffer byte-exact both      loads corrupt, its store
                           store's copies held back        ways, no device fault           in the old buffer
                           across it
Each on the torch and the driver copy path. Not run here: two processes (the cross-process edges
with raw copies are suites/gpu/test_gpu_tier.py's), a keeper on another GPU.

Run: pytest suites/gpu/test_gpu_tier_engine.py -m gpu
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvgate.faults.gpu_controls import (  # noqa: E402
    BlindLoadEngine,
    EagerReleaseEngine,
    StuckSegmentEngine,
    UnorderedTransferEngine,
    engine_class,
)
from kvgate.harness.scenarios.gpu_tier_engine import (  # noqa: E402
    TierScenario,
    TierSide,
    run_check_after_copy,
    run_corrupt_page,
    run_release_held,
    run_restart,
    run_scenario,
)
from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, namespace  # noqa: E402
from kvpool.gpu.config import CopyPath, OrderingEdge, PageMemory  # noqa: E402
from kvpool.gpu.transfer import TransferEngine  # noqa: E402

from ..pool.test_gpu_keeper_restart import Keeper  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

GEOM = GEOMETRIES["nfirst-16k"]  # vLLM's blocks-first layout, 16 KiB blocks, chunks of 4, commit units of 3
PATHS = [CopyPath.TORCH, CopyPath.DRIVER]
# the load's ways through the tier: the torch path staged or with the direct install (the fused
# kernel writes the blocks), the driver path (staged)
WAYS = [pytest.param(CopyPath.TORCH, False, id="torch-staged"), pytest.param(CopyPath.TORCH, True, id="torch-direct"),
        pytest.param(CopyPath.DRIVER, False, id="driver")]
TOKEN = "tok"  # the restart suite's Keeper serves tenant default with it


def keeper_args(device: int, pages: int) -> tuple[str, ...]:
    return ("--backing", "vmm", "--gpu", str(device), "--page-size", str(GEOM.page_bytes), "--pages", str(pages))


class VmmKeeper:
    """`kvpool keeper --backing vmm` in its own process; restart() kills it and starts another
    under a new instance in the same run directory."""

    def __init__(self, run_dir, device: int, pages: int):  # noqa: ANN001
        self.run_dir, self.args = run_dir, keeper_args(device, pages)
        self.procs = [Keeper(run_dir, *self.args)]

    def restart(self) -> None:
        old = self.procs[-1]
        old.kill()
        self.procs.append(Keeper(self.run_dir, *self.args, before=old.address.instance))

    def stop(self) -> None:
        for k in self.procs:
            k.stop()


def _device() -> torch.device:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=dev)  # torch's primary context first: the mappings are made in it
    return dev


@pytest.fixture(scope="module")
def vmm_keeper(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tier-engine") / "k"
    run_dir.mkdir(mode=0o700)
    k = VmmKeeper(run_dir, _device().index, 4096)  # 64 MiB: every test of the module, nothing demoted
    try:
        yield k
    finally:
        k.stop()


def _sides(run_dir):  # noqa: ANN001, ANN202
    dev = _device()
    return TierSide(run_dir, "default", TOKEN, "producer", dev), TierSide(run_dir, "default", TOKEN, "consumer", dev)


@pytest.fixture
def sides(vmm_keeper):
    producer, consumer = _sides(vmm_keeper.run_dir)
    try:
        yield producer, consumer
    finally:
        producer.close()
        consumer.close()


def _factory(ns, path: CopyPath, scenario: TierScenario, direct: bool = False):  # noqa: ANN001, ANN202
    def make(layers, backend, lanes, drop):  # noqa: ANN001, ANN202
        base = TransferEngine if drop is None else UnorderedTransferEngine
        cls = engine_class(base, sketch_delay=scenario is TierScenario.COMMIT_AFTER_COPY)
        return cls(backend, ns, layers, GEOM.config(path, install_direct=direct), lanes=lanes,
                   **({"drop": drop} if drop is not None else {}))
    return make


# With the direct install the load's writes are the fused kernel's, on the copy stream, and the host
# waits for each chunk's check, which follows its copy: a load that installs every block has
# written them all before load() returns, so there is no read-after-load edge to drop (the
# engine's reads cannot pass writes that are over; a load that stops early still orders the
# engine after its chunks in flight, `done`). That cell is not generated. The load-after-read
# cell with the direct install asked for meets an engine whose read is held back: that load
# stages (the direct install is taken only once the engine's earlier work is over).
EDGE_CELLS = [pytest.param(scenario, *way.values, id=f"{scenario.value}-{way.id}")
              for scenario in TierScenario for way in WAYS
              if not (scenario is TierScenario.READ_AFTER_LOAD and way.values[1])]


@pytest.mark.fault_stream_delay
@pytest.mark.parametrize("scenario,path,direct", EDGE_CELLS)
def test_an_edge_of_the_engine_through_the_tier_holds_under_a_stream_delay_and_its_control_is_caught(
        scenario, path, direct, sides, delay_cycles, test_seed, tag):
    producer, consumer = sides
    ns = namespace(GEOM, f"{tag}-{scenario.value}-{path.value}-{direct}")
    make = _factory(ns, path, scenario, direct)
    ordered = run_scenario(scenario, GEOM, make, producer, consumer, ns, test_seed, delay_cycles, drop=False)
    control = run_scenario(scenario, GEOM, make, producer, consumer, ns, test_seed, delay_cycles, drop=True)
    assert ordered.valid is True, f"ordered transfer: {ordered}"
    assert ordered.evidence["pages_memory"] == PageMemory.DEVICE.value, ordered
    if path is CopyPath.TORCH and ordered.evidence["sketch_impl"] == "triton-dot":
        assert ordered.evidence["fused_copy"] is True, f"the torch path did not take the fused copy: {ordered}"
        assert ordered.evidence["direct_install"] is direct, f"the fused copy's install is not as asked: {ordered}"
    assert control.evidence.get("dropped_edges", 0) > 0, f"the control never reached its edge: {control}"
    assert control.valid is False and control.evidence.get("stale_pages", 0) > 0, \
        f"negative control NOT caught by the byte-exact oracle (the check cannot fail as run): {control}"


@pytest.mark.fault_stream_delay
@pytest.mark.parametrize("direct", [True, False], ids=["direct-install", "staged"])
def test_the_fused_copy_and_sketch_is_checked_after_it_ran_and_the_dropped_edge_is_caught(
        direct, sides, delay_cycles, test_seed, tag):
    producer, consumer = sides
    ordered = run_check_after_copy(GEOM, TransferEngine, producer, consumer, namespace(GEOM, f"{tag}-cac{direct}"),
                                   test_seed, delay_cycles, install_direct=direct)
    control = run_check_after_copy(GEOM, UnorderedTransferEngine, producer, consumer,
                                   namespace(GEOM, f"{tag}-cac-drop{direct}"), test_seed, delay_cycles,
                                   install_direct=direct, drop=OrderingEdge.CHECK_AFTER_COPY)
    assert ordered.evidence["fused_copy"] is True, f"the torch path did not take the fused copy: {ordered}"
    assert ordered.evidence["direct_install"] == (2 if direct else 0), ordered  # loads that took it
    assert ordered.valid is True, ordered
    assert control.evidence["dropped_edges"] > 0, f"the control never reached its edge: {control}"
    assert control.valid is False and control.evidence["stale_pages"] > 0, \
        f"negative control NOT caught by the byte-exact oracle: {control}"


@pytest.mark.fault_corrupt
@pytest.mark.parametrize("path,direct", WAYS)
def test_a_page_flipped_in_the_tier_is_refused_and_the_blind_control_is_caught(path, direct, sides, test_seed, tag):
    producer, consumer = sides
    good = run_corrupt_page(GEOM, TransferEngine, producer, consumer,
                            namespace(GEOM, f"{tag}-ok-{path.value}-{direct}"), test_seed, path, direct)
    blind = run_corrupt_page(GEOM, BlindLoadEngine, producer, consumer,
                             namespace(GEOM, f"{tag}-blind-{path.value}-{direct}"), test_seed, path, direct)
    assert good.valid is True, good
    assert good.evidence["direct_install"] is direct, good  # the load took the direct install
    assert blind.valid is False and blind.evidence["stale_pages"] > 0, f"negative control NOT caught: {blind}"


@pytest.mark.fault_stream_delay
@pytest.mark.parametrize("path", PATHS)
def test_a_loads_pages_stay_leased_at_the_keeper_while_its_work_runs_and_the_eager_control_is_caught(
        path, sides, delay_cycles, test_seed, tag):
    producer, consumer = sides
    held = run_release_held(GEOM, TransferEngine, producer, consumer, namespace(GEOM, f"{tag}-held-{path.value}"),
                            test_seed, delay_cycles, path)
    eager = run_release_held(GEOM, EagerReleaseEngine, producer, consumer,
                             namespace(GEOM, f"{tag}-eager-{path.value}"), test_seed, delay_cycles, path)
    assert held.valid is True, held
    assert eager.valid is False and eager.evidence["leased_while_in_flight"] == 0, \
        f"negative control NOT caught: {eager}"


@pytest.mark.fault_pool_restart
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("engine_cls,follows", [(TransferEngine, True), (StuckSegmentEngine, False)],
                         ids=["engine", "control-stuck-segment"])
def test_the_engine_follows_a_restarted_keeper_and_the_stuck_control_is_caught(
        engine_cls, follows, path, tmp_path, cycles_per_ms, test_seed, tag):
    run_dir = tmp_path / "k"
    run_dir.mkdir(mode=0o700)
    keeper = VmmKeeper(run_dir, _device().index, 256)
    producer, consumer = _sides(run_dir)
    try:
        verdict = run_restart(GEOM, engine_cls, producer, consumer, namespace(GEOM, f"{tag}-restart-{path.value}"),
                              test_seed, int(1000 * cycles_per_ms), keeper.restart, path)
    finally:
        producer.close()
        consumer.close()
        keeper.stop()
    if follows:
        assert verdict.valid is True, verdict
    else:
        assert verdict.valid is False and verdict.evidence.get("stale_pages", 0) > 0, \
            f"negative control NOT caught by the byte-exact oracle: {verdict}"
