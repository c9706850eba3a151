"""The LMCache findings of reports/conformance/2026-12-06-h100-lmcache/ reproduced on a stock install:
one `lmcache server` and two `vllm serve` replicas with LMCacheMPConnector, driven over HTTP. It
imports nothing of kvgate (the standard library only), so a maintainer can run it as it is.

  python3 scripts/gpu/lmcache_repro.py --model DIR --out DIR [--mode auto|engine_driven]
      [--prompts 10] [--tokens 4992] [--partial] [--vllm-arg=--flag ...]

Step 1, the stale chunks (lmcache-cuda-fallback-stale-chunks.md): for each of --prompts seeded
prompts of --tokens token ids, replica A computes it cold, then B sends it (B loads what A
stored), then A sends it again (A's own prefix hit: the same computation B's load should give).
A prompt is wrong when B's output differs from A's prefix hit.

Step 2, with --partial (lmcache-cuda-server-exit-and-assert.md): A sends a prompt of exactly
12 x 128 tokens twice; the second request hits 11 blocks locally and loads a part chunk from the
server. What the server and A did (exit status, the lines that matter in their logs) is recorded.

Step 3, with --abort (the scheduler assert alone, without a server crash): for each of five
seeded prompts, A computes it cold, then B's request for it is abandoned by its client after
20-100 ms, while B's asynchronous load may be in flight (vLLM aborts a request whose client went
away). Whether B's engine survived (its /health and process, its log's AssertionError) is recorded.

Everything goes into OUT (which must be empty or new): the processes' logs and result.json. A
prompt's comparison counts only where both of B's and A's requests answered; step 3 runs only
while the server and A live (step 2 may kill them) and counts only requests the client really cut
off. Exit status 0 when the steps ran (whatever they found), 2 when the system did not start or
OUT is not empty. SIGTERM stops the processes it started, as the end of the script does.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BOS = 1
BLOCK = 128
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RETRIEVED = re.compile(r"Retrieved (\d+) tokens")


_PORTS: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and not one handed out before in this run."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS:
            _PORTS.add(port)
            return port


def spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    print("lmcache_repro: $ " + " ".join(args), flush=True)
    with open(log, "wb") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """The process's whole group (its own session): SIGTERM, then SIGKILL for whatever is left
    (an engine process outliving its API server too)."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        print(f"lmcache_repro: process {proc.pid} did not exit after SIGKILL", file=sys.stderr, flush=True)


class NotStarted(Exception):
    """The system did not start (exit status 2)."""


def wait_for(what: str, ready, proc: subprocess.Popen, timeout: float) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise NotStarted(f"{what} exited with status {proc.returncode} before it was ready")
        if ready():
            print(f"lmcache_repro: {what} ready after {time.monotonic() - t0:.0f} s", flush=True)
            return
        time.sleep(0.5)
    raise NotStarted(f"{what} not ready after {timeout:.0f} s")


def accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def complete(port: int, ids: list[int], timeout: float) -> dict:
    """One greedy completion of the token ids: its text, or the error that ended it."""
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.load(r)
        return {"text": out["choices"][0]["text"], "s": round(time.monotonic() - t0, 3)}
    except urllib.error.HTTPError as exc:
        return {"error": f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}",
                "s": round(time.monotonic() - t0, 3)}
    except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError, KeyError, IndexError) as exc:
        # a refused or cut connection, a reply cut short or not a completion: the request failed
        return {"error": f"{type(exc).__name__}: {exc}", "s": round(time.monotonic() - t0, 3)}


