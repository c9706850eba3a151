"""The model identity in the connector's namespace (kvpool.connector.identity): a checkpoint over
64 MiB with one tensor of the same shape rewritten (same size, same safetensors header,
mtime put back or not) gets another namespace, at one path or at two; an unchanged one
reads no weight byte at its next start (counted by the kernel: /proc/self/io rchar); the
hub commit of a snapshot is part of it. And the hostile checkpoint scenario's attempt
against a real pool, with its control (the header-only fingerprint) caught by the same
judgement."""

import os
import shutil
import time

import pytest

from kvgate.harness.scenarios.hostile.checkpoint import (RACY_WAIT_S, WEIGHTS, attempt, build_checkpoint,
                                                  checkpoint_namespace, judge, rewrite_tensor)
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient

SEED = 11


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "identity-cache"
    monkeypatch.setenv("KVPOOL_IDENTITY_CACHE", str(path))
    return path


@pytest.fixture
def ckpt(tmp_path, cache):
    path = build_checkpoint(tmp_path / "ckpt", SEED)
    assert (path / WEIGHTS).stat().st_size > 64 * 2**20
    time.sleep(RACY_WAIT_S)  # so that the first start's digests are cached (kvpool.connector.identity.RACY_NS)
    yield path
    shutil.rmtree(path)


def rchar() -> int:
    """Bytes this process has read through read(2) and kin, page cache or not."""
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def restart_namespace(path):  # noqa: ANN001, ANN201
    """The namespace a replica starting now computes: nothing of a previous computation in
    this process is kept (a per-process memo would hide what a restart reads)."""
    from kvpool import connector

    for fn in vars(connector).values():
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    return checkpoint_namespace(path)


@pytest.mark.parametrize("keep_mtime", [True, False], ids=["mtime-restored", "mtime-new"])
def test_a_tensor_rewritten_in_place_changes_the_namespace(ckpt, keep_mtime):
    before = restart_namespace(ckpt)
    assert restart_namespace(ckpt) == before  # cached now, and stable
    rw = rewrite_tensor(ckpt, SEED, keep_mtime=keep_mtime)
    assert rw["size_kept"] and rw["header_kept"] and rw["mtime_kept"] == keep_mtime, rw
    after = restart_namespace(ckpt)
    assert after.model_revision != before.model_revision
    assert before.differing_fields(after) == ("model_revision",)


def test_two_checkpoints_differing_in_one_tensor_at_two_paths(ckpt, tmp_path):
    other = tmp_path / "finetune"
    shutil.copytree(ckpt, other)
    rewrite_tensor(other, SEED, keep_mtime=False)
    assert restart_namespace(other).model_revision != restart_namespace(ckpt).model_revision
    shutil.rmtree(other)


def test_an_unchanged_checkpoint_reads_no_weight_byte_at_its_next_start(ckpt, cache):
    size = (ckpt / WEIGHTS).stat().st_size
    r0 = rchar()
    first = restart_namespace(ckpt)
    r1 = rchar()
    second = restart_namespace(ckpt)
    r2 = rchar()
    assert r1 - r0 >= size  # the first start read every weight byte (the measure sees reads)
    assert r2 - r1 < 64 * 1024, f"the second start read {r2 - r1} bytes"
    assert second == first
    assert any(cache.iterdir())
    assert os.stat(cache).st_mode & 0o777 == 0o700


def test_the_cache_is_private_to_its_user(ckpt, cache):
    from kvpool.connector.identity import checkpoint_manifest

    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)  # anyone could plant digests: not used (refused), every start hashes again
    first = checkpoint_manifest(str(ckpt))
    second = checkpoint_manifest(str(ckpt))
    assert first["bytes_read"] >= 64 * 2**20 and second["bytes_read"] == first["bytes_read"]
    assert first["files"] == second["files"]


def test_the_hub_commit_is_part_of_the_identity(tmp_path, cache):
    from kvpool.connector.identity import model_identity

    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny"
    ids = {}
    for sha in ("a" * 40, "b" * 40):
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")  # the same files at two commits
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(sha)
        ids[sha] = (model_identity(str(snap)), model_identity("org/tiny", None, hub_cache=str(hub)))
    assert ids["a" * 40][0] != ids["b" * 40][0]  # a snapshot directory: its commit
    assert ids["a" * 40][1] != ids["b" * 40][1]  # a repo id: the commit refs/main names


@pytest.fixture
def pool():
    d = thread_pool(page_size=128 * 1024, num_pages=64)
    yield d
    d.stop_thread()


@pytest.mark.parametrize("control", [None, "header_only_fingerprint"])
def test_hostile_checkpoint_attempt_and_its_control(pool, tmp_path, control):
    """The gate's hostile-checkpoint-in-place, against a real pool: blocks published under
    the first weights are a miss (incompatible) under the rewritten ones; the control
    (the header-only fingerprint) keeps the namespace and hits, caught by the same checks
    for the reason the scenario file names."""
    out = attempt(lambda: PoolClient(f"unix:{pool.unix_path}", "default", "tok"), SEED, tmp_path / "w",
                  control=control)
    v = judge(out)
    if control is None:
        assert v.valid is True, v.evidence["checks_failed"]
        assert out["second_miss"] == {"cause": "incompatible", "fields": ["model_revision"]}
    else:
        assert v.valid is False and out["second_hits"] == 4
        assert any("not visible under the rewritten weights" in f for f in v.evidence["checks_failed"])
