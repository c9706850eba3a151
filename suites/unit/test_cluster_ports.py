"""A replica is healthy only once its own process group listens on its port, and one whose port
another process took (free_port is unique within a process, not across test workers) is started
again on another port: real processes and sockets, a stand-in for `vllm serve` that answers
/health as its API server does and fails to bind as it does."""

import re
import sys
import textwrap

import pytest

from kvgate.harness.client.http import healthy
from kvgate.harness.system import cluster as cluster_mod
from kvgate.harness.system.cluster import Cluster, ClusterStartError, Replica, ReplicaSpec
from kvgate.harness.system.procs import listening, spawn, stop_group

SERVER = textwrap.dedent("""
    import http.server, socket, sys, time
    port, delay, reuse_port = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:] == ["reuse_port"]
    time.sleep(delay)  # an engine starting before its API server binds
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    class S(http.server.HTTPServer):
        def server_bind(self):
            if reuse_port:  # as vLLM 0.24's API server does
                self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            super().server_bind()
    def create_server_socket():  # the name vLLM's API server binds in: a failure's traceback reads the same
        return S(("127.0.0.1", port), H)
    srv = create_server_socket()
    print("serving", port, flush=True)
    srv.serve_forever()
""")


@pytest.fixture
def server_script(tmp_path):
    path = tmp_path / "server.py"
    path.write_text(SERVER)
    return path


@pytest.fixture(params=["exclusive"])
def thief(request, tmp_path, server_script):
    """Another process group serving /health on a port the cluster will hand a replica."""
    port = cluster_mod.free_port()
    proc = spawn([sys.executable, str(server_script), str(port), "0", request.param], tmp_path / "thief.log")
    assert _until(lambda: listening(proc.pid, port)), (tmp_path / "thief.log").read_text()
    yield port, proc
    stop_group(proc, grace=5)


def _until(pred, seconds=30.0):
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def fake_cluster(tmp_path, monkeypatch, server_script, ports, delay=1.5, mode="exclusive"):
    """A Cluster whose replicas are the stand-in server, told the ports in `ports` in turn."""
    cluster = Cluster(tmp_path, tmp_path / "report", page_size=4096)
    (tmp_path / "report").mkdir()
    handed = iter(ports)

    def _spawn(spec):
        port = next(handed)
        log_path = tmp_path / "report" / f"replica-{spec.name}.log"
        log_from = log_path.stat().st_size if log_path.exists() else 0
        proc = spawn([sys.executable, str(server_script), str(port), str(delay), mode], log_path)
        return Replica(spec, port, proc, log_path, log_from)

    monkeypatch.setattr(cluster, "_spawn", _spawn)
    return cluster


def test_the_group_listening_on_a_port_is_told_apart_from_another(tmp_path, thief):
    port, proc = thief
    other = spawn([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "other.log")
    try:
        assert healthy(f"http://127.0.0.1:{port}")  # what a health check alone would take for anyone's
        assert listening(proc.pid, port)
        assert not listening(other.pid, port)
        assert not listening(proc.pid, cluster_mod.free_port())
    finally:
        stop_group(other, grace=5)
    assert not listening(other.pid, port)  # a group that is gone listens nowhere


def test_a_replica_whose_port_is_taken_is_started_again_on_another(tmp_path, monkeypatch, server_script, thief):
    """The thief answers /health on the replica's first port from before the replica starts: a
    health check alone would call the replica healthy there (and send it the thief's requests)."""
    taken, _ = thief
    fresh = cluster_mod.free_port()
    cluster = fake_cluster(tmp_path, monkeypatch, server_script, [taken, fresh])
    replica = cluster.add_replica(ReplicaSpec("C", "0", connector=False))
    try:
        assert replica.port == fresh and cluster.replicas["C"] is replica
        assert listening(replica.proc.pid, fresh)
        log = replica.log_path.read_text()
        assert "in create_server_socket" in log and "Address already in use" in log  # the first start's part
    finally:
        cluster.remove_replica("C")


@pytest.mark.parametrize("thief", ["reuse_port"], indirect=True)
def test_a_replica_listening_beside_another_server_is_started_again_on_another(tmp_path, monkeypatch, server_script,
                                                                               thief):
    """Both set SO_REUSEPORT (vLLM 0.24's API server does): both bind and listen on one port, both
    answer /health, and the kernel splits the connections. The replica is not healthy there."""
    taken, proc = thief
    fresh = cluster_mod.free_port()
    cluster = fake_cluster(tmp_path, monkeypatch, server_script, [taken, fresh], mode="reuse_port")
    first = []
    monkeypatch.setattr(cluster, "nemesis", lambda action, **f: first.append((action, f)))
    replica = cluster.add_replica(ReplicaSpec("C", "0", connector=False))
    try:
        assert replica.port == fresh and listening(replica.proc.pid, fresh)
        assert [(a, f["port"], f["why"]) for a, f in first] == [("replica_port_taken", taken,
                                                                 "shared with another server")]
        assert listening(proc.pid, taken)  # the thief alone again: the first start was stopped
    finally:
        cluster.remove_replica("C")


def test_a_taken_port_every_time_is_a_start_error(tmp_path, monkeypatch, server_script, thief):
    taken, _ = thief
    cluster = fake_cluster(tmp_path, monkeypatch, server_script, [taken] * (cluster_mod.PORT_RETRIES + 1),
                           delay=0.2)
    with pytest.raises(ClusterStartError, match="Address already in use"):
        cluster.add_replica(ReplicaSpec("C", "0", connector=False))


@pytest.mark.parametrize("last_words", ["engine failed: out of memory",
                                        "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5555')"],
                         ids=["other-cause", "engine-socket"])
def test_a_replica_that_exits_for_another_cause_is_not_started_again(tmp_path, monkeypatch, last_words):
    """Another cause, another socket of the engine's included: one start, its error raised."""
    script = tmp_path / "dies.py"
    script.write_text(f"import sys; print({last_words!r}, flush=True); sys.exit(3)")
    starts = []
    cluster = fake_cluster(tmp_path, monkeypatch, script, [cluster_mod.free_port()] * 3)
    inner = cluster._spawn

    def counted(spec):
        starts.append(spec.name)
        return inner(spec)

    monkeypatch.setattr(cluster, "_spawn", counted)
    with pytest.raises(ClusterStartError, match=re.escape(last_words)):
        cluster.add_replica(ReplicaSpec("C", "0", connector=False))
    assert starts == ["C"]
