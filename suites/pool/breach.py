"""A hostile tenant's process: authenticated as its own tenant, it tries to reach another
tenant's pages outside the protocol. Prints one JSON object: each attempt and its answer,
and whether the secret bytes (argv[2], hex) were found anywhere it could map or read.

  python -m suites.pool.breach RUN_DIR SECRET_HEX DAEMON_PID TENANT TOKEN
"""

from __future__ import annotations

import json
import mmap
import os
import sys
from pathlib import Path

from kvpool.client.pool_client import PoolClient


def _search(fd: int, secret: bytes) -> bool:
    size = os.fstat(fd).st_size
    if size == 0:
        return False
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
        return m.find(secret) >= 0


def main() -> int:
    run_dir, secret, pid, tenant, token = Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    attempts: list[dict] = []
    found = False
    with PoolClient(f"unix:{run_dir / 'pool.sock'}", tenant, token, name="breach") as own:
        mine = own.arena is not None and own.arena._bytes.tobytes().find(secret) >= 0
        attempts.append({"try": "search its own segment", "answer": "found" if mine else "not there"})
        found |= mine
    pool = json.loads((run_dir / "address.json").read_text())["name"]
    named = sorted(p.name for p in Path("/dev/shm").iterdir() if pool in p.name)
    attempts.append({"try": "a segment by name in /dev/shm", "answer": named or "none exists"})
    try:
        fds = sorted(os.listdir(f"/proc/{pid}/fd"), key=int)
    except OSError as exc:
        attempts.append({"try": f"list /proc/{pid}/fd", "answer": f"{type(exc).__name__}: {exc.strerror}"})
        fds = []
    for name in fds:
        path = f"/proc/{pid}/fd/{name}"
        try:
            target = os.readlink(path)
        except OSError as exc:
            attempts.append({"try": f"readlink {path}", "answer": f"{type(exc).__name__}: {exc.strerror}"})
            continue
        if "memfd:" not in target:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            attempts.append({"try": f"open {target}", "answer": f"{type(exc).__name__}: {exc.strerror}"})
            continue
        try:
            hit = _search(fd, secret)
        finally:
            os.close(fd)
        attempts.append({"try": f"open {target}", "answer": "found the secret" if hit else "opened, no secret"})
        found |= hit
    try:
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.read(1)
        attempts.append({"try": f"/proc/{pid}/mem", "answer": "readable"})
    except OSError as exc:
        attempts.append({"try": f"/proc/{pid}/mem", "answer": f"{type(exc).__name__}: {exc.strerror}"})
    print(json.dumps({"found": found, "attempts": attempts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
