"""scripts/gpu/lmcache_repro.py, the stock reproduction of the LMCache findings, without LMCache or
vLLM: what it refuses before starting anything, a system that does not start (exit status 2,
its result written, nothing left running), and, against a stubbed server and replicas, what it
counts as wrong and how it tells an abort that kills B from one B survives."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("lmcache_repro", REPO / "scripts" / "gpu" / "lmcache_repro.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 2048}))
    return model


@pytest.mark.parametrize("tokens", [5001, 4992 + 128, 129])
def test_a_prompt_length_off_the_chunk_is_refused(tmp_path, tokens):
    """A's reference (its own prefix hit, whole blocks) and B's load (whole 256-token chunks) would
    cover different tokens and compute different partitions: B's text could differ with every
    byte right, a false "wrong"."""
    with pytest.raises(SystemExit) as exc:
        _script().main(["--model", str(_model(tmp_path)), "--out", str(tmp_path / "o"), "--tokens", str(tokens)])
    assert exc.value.code == 2 and not (tmp_path / "o").exists()


def test_an_output_folder_in_use_is_refused(tmp_path):
    """Its logs would be another run's lines read as this run's evidence."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "replica-B.log").write_text("AssertionError\n")
    assert _script().main(["--model", str(_model(tmp_path)), "--out", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["replica-B.log"]


def test_a_server_that_does_not_start_exits_2_with_its_result_written(tmp_path, capsys):
    """The interpreter given cannot run LMCache's server (it exits at once): exit status 2, the
    reason in result.json, and the process stopped."""
    out = tmp_path / "o"
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    fake.chmod(0o755)
    assert _script().main(["--model", str(_model(tmp_path)), "--out", str(out), "--python", str(fake)]) == 2
    result = json.loads((out / "result.json").read_text())
    assert "lmcache server exited with status 3" in result["not_started"]
    assert "stale_chunks" not in result
    assert "exited with status 3" in capsys.readouterr().err


def test_log_lines_are_read_without_colour_codes(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\x1b[32;20m[t] LMCache INFO:\x1b[0m Retrieved 4864 tokens\nother\n")
    assert _script().lines(log, "Retrieved") == ["[t] LMCache INFO: Retrieved 4864 tokens"]
    assert _script().lines(tmp_path / "missing.log", "x") == []


# A stand-in interpreter for the reproduction: `-c ... server --port P` is LMCache's server (it logs
# "Retrieved N tokens" for each load a replica tells it of), `-m vllm...api_server --port P` is a
# replica, A or B by the log its output goes to. Every
# answer is a function of the prompt; the plan (STUB_PLAN, by B's request number) makes B load the
# prompt's whole hit ("load"), nothing and answer otherwise ("cold"), load it and answer otherwise
# ("wrong"), answer 500
# ("fail"), or, for its requests after those, die of the scheduler's assert ("die") or answer late.
STUB = r'''
import hashlib, http.server, json, os, socket, socketserver, sys, threading, time

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
plan = json.loads(os.environ["STUB_PLAN"])
if args[0] == "-c":  # the server
    class Server(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True

    class Told(socketserver.StreamRequestHandler):
        def handle(self):
            for line in self.rfile:
                print(f"\x1b[32m[stub] LMCache INFO:\x1b[0m Retrieved {int(line)} tokens", flush=True)

    Server(("127.0.0.1", port), Told).serve_forever()
name = "B" if os.readlink("/proc/self/fd/1").endswith("replica-B.log") else "A"  # its log, by its name
extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
server = int(extra["lmcache.mp.port"])
count = [0]


class Replica(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {})

    def do_POST(self):
        ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        text = hashlib.sha256(str(ids).encode()).hexdigest()[:12]
        if name == "B":
            i, count[0] = count[0], count[0] + 1
            what = plan[i] if i < len(plan) else os.environ.get("STUB_AFTER", "late")
            if what == "die":  # after the client went away: vLLM aborts the request, then asserts
                time.sleep(0.3)
                print("(EngineCore pid=1) AssertionError: assert req_id in self.requests", flush=True)
                os._exit(1)
            if what == "late":
                time.sleep(0.3)
            if what == "fail":
                return self._send(500, {"error": "engine"})
            if what in ("load", "wrong"):
                with socket.create_connection(("127.0.0.1", server)) as s:
                    s.sendall(f"{(len(ids) - 1) // 128 * 128}\n".encode())
                time.sleep(0.05)
            if what == "wrong":
                text += "x"
            if what == "cold":  # computed whole: another partition than A's hit, whose last bits may differ
                text += "c"
        try:
            self._send(200, {"choices": [{"text": text}]})
        except OSError:  # the client went away
            pass


http.server.ThreadingHTTPServer(("127.0.0.1", port), Replica).serve_forever()
'''


def _stubbed(tmp_path: Path, monkeypatch, plan: list[str], after: str = "late") -> Path:  # noqa: ANN001
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{STUB}")
    fake.chmod(0o755)
    monkeypatch.setenv("STUB_PLAN", json.dumps(plan))
    monkeypatch.setenv("STUB_AFTER", after)
    return fake


def test_only_a_whole_load_that_answers_otherwise_counts_as_wrong(tmp_path, monkeypatch):
    """Against a stubbed server and replicas: B's answer that differs from A's prefix hit after
    loading A's whole hit is wrong; a cold B (another computation, whose output may differ) and a
    failed request are not compared; a load that answers the same is right."""
    fake = _stubbed(tmp_path, monkeypatch, ["load", "wrong", "cold", "fail"])
    out = tmp_path / "o"
    assert _script().main(["--model", str(_model(tmp_path)), "--out", str(out), "--python", str(fake),
                           "--prompts", "4", "--tokens", "513", "--timeout", "20"]) == 0
    sc = json.loads((out / "result.json").read_text())["stale_chunks"]
    assert (sc["wrong"], sc["compared"], sc["failed"]) == (1, 2, 1)
    rows = sc["prompts"]
    assert [r["loaded"] for r in rows] == [True, True, False, False]
    assert [r["wrong"] for r in rows] == [False, True, False, False]
    assert rows[0]["b_retrieved"] == ["[stub] LMCache INFO: Retrieved 512 tokens"]
    assert "HTTP 500" in rows[3]["b_load"]["error"]


@pytest.mark.parametrize("after", ["die", "late"])
def test_an_abort_that_kills_b_is_told_from_one_it_survives(tmp_path, monkeypatch, after):
    """Step 3: B's requests cut off by their client; a B whose engine dies of the assert is
    recorded dead with the assert's line, one that answers late stays alive through all five."""
    fake = _stubbed(tmp_path, monkeypatch, ["load"], after)
    out = tmp_path / "o"
    assert _script().main(["--model", str(_model(tmp_path)), "--out", str(out), "--python", str(fake),
                           "--prompts", "1", "--tokens", "513", "--timeout", "20", "--abort"]) == 0
    abort = json.loads((out / "result.json").read_text())["abort"]
    if after == "die":
        assert abort["b_alive"] is False and abort["replica_b_exit"] == 1 and len(abort["requests"]) == 1
        assert abort["cut_off"] == 1
        assert any("assert req_id in self.requests" in ln for ln in abort["replica_b_lines"])
    else:
        assert abort["b_alive"] is True and abort["replica_b_exit"] is None
        assert abort["cut_off"] == 5 and abort["replica_b_lines"] == []
