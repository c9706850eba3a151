"""The GPU keeper as an operator runs it, on a real GPU: `python -m kvpool keeper --backing vmm`
in its own process (device memory from CUDA's VMM, exported as POSIX descriptors over its
attach socket), and two spawned replicas that reach it through TierClient over its control
socket (kvgate.harness.scenarios.gpu_keeper_socket). The wire tests without a GPU
(suites/pool/test_gpu_keeper_wire.py) use host stand-ins; these map device memory.

  commit edge   the producer's delayed write on a side stream, committed once its host saw the
                write and the sketch of it complete; the consumer's device-to-device copy of
                every page is byte-exact and its GPU sketch equals the committed digest.
                Control: the commit sent while the write still waits behind the delay; the
                byte-exact oracle must see the consumer read bytes that are not the producer's.
  the command   the address file names the VMM backing, this GPU's UUID and the pages asked
                for; SIGTERM ends the keeper with exit 0 and removes the address file.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvgate.harness.scenarios import gpu_keeper_socket as S  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fault_stream_delay,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

PAGE = 4 * 2**20  # whole kv-sketch-1 rows
PAGES = 32
TOKEN = "keeper-socket-token"
DELAY_MS = 2000  # the stream delay before the producer's write: far longer than the consumer's whole load (a few ms)


class Replica:
    def __init__(self, sock: str, device: int = 0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=S.socket_replica, args=(child, sock, "default", TOKEN, device))
        self.proc.start()
        child.close()
        self.hello = self._answer(180)

    def _answer(self, timeout: float = 60):  # noqa: ANN202
        assert self.conn.poll(timeout), "the replica did not answer"
        reply = self.conn.recv()
        assert reply[0] == "ok", f"the replica failed: {reply}"
        return reply[1:]

    def __call__(self, *cmd, timeout: float = 60):  # noqa: ANN002, ANN204
        self.conn.send(cmd)
        return self._answer(timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("exit")
            except (AssertionError, OSError, EOFError):
                self.proc.kill()
        self.proc.join(60)


@pytest.fixture
def keeper(tmp_path):
    run_dir = tmp_path / "keeper"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path.cwd()), os.environ.get("PYTHONPATH"))
                                                        if p)}
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", "keeper", "--gpu", "0", "--backing", "vmm",
                             "--run-dir", str(run_dir), "--page-size", str(PAGE), "--pages", str(PAGES),
                             "--tenant", f"default={TOKEN}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    address = run_dir / "keeper-address.json"
    end = time.monotonic() + 120
    while not address.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the keeper exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < end, "the keeper wrote no address within 120 s"
        time.sleep(0.1)
    try:
        yield proc, json.loads(address.read_text()), address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def replicas():
    made: list[Replica] = []

    def make(sock: str, device: int = 0) -> Replica:
        made.append(Replica(sock, device))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_a_delayed_write_committed_after_host_completion_loads_byte_exact_and_its_control_is_caught(
        keeper, replicas, cycles_per_ms, test_seed):
    proc, addr, _ = keeper
    assert addr["backing"] == "vmm" and addr["gpu"] == 0 and addr["page_size"] == PAGE
    producer, consumer = replicas(addr["socket"]), replicas(addr["socket"])
    assert producer.hello[0] != consumer.hello[0] and producer.hello[1] and consumer.hello[1]  # same GPU
    delay = int(DELAY_MS * cycles_per_ms)

    ks = S.keys(4, base=test_seed % 100_000)
    committed, pages = producer("publish", ks, test_seed, delay, "host", timeout=120)
    assert committed == 4 and len(set(pages)) == 4
    differ, bad, miss = consumer("load", ks, test_seed, timeout=120)
    assert miss is None and differ == 0 and bad == [], (differ, bad, miss)  # byte-exact, sketches agree

    # control: the commit edge dropped; the consumer's load runs while the write waits
    ks2 = S.keys(4, base=test_seed % 100_000 + 500_000)
    committed2, _ = producer("publish", ks2, test_seed + 1, delay, "none", timeout=120)
    assert committed2 == 4
    differ2, bad2, miss2 = consumer("load", ks2, test_seed + 1, timeout=120)
    producer("sync", timeout=120)
    assert miss2 is None
    assert differ2 > 0, "the byte-exact oracle missed a commit sent before the delayed write"
    assert bad2, "the consumer's GPU sketch missed the bytes that were not yet written"
    assert proc.poll() is None  # the keeper served both


def test_the_keeper_command_names_its_gpu_and_ends_cleanly_on_sigterm(keeper):
    proc, addr, address = keeper
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    if uuid is not None:  # torch names the device's UUID: the address file's must be this GPU's
        assert addr["device_uuid"] == str(uuid).replace("-", "").removeprefix("GPU").lower()[-32:], \
            (addr["device_uuid"], str(uuid))
    assert sum(addr["tenant_pages"].values()) == PAGES
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    assert not address.exists()
