"""Two separate processes publish and load through one daemon; compare the bytes."""

import multiprocessing as mp
from pathlib import Path

import numpy as np

from harness.pool_proc import PoolProcess
from kvpool.client import PoolClient, load, publish
from kvpool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
BLOCKS = 24
PAGE = 16 * 1024


def _tokens(who: int) -> list[int]:
    return [who * 100_000 + i for i in range(BLOCKS * 16)]


def _blocks(seed: int, who: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, who])
    return [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(BLOCKS)]


def _worker(who: int, seed: int, address: str, token: str, out_dir: str, barrier) -> None:
    client = PoolClient(address, "default", token, name=f"proc-{who}")
    res = publish(client, NS, block_hashes(_tokens(who), 16), _blocks(seed, who))
    assert res.committed == BLOCKS, res
    barrier.wait(30)
    other = 1 - who
    out = np.zeros((BLOCKS, PAGE), np.uint8)

    got = load(client, NS, block_hashes(_tokens(other), 16), out.__getitem__)
    assert got.loaded == BLOCKS and got.miss is None, got
    np.save(Path(out_dir) / f"loaded-by-{who}.npy", out)
    client.close()


def test_two_processes_exchange_byte_identical_pages(tmp_path, test_seed):
    pool = PoolProcess.start(page_size=PAGE, num_pages=64, run_dir=tmp_path)
    try:
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=_worker, args=(w, test_seed, pool.unix, pool.token, str(tmp_path), barrier))
                 for w in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
        for who in (0, 1):
            loaded = np.load(tmp_path / f"loaded-by-{who}.npy")
            expected = np.stack(_blocks(test_seed, 1 - who))
            assert loaded.shape == expected.shape
            assert np.array_equal(loaded, expected), f"process {who} loaded other bytes than were published"
        assert pool.stop() == 0
    finally:
        pool.cleanup()
