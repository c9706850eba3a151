"""kvgate.harness.conformance.obj_store, the S3 server behind the `offloading-obj` row (vLLM's
object-store tier): moto's server started and stopped as the connector's service, its bucket
emptied, settled, and its objects halved (the data fault), all through a real server and a real
S3 client; and, where NIXL is installed, its OBJ backend (what vLLM's tier uses) writing into it."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("moto.server", reason="moto's S3 server: `make setup` installs it")

from kvgate.harness.conformance import obj_store  # noqa: E402
from kvgate.harness.conformance.connectors import CONNECTORS, Service  # noqa: E402


@pytest.fixture
def store(tmp_path):  # noqa: ANN001, ANN201
    settings, proc, log = obj_store.start(tmp_path)
    svc = Service(settings, proc, log)
    yield tmp_path, svc
    svc.stop()
    assert proc.poll() is not None


def _put(report_dir, key: str, body: bytes) -> None:  # noqa: ANN001
    obj_store.client(report_dir).put_object(Bucket=obj_store.BUCKET, Key=key, Body=body)


def test_the_tier_settings_name_the_running_server_and_its_bucket(store):
    report_dir, svc = store
    (tier,) = svc.settings["secondary_tiers"]
    assert tier["type"] == "obj" and tier["bucket"] == obj_store.BUCKET and tier["scheme"] == "http"
    assert tier["endpoint_override"] == obj_store._state(report_dir)["endpoint"]
    assert obj_store.objects(report_dir) == {}


def test_halving_shortens_every_object_to_its_first_half_and_empty_removes_them(store):
    report_dir, _ = store
    _put(report_dir, "m/a.bin", bytes(range(256)) * 4)
    _put(report_dir, "m/b.bin", b"x" * 10)
    done = obj_store.halve(report_dir)
    assert done["objects"] == 2
    assert obj_store.objects(report_dir) == {"m/a.bin": 512, "m/b.bin": 5}
    body = obj_store.client(report_dir).get_object(Bucket=obj_store.BUCKET, Key="m/a.bin")["Body"].read()
    assert body == (bytes(range(256)) * 4)[:512]
    obj_store.empty(report_dir)
    assert obj_store.objects(report_dir) == {}


def test_settle_waits_for_the_uploads_to_stop_and_gives_up_on_endless_ones(store):
    report_dir, _ = store
    stop = threading.Event()

    def upload(prefix: str, n: int) -> None:
        for i in range(n):
            if stop.is_set():
                return
            _put(report_dir, f"{prefix}{i}", b"v")
            time.sleep(0.3)

    writer = threading.Thread(target=upload, args=("k", 6))
    writer.start()
    obj_store.settle(report_dir, quiet_s=1.0, timeout_s=30)
    assert not writer.is_alive() and len(obj_store.objects(report_dir)) == 6
    writer = threading.Thread(target=upload, args=("e", 10**6))
    writer.start()
    try:
        with pytest.raises(TimeoutError):
            obj_store.settle(report_dir, quiet_s=1.0, timeout_s=2.0)
    finally:
        stop.set()
        writer.join()


def test_a_folder_without_a_server_is_refused(tmp_path):
    with pytest.raises(obj_store.ObjStoreError, match="no object store recorded"):
        obj_store.objects(tmp_path)


def test_the_row_needs_nixl_and_its_store_beside_the_connector():
    prof = CONNECTORS["offloading-obj"]
    assert set(prof.requires) == {"nixl._api", "boto3", "moto.server"} and prof.device == "cuda"
    assert "secondary_tiers" not in prof.settings(None)  # the service names the tier


def test_nixl_obj_backend_writes_and_reads_the_bucket(store):
    """What vLLM's object-store tier does, through NIXL's OBJ backend: a DRAM buffer written to
    a key of the bucket and read back into another."""
    nixl = pytest.importorskip("nixl._api", reason="NIXL (on the GPU host: carried, scripts/gpu/README.md)")
    import ctypes

    report_dir, svc = store
    (tier,) = svc.settings["secondary_tiers"]
    agent = nixl.nixl_agent("kvgate-test", nixl.nixl_agent_config(backends=[]))
    agent.create_backend("OBJ", {k: tier[k] for k in ("bucket", "endpoint_override", "scheme", "access_key",
                                                       "secret_key")})
    src = ctypes.create_string_buffer(bytes(range(256)) * 16, 4096)
    dst = ctypes.create_string_buffer(4096)

    def move(op: str, buf) -> None:  # noqa: ANN001
        agent.register_memory([(ctypes.addressof(buf), 4096, 0, "")], "DRAM")
        agent.register_memory([(0, 4096, 1, "m/block")], "OBJ")
        handle = agent.initialize_xfer(op, agent.get_xfer_descs([(ctypes.addressof(buf), 4096, 0)], "DRAM"),
                                       agent.get_xfer_descs([(0, 4096, 1)], "OBJ"), "kvgate-test")
        agent.transfer(handle)
        deadline = time.monotonic() + 30
        while agent.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agent.check_xfer_state(handle) == "DONE"

    move("WRITE", src)
    assert obj_store.objects(report_dir) == {"m/block": 4096}
    move("READ", dst)
    assert dst.raw == src.raw


def test_the_short_read_reproduction_runs_or_says_what_it_lacks(tmp_path, capsys):
    """scripts/nixl_obj_short_read.py, the reproduction of NIXL's OBJ short read without kvgate:
    exit 2 naming what to install where NIXL is missing; where it is there, its result."""
    import importlib
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "nixl_obj_short_read.py"
    spec = importlib.util.spec_from_file_location("nixl_obj_short_read", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    try:
        importlib.import_module("nixl._api")
    except ImportError:
        assert mod.main(["--out", str(out)]) == 2
        assert "pip install nixl" in capsys.readouterr().err and not out.exists()
        return
    assert mod.main(["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["nixl_write"] == "DONE" and result["stored_bytes"] == 4096 and result["first_half_from_object"]
    assert result["short"] == (result["nixl_read"] == "DONE" and result["second_half_untouched_0xEE"])
