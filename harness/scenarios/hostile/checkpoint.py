"""Hostile scenario: checkpoint (see kvgate.harness.scenarios.hostile). A checkpoint is fine-tuned
in place at one path: one tensor of its weight file (over 64 MiB) rewritten with other
values of the same shape, so the file keeps its size and its safetensors header, and its
mtime is put back (`touch -r`). The connector's namespace for that path (kvpool.connector
.namespace_for, the identity of kvpool.connector.identity, its digest cache warm from the first
start) must change, so that blocks published under the first weights are not visible to
a replica of the rewritten ones: the cluster's real pool answers a lookup of those blocks
under the second namespace with a miss (incompatible: model_revision), never a hit.

  build_checkpoint(path, seed) -> Path
      a safetensors checkpoint over 64 MiB (config.json, model.safetensors of seeded
      float32 tensors), written at once (numpy, safetensors).
  rewrite_tensor(path, seed, keep_mtime=True) -> dict
      one seed-drawn tensor of model.safetensors rewritten in place with other values, the
      header and the size unchanged, the mtime put back where `keep_mtime`.
  checkpoint_namespace(path, identity=None) -> Namespace
      the connector's namespace for a replica of the checkpoint at `path`; `identity` a
      function of the path that replaces the connector's (a negative control's).
  checkpoint_in_place(cluster, corpus, seed, control=None) -> Verdict
      the scenario; control "header_only_fingerprint": the model fingerprint that hashed
      only the header and the size of a weight file over 64 MiB
      (kvgate.faults.identity_controls), with which the rewritten checkpoint keeps its namespace
      and the lookup hits (caught by the scenario's own checks: "not visible under the
      rewritten weights").

Disk: the checkpoint (72 MiB) lives in a temporary directory under the report folder for
the run only; its digest cache too (KVPOOL_IDENTITY_CACHE), so the host's is never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvgate.harness.checkers.verdict import Checks, Verdict
from kvgate.harness.workload.prompts import Corpus
from kvpool.client.transfer import publish
from kvpool.pool.keys import Namespace, block_hashes

# (name, shape) of the weight file's float32 tensors: 72 MiB in all, past the 64 MiB the
# old fingerprint read whole
TENSORS = (("embed.weight", (4096, 2048)), ("layers.0.mlp.weight", (4096, 2048)), ("layers.0.attn.weight", (2048, 1024)))
WEIGHTS = "model.safetensors"
BLOCK = 128
BLOCKS = 4
RACY_WAIT_S = 1.1  # past kvpool.connector.identity.RACY_NS, so that the first start's digests are cached


def build_checkpoint(path: Path, seed: int) -> Path:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in TENSORS}
    save_file(tensors, str(path / WEIGHTS))
    (path / "config.json").write_text(json.dumps({"architectures": ["HostileForCausalLM"], "hidden_size": 2048}))
    return path


def _header(f) -> tuple[int, dict]:  # noqa: ANN001
    (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n, json.loads(f.read(n))


def rewrite_tensor(path: Path, seed: int, *, keep_mtime: bool = True) -> dict:
    weights = path / WEIGHTS
    st = os.stat(weights)
    rng = random.Random(seed)
    name = rng.choice([n for n, _ in TENSORS])
    with open(weights, "r+b") as f:
        start, header = _header(f)
        f.seek(0)
        head_before = f.read(start)
        b, e = header[name]["data_offsets"]
        f.seek(start + b)
        old = np.frombuffer(f.read(e - b), dtype=np.float32)
        new = (old * np.float32(1.0 + 2.0**-7)).astype(np.float32)  # a fine-tune's step: every value moved a little
        f.seek(start + b)
        f.write(new.tobytes())
        f.flush()
        os.fsync(f.fileno())
        f.seek(0)
        head_after = f.read(start)
    if keep_mtime:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(weights)
    return {"tensor": name, "bytes": e - b, "size_kept": after.st_size == st.st_size,
            "header_kept": head_before == head_after, "mtime_kept": after.st_mtime_ns == st.st_mtime_ns,
            "ctime_moved": after.st_ctime_ns != st.st_ctime_ns}


def _vllm_config(path: Path) -> SimpleNamespace:
    """What namespace_for reads of a replica's vLLM config (the tiny model's geometry)."""
    mc = SimpleNamespace(model=str(path), revision=None, tokenizer=str(path), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 64)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           device_config=SimpleNamespace(device_type="cpu"))


def checkpoint_namespace(path: Path, identity: Callable[[str], str] | None = None) -> Namespace:
    # The connector's settings import vLLM: imported here, the catalog lists without it.
    from kvpool.connector.settings import ConnectorSettings, namespace_for

    settings = ConnectorSettings(pool="unix:/nonexistent", model_id="hostile-checkpoint")
    if identity is not None:
        settings = dataclasses.replace(settings, model_revision=identity(str(path)))
    return namespace_for(_vllm_config(path), settings)


@contextlib.contextmanager
def identity_cache(path: Path) -> Iterator[None]:
    old = os.environ.get("KVPOOL_IDENTITY_CACHE")
    os.environ["KVPOOL_IDENTITY_CACHE"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVPOOL_IDENTITY_CACHE", None)
        else:
            os.environ["KVPOOL_IDENTITY_CACHE"] = old


def attempt(pool_client: Callable[[], object], seed: int, work: Path, *, control: str | None = None) -> dict:
    """Build, name, publish under the first weights, rewrite in place, name again, look up.
    `pool_client()` opens a client of the pool to publish to and look up in."""
    identity = None
    if control == "header_only_fingerprint":
        from kvgate.faults.identity_controls import header_only_fingerprint as identity
    elif control is not None:
        raise ValueError(f"unknown control {control!r}")
    out: dict = {"control": control}
    work.mkdir(parents=True, exist_ok=True)
    ckpt = build_checkpoint(work / "ckpt", seed)
    with identity_cache(work / "cache"):
        time.sleep(RACY_WAIT_S)
        t0 = time.monotonic()
        ns1 = checkpoint_namespace(ckpt, identity)
        out["first_start_s"] = round(time.monotonic() - t0, 3)
        rng = random.Random(seed)
        tokens = [rng.randrange(1, 32000) for _ in range(BLOCKS * BLOCK)]
        hashes = block_hashes(tokens, BLOCK)
        pages = [np.frombuffer(rng.randbytes(4096), np.uint8) for _ in hashes]
        with pool_client() as pc:
            published = publish(pc, ns1, hashes, pages)
            out["rewrite"] = rewrite_tensor(ckpt, seed, keep_mtime=True)
            ns2 = checkpoint_namespace(ckpt, identity)
            first, second = pc.lookup(ns1, hashes), pc.lookup(ns2, hashes)
            pc.evict(ns1, hashes)
    out.update(published=published.committed, revisions=[ns1.model_revision, ns2.model_revision],
               first_hits=len(first.hits.pages), second_hits=len(second.hits.pages),
               second_miss=None if second.miss is None else {"cause": str(second.miss.cause),
                                                               "fields": list(second.miss.fields)})
    return out


def judge(out: dict) -> Verdict:
    c = Checks()
    rw = out["rewrite"]
    c.check("the tensor was rewritten in place: same size, same header, mtime put back",
            rw["size_kept"] and rw["header_kept"] and rw["mtime_kept"], rw)
    c.check("the blocks were published under the first weights and are visible there",
            out["published"] == BLOCKS and out["first_hits"] == BLOCKS, (out["published"], out["first_hits"]))
    c.check("the rewritten checkpoint has another namespace", out["revisions"][0] != out["revisions"][1],
            out["revisions"])
    miss = out["second_miss"] or {}
    c.check("the blocks of the first weights are not visible under the rewritten weights",
            out["second_hits"] == 0 and miss.get("cause") in ("incompatible", "never_published"),
            {"hits": out["second_hits"], "miss": miss})
    c.evidence.update(out)
    return c.verdict(f"a tensor of {rw['bytes'] >> 20} MiB rewritten in place (size, header and mtime kept): a new "
                     f"namespace, the first weights' {BLOCKS} blocks a {miss.get('cause')} miss under it")


def checkpoint_in_place(cluster, corpus: Corpus, seed: int, *, control: str | None = None) -> Verdict:  # noqa: ANN001
    cluster.nemesis("hostile_checkpoint", control=control)
    work = Path(tempfile.mkdtemp(prefix="hostile-checkpoint-", dir=cluster.report_dir))
    try:
        return judge(attempt(lambda: cluster.pool.client(name="hostile-checkpoint"), seed, work, control=control))
    finally:
        shutil.rmtree(work)


RUNNERS: dict[str, Callable[..., Verdict]] = {"checkpoint_in_place": checkpoint_in_place}
