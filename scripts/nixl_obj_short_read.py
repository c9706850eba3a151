"""NIXL's OBJ backend (the S3 client of vLLM's object-store KV tier) reports a READ of an object
shorter than the read as DONE, and leaves the rest of the buffer as it was. Reproduced on a stock
install, without kvgate (the standard library, NIXL, boto3 and moto's S3 server only):

  pip install nixl-cu12 'moto[s3]' flask flask-cors      (or nixl-cu13; any CUDA-less machine will do)
  python3 scripts/nixl_obj_short_read.py [--size 4096] [--out result.json]

What it does: starts moto's S3 server on a free port and makes a bucket; registers a DRAM buffer of
two blocks with a NIXL agent and an OBJ backend on that bucket, as vLLM's object-store tier does
(vllm/v1/kv_offload/tiering/obj/manager.py: prep_xfer_dlist, make_prepped_xfer); WRITEs block 0
(bytes 'A') to a key; replaces the object by its first half (a truncated upload, a store that lost a
part); fills block 1 with 0xEE (what a tier's buffer held before) and READs the key into it.

Expected: the READ fails (the object is shorter than the descriptor). Actual (NIXL 1.5.1): DONE, the
first half of block 1 is the object's bytes and the second half is still 0xEE: a caller that trusts
DONE (vLLM's tier does) serves a block half of which is whatever its buffer held.

Exit status 0 when it ran (result in --out and on stdout: "short": true when the bug shows), 2 when
NIXL, boto3 or moto is missing or the server does not start.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096, help="bytes of a block (even)")
    ap.add_argument("--out", default="", help="write the result here too (JSON)")
    a = ap.parse_args(argv)
    try:
        import boto3
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        print(f"nixl_obj_short_read: {exc} (pip install nixl-cu12 'moto[s3]' flask flask-cors)", file=sys.stderr)
        return 2
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    print("nixl_obj_short_read: moto's server did not start", file=sys.stderr)
                    return 2
                time.sleep(0.2)
        bucket, keys = "nixl-short-read", {"access_key": "k", "secret_key": "s"}
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id=keys["access_key"], aws_secret_access_key=keys["secret_key"])
        s3.create_bucket(Bucket=bucket)

        agent = nixl_agent("ObjAgent", nixl_agent_config(backends=[]))
        agent.create_backend("OBJ", {"bucket": bucket, "endpoint_override": f"127.0.0.1:{port}", "scheme": "http",
                                     **keys})
        size = a.size
        buf = (ctypes.c_char * (2 * size))()
        base = ctypes.addressof(buf)
        agent.register_memory([(base, 2 * size, 0, "")], "DRAM")
        dram = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, size, 0), (base + size, size, 0)], "DRAM")
        dev = [1]

        def move(op: str, block: int, key: str) -> str:
            files = agent.register_memory([(0, size, dev[0], key)], "OBJ")
            dev[0] += 1
            obj = agent.prep_xfer_dlist("ObjAgent", files.trim())
            handle = agent.make_prepped_xfer(op, dram, [block], obj, [0])
            state = agent.transfer(handle)
            t0 = time.monotonic()
            while state in ("PROC", "OK") and time.monotonic() - t0 < 30:
                state = agent.check_xfer_state(handle)
                if state == "PROC":
                    time.sleep(0.01)
            agent.release_xfer_handle(handle)
            agent.release_dlist_handle(obj)
            agent.deregister_memory(files)
            return state

        ctypes.memset(base, ord("A"), size)
        wrote = move("WRITE", 0, "kv/block")
        stored = s3.head_object(Bucket=bucket, Key="kv/block")["ContentLength"]
        s3.put_object(Bucket=bucket, Key="kv/block", Body=b"A" * (size // 2))  # truncated
        ctypes.memset(base + size, 0xEE, size)
        read = move("READ", 1, "kv/block")
        got = bytes(buf[size:2 * size])
        result = {"nixl_write": wrote, "stored_bytes": stored, "object_bytes_at_read": size // 2, "read_bytes": size,
                  "nixl_read": read, "first_half_from_object": got[: size // 2] == b"A" * (size // 2),
                  "second_half_untouched_0xEE": got[size // 2:] == b"\xee" * (size - size // 2)}
        result["short"] = read == "DONE" and result["second_half_untouched_0xEE"]
        text = json.dumps(result, indent=1)
        print(text)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text + "\n")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
