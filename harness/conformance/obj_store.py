"""The object store behind vLLM's object-store tier (OffloadingConnector's `obj` secondary tier,
which reaches it through NIXL's OBJ backend, an S3 client): a local S3 server, moto's, that the
replicas share as they would a bucket in a data centre.

  start(report_dir)         the server on a free port and its bucket: (tier settings, process, log)
  objects(report_dir)       {key: size} of what the tier stored
  empty(report_dir)         every object removed (the reset before each scenario)
  settle(report_dir, ...)   wait until nothing more is being stored
  halve(report_dir)         each object replaced by its first half (the data fault)

The server's address, its bucket and keys are written to `obj-store.json` in the report folder,
where the hooks that get only that folder find them. moto keeps the objects in its process's
memory: a restart of the server loses them, which is what a replica's restart does not do.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvgate.harness.system.cluster import free_port
from kvgate.harness.system.procs import accepting, spawn, stop_group, wait_ready

BUCKET = "kvgate-tier"
KEYS = {"access_key": "kvgate", "secret_key": "kvgate-secret"}  # moto takes any; NIXL's client sends them
STATE = "obj-store.json"


class ObjStoreError(RuntimeError):
    """The object store did not start, or its state file is missing."""


def _state(report_dir: Path) -> dict[str, Any]:
    path = Path(report_dir) / STATE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ObjStoreError(f"no object store recorded in {path}: {exc}") from exc


def client(report_dir: Path):  # noqa: ANN201
    """An S3 client of the recorded server (boto3)."""
    import boto3

    st = _state(report_dir)
    return boto3.client("s3", endpoint_url=f"http://{st['endpoint']}", region_name="us-east-1",
                        aws_access_key_id=st["access_key"], aws_secret_access_key=st["secret_key"])


def start(report_dir: Path):  # noqa: ANN201
    """moto's S3 server by this interpreter on a free port, its bucket made; the tier's
    settings for the connector's extra config (`secondary_tiers`)."""
    report_dir = Path(report_dir)
    port = free_port()
    log = report_dir / "obj-store.log"
    proc = spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], log, dict(os.environ))
    try:
        wait_ready(proc, accepting(port), 60.0, "object store (moto)", log, poll_s=0.2, note_every=30)
        (report_dir / STATE).write_text(json.dumps({"endpoint": f"127.0.0.1:{port}", "bucket": BUCKET, **KEYS}))
        client(report_dir).create_bucket(Bucket=BUCKET)
    except BaseException:  # no Service holds it yet: nothing else would stop it
        stop_group(proc)
        raise
    tier = {"type": "obj", "bucket": BUCKET, "endpoint_override": f"127.0.0.1:{port}", "scheme": "http", **KEYS}
    return {"secondary_tiers": [tier]}, proc, log


def objects(report_dir: Path) -> dict[str, int]:
    s3, out = client(report_dir), {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def empty(report_dir: Path) -> None:
    s3, keys = client(report_dir), sorted(objects(report_dir))
    for i in range(0, len(keys), 1000):
        s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})


def settle(report_dir: Path, quiet_s: float = 1.0, timeout_s: float = 30.0) -> None:
    """The tier uploads a block after the request finished, from the CPU tier, on its own
    threads (an S3 PUT: an object is there whole or not at all): wait until the bucket has
    not changed for `quiet_s`."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = objects(report_dir)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the object-store tier kept storing for {timeout_s} s")


def halve(report_dir: Path) -> dict[str, Any]:
    """Each object stored since the scenario began (the bucket was emptied before it) replaced
    by its first half: the key is there, its lookup hits, its read is short."""
    s3, cut = client(report_dir), 0
    for key, size in objects(report_dir).items():
        body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=key, Body=body[: size // 2])
        cut += 1
    return {"where": f"s3://{BUCKET} at {_state(report_dir)['endpoint']}",
            "how": "each object replaced by its first half", "objects": cut, "broken": cut}
