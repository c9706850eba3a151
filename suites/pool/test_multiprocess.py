"""Two separate processes publish and load through one daemon; compare the bytes."""

from kvgate.harness.scenarios.pool import EXCHANGE_BLOCKS, EXCHANGE_PAGE, exchange_between_processes
from kvgate.harness.system.pool import PoolProcess


def test_two_processes_exchange_byte_identical_pages(tmp_path, test_seed):
    pool = PoolProcess.start(page_size=EXCHANGE_PAGE, num_pages=64, run_dir=tmp_path)
    try:
        verdict = exchange_between_processes(pool, test_seed, tmp_path)
        assert verdict.valid is True, verdict
        assert verdict.evidence["blocks_loaded"] == 48
        assert pool.stop() == 0
    finally:
        pool.cleanup()


def test_the_exchange_check_catches_a_pool_that_serves_other_bytes(tmp_path, test_seed):
    """Negative control: the daemon on a catalog that serves each run's pages in reverse
    order (kvgate.faults.controls.CrossedCatalog, digests consistent with the pages served, so no
    loader safeguard trips) must fail the same exchange check."""
    pool = PoolProcess.start(page_size=EXCHANGE_PAGE, num_pages=64, run_dir=tmp_path)
    try:
        assert exchange_between_processes(pool, test_seed, tmp_path).valid is True
        for who in (0, 1):
            (tmp_path / f"loaded-by-{who}.npy").unlink()
        pool.stop()
        pool.restart(catalog="crossed")
        verdict = exchange_between_processes(pool, test_seed, tmp_path)
        assert verdict.valid is False
        assert verdict.evidence["blocks_differing"] == 2 * EXCHANGE_BLOCKS  # every block of both processes
    finally:
        pool.cleanup()