def lines(path: Path, *words: str, last: int = 8) -> list[str]:
    text = ANSI.sub("", path.read_text(errors="replace")) if path.exists() else ""
    return [ln[:400] for ln in text.splitlines() if any(w in ln for w in words or ("",))][-last:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--python", default=sys.executable, help="the interpreter with vLLM and LMCache")
    ap.add_argument("--mode", choices=("auto", "engine_driven"), default="auto",
                    help="auto: the server's default transfer (on CUDA, the server copies through CUDA IPC); "
                         "engine_driven: lmcache.mp.mp_transfer_mode engine_driven (the worker copies)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4992)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partial", action="store_true", help="then the partial-chunk load (step 2)")
    ap.add_argument("--abort", action="store_true", help="then the aborted loads (step 3)")
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more `vllm serve` flag (repeatable)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    a = ap.parse_args(argv)
    # A's prefix hit (whole 128-token blocks of all but the last token) and B's load (whole 256-token
    # chunks of them) must cover the same tokens, or the two compute different partitions of the rest
    if ((a.tokens - 1) // BLOCK) % 2:
        ap.error(f"--tokens {a.tokens}: A's prefix hit would cover {(a.tokens - 1) // BLOCK * BLOCK} tokens and B's "
                 f"load {(a.tokens - 1) // (2 * BLOCK) * 2 * BLOCK}: choose a length whose full blocks (all but the "
                 "last token) are an even number")
    if a.out.exists() and any(a.out.iterdir()):
        print(f"lmcache_repro: {a.out} is not empty: another run's logs would be read as this one's", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below stops what was started
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONUNBUFFERED": "1"}

    port, http_port = free_port(), free_port()
    server_log = a.out / "lmcache-server.log"
    server = spawn([a.python, "-c", "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; "
                    "sys.exit(main())", "server", "--host", "127.0.0.1", "--port", str(port),
                    "--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", "256",
                    "--l1-size-gb", "1", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"],
                   server_log, env)
    procs = [server]
    result: dict = {"mode": a.mode, "model": str(a.model), "seed": a.seed, "tokens": a.tokens}
    try:
        wait_for("lmcache server", lambda: accepting(port), server, 180)
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}
        if a.mode == "engine_driven":
            extra["lmcache.mp.mp_transfer_mode"] = "engine_driven"
        kv = json.dumps({"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": extra})
        ports = {}
        for name in ("A", "B"):
            ports[name] = free_port()
            procs.append(spawn([a.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(a.model),
                                "--served-model-name", "m", "--port", str(ports[name]), "--host", "127.0.0.1",
                                "--enforce-eager", "--block-size", str(BLOCK), "--max-num-batched-tokens", "2048",
                                "--enable-prefix-caching", "--seed", "0", "--kv-transfer-config", kv, *a.vllm_arg],
                               a.out / f"replica-{name}.log", env))
        for name, proc in zip(("A", "B"), procs[1:]):
            wait_for(f"replica {name}", lambda p=ports[name]: healthy(p), proc, 600)

        rng = random.Random(a.seed)
        rows = []
        for i in range(a.prompts):
            ids = [BOS] + [rng.randrange(4, vocab) for _ in range(a.tokens - 1)]
            row = {"prompt": i, "a_cold": complete(ports["A"], ids, a.timeout)}
            time.sleep(1.0)  # A's stores reach the server before B asks
            before = len(lines(server_log, "Retrieved", last=10**6))
            row["b_load"] = complete(ports["B"], ids, a.timeout)
            time.sleep(0.2)  # the server's log line of B's retrieve
            row["b_retrieved"] = lines(server_log, "Retrieved", last=10**6)[before:]  # what B's request loaded
            row["a_hit"] = complete(ports["A"], ids, a.timeout)
            ran = all("text" in row[k] for k in ("a_cold", "b_load", "a_hit"))  # a failed request is not compared
            # B must have loaded exactly the tokens A's prefix hit covers (a cold B would compare equal and
            # prove nothing; a part load would compute another partition than A's hit)
            got = sum(int(m.group(1)) for ln in row["b_retrieved"] for m in [RETRIEVED.search(ln)] if m)
            row["loaded"] = got == (a.tokens - 1) // BLOCK * BLOCK
            row["wrong"] = ran and row["loaded"] and row["b_load"]["text"] != row["a_hit"]["text"]
            rows.append(row)
            print(f"lmcache_repro: prompt {i}: " + (
                "a request failed" if not ran else "B did not load A's whole hit: not compared" if not row["loaded"]
                else "WRONG: B's output differs from A's prefix hit" if row["wrong"] else "B equals A's prefix hit"),
                flush=True)
        result["stale_chunks"] = {
            "prompts": rows, "wrong": sum(r["wrong"] for r in rows),
            "compared": sum(r["loaded"] and all("text" in r[k] for k in ("a_cold", "b_load", "a_hit")) for r in rows),
            "failed": sum(not all("text" in r[k] for k in ("a_cold", "b_load", "a_hit")) for r in rows)}

        if a.partial:
            ids = [BOS] + [rng.randrange(4, vocab) for _ in range(12 * BLOCK - 1)]
            first = complete(ports["A"], ids, a.timeout)
            time.sleep(1.0)
            second = complete(ports["A"], ids, a.timeout)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60 and procs[1].poll() is None and "text" not in second:
                # the failed load's engine may be dying: it takes the replica down
                time.sleep(1)
            result["partial_chunk"] = {
                "first": first, "second": second, "server_exit": server.poll(), "replica_a_exit": procs[1].poll(),
                "replica_a_lines": lines(a.out / "replica-A.log", "AssertionError", "degraded", "Failing",
                                         "EngineDeadError", "unhealthy"),
                "server_last_lines": lines(server_log, last=6)}
            print(f"lmcache_repro: partial chunk: server exit {server.poll()}, replica A exit {procs[1].poll()}, "
                  f"second request {'ok' if 'text' in second else second['error'][:120]}", flush=True)
        b_up = procs[2].poll() is None and healthy(ports["B"])
        if a.abort and (server.poll() is not None or procs[1].poll() is not None or not b_up):
            result["abort"] = {"skipped": f"the server (exit {server.poll()}), replica A (exit {procs[1].poll()}) "
                                          f"or replica B (exit {procs[2].poll()}, healthy {b_up}) is gone before step 3"}
            print("lmcache_repro: aborts skipped: " + result["abort"]["skipped"], flush=True)
        elif a.abort:
            b_log = a.out / "replica-B.log"
            since = len(lines(b_log, last=10**9))  # what B logs from here on is step 3's
            aborts, alive = [], True
            for i, wait_ms in enumerate((20, 35, 50, 75, 100)):
                ids = [BOS] + [rng.randrange(4, vocab) for _ in range(a.tokens - 1)]
                cold = complete(ports["A"], ids, a.timeout)
                if "text" not in cold:  # nothing stored for B to load: no abort during a load
                    aborts.append({"prompt": i, "client_ms": wait_ms, "a_cold": cold, "skipped": "A failed"})
                    continue
                time.sleep(1.0)
                cut = complete(ports["B"], ids, wait_ms / 1000)  # the client goes away: vLLM aborts it
                time.sleep(3.0)
                alive = procs[2].poll() is None and healthy(ports["B"])
                aborts.append({"prompt": i, "client_ms": wait_ms, "a_cold": cold, "b_cut": cut,
                               "cut_off": "timed out" in cut.get("error", ""),  # else it answered first
                               "b_alive": alive})
                if not alive:
                    break
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30 and procs[2].poll() is None and not alive:  # the engine takes B down
                time.sleep(1)
            result["abort"] = {"requests": aborts, "cut_off": sum(bool(x.get("cut_off")) for x in aborts),
                               "b_alive": alive, "replica_b_exit": procs[2].poll(),
                               "replica_b_lines": [ln for ln in lines(b_log, last=10**9)[since:]
                                                   if any(w in ln for w in ("AssertionError", "assert ",
                                                                            "EngineDeadError", "scheduler.py"))][-8:]}
            print(f"lmcache_repro: aborts: B {'alive' if alive else 'DEAD'} after "
                  f"{result['abort']['cut_off']} request(s) cut off by the client, exit {procs[2].poll()}", flush=True)
    except NotStarted as exc:
        result["not_started"] = str(exc)
        print(f"lmcache_repro: {exc}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the stops short
        (a.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")  # before the stops, which may hang
        for proc in reversed(procs):
            stop(proc)
        signal.signal(signal.SIGTERM, previous)
    if "not_started" in result:
        return 2
    sc = result.get("stale_chunks", {})
    print(f"lmcache_repro: {a.mode}: {sc.get('wrong')} of {sc.get('compared')} prompts B loaded were wrong "
          f"({a.prompts} sent, {sc.get('failed')} failed); {a.out / 'result.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
