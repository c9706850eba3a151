"""Which checkpoint a replica serves: the model identity in its namespace
(Namespace.model_revision), so that KV computed by other weights is never served.

  model_identity(model, revision=None, *, cache_dir=None) -> str
      `model` a local checkpoint directory (or one weight file, e.g. a .gguf): a digest of
      a manifest of every file that decides the weights and their meaning (config.json
      and every other *.json at its top, the index files among them, and every weight
      file: .safetensors .bin .pt .pth .ckpt .gguf), each by name, size and a digest of
      its whole content; the Hugging Face commit where the directory is a hub cache
      snapshot (.../snapshots/<40 hex>/); and `revision`, where vLLM was given one. Any
      change to any byte of any of those files changes it, whatever the file's size.
      `model` a hub repo id (not a local path): the commit the local hub cache resolves
      `revision` to (huggingface_hub.try_to_load_from_cache, no network), which names
      its content (the hub's files are content-addressed); its files are not read, since
      a worker's connector can start before vLLM has downloaded the weights. Neither
      (not a path, not in the cache): the model name and revision, with a warning that
      the namespace then names no weights (set `model_revision`).
  checkpoint_manifest(model, revision=None, *, cache_dir=None) -> dict
      what the identity is a digest of, and `bytes_read`: the weight bytes this call read
      (0 on a restart with unchanged files).
  file_digest(path, *, cache, progress=None) -> (digest, bytes_read)
      one file's content digest, from the cache (a directory, or None: no cache) when it
      holds an entry of this version of the file.

Content digests are XXH3-128 (xxhash, the library kvpool's page digests already use),
streamed in 1 MiB reads (with POSIX_FADV_SEQUENTIAL): ~20 GB/s of CPU here, so a first start is bound by the disk,
where BLAKE2b would be bound by one core at ~0.6 GB/s. The namespace separates the
checkpoints of honest operators; it is not an authentication boundary (a tenant may
publish any bytes under any namespace it names), so a 128-bit non-cryptographic digest is
enough: what must not happen is that two different checkpoints agree by accident.

The cache makes a restart with unchanged files read no weight byte: one entry per file
version, in a per-user directory ($KVPOOL_IDENTITY_CACHE, else $XDG_CACHE_HOME/kvpool/identity,
else ~/.cache/kvpool/identity; made and checked by kvpool.pool.private_dir: mode 0700, the user's,
every directory above trusted), keyed by (realpath, st_dev, st_ino, st_size, st_mtime_ns,
st_ctime_ns). A rewrite in place changes st_ctime, which no user can set (a weight file
whose mtime is put back with `touch -r` still gets a new ctime), so it misses the cache. An
entry is written only for a file whose ctime and mtime lie RACY_NS before the hash began,
and whose fstat is the same after the hash as before (a write within the same tick of the
file system's clock as the hash could otherwise leave ctime as it was); each entry is
read and written under an flock of its own, so the scheduler and the workers of one
engine starting together hash each file once. A cache that cannot be made safely is not
used (a warning; every start then hashes everything). Files hashed without the cache
are reported on stderr (what, how much, the rate) when they come to HASH_REPORT_BYTES or more.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
import sys
import time
from pathlib import Path

import xxhash

from kvpool.pool.private_dir import InsecureDirectory, ensure_private_dir

log = logging.getLogger("kvpool.connector.identity")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
CHUNK = 2**20  # read into a buffer that stays in the CPU's cache for the hash: ~2x the rate of 16 MiB here
RACY_NS = 1_000_000_000  # a file changed less than this before its hash began is hashed again next time
HASH_REPORT_BYTES = 1 << 30  # uncached bytes from which a start reports its progress
REPORT_EVERY_S = 5.0
MANIFEST_VERSION = 1
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(?:/|$)")


def default_cache_dir() -> Path:
    if os.environ.get("KVPOOL_IDENTITY_CACHE"):
        return Path(os.environ["KVPOOL_IDENTITY_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpool" / "identity"


def _checkpoint_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(f for f in root.iterdir()
                  if f.is_file() and (f.suffix == ".json" or f.suffix in WEIGHT_SUFFIXES))


def _stat_key(real: str, st: os.stat_result) -> dict:
    return {"path": real, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _same_version(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == \
        (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns)


class _Progress:
    """What a start hashes without the cache, on stderr when it may be a lot: a line when
    the first uncached file begins, one every REPORT_EVERY_S, one at the end (the rate)."""

    def __init__(self, total: int, files: int, where: str):
        self.total, self.files, self.where = total, files, where
        self.done, self.t0, self.last = 0, 0.0, 0.0
        self.loud = total >= HASH_REPORT_BYTES

    @staticmethod
    def _say(text: str) -> None:
        print(f"kvpool identity: {text}", file=sys.stderr, flush=True)

    def add(self, n: int) -> None:
        now = time.monotonic()
        if not self.done:
            self.t0 = self.last = now
            if self.loud:
                self._say(f"hashing the weights of {self.where} not seen before ({self.files} file(s), up to "
                          f"{self.total / 1e9:.1f} GB; once per version of each file)")
        self.done += n
        if self.loud and now - self.last >= REPORT_EVERY_S:
            self.last = now
            self._say(f"{self.done / 1e9:.1f} GB hashed, {self.rate():.2f} GB/s")

    def rate(self) -> float:
        return self.done / 1e9 / max(time.monotonic() - self.t0, 1e-9)

    def finish(self) -> None:
        if self.loud and self.done:
            self._say(f"hashed {self.done / 1e9:.1f} GB of {self.where} in {time.monotonic() - self.t0:.1f} s "
                      f"({self.rate():.2f} GB/s)")


def _hash_fd(fd: int, progress: _Progress | None) -> tuple[str, int]:
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    with open(fd, "rb", buffering=0, closefd=False) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            total += n
            if progress is not None:
                progress.add(n)
    return h.hexdigest(), total


def _cache(cache_dir: Path | None) -> Path | None:
    """The cache directory, made safely; None (a warning) where it cannot be."""
    try:
        return ensure_private_dir(cache_dir or default_cache_dir())
    except (InsecureDirectory, OSError) as exc:
        log.warning("kvpool identity: no cache of weight digests (%s): every start hashes every weight file", exc)
        return None


def file_digest(path: Path, *, cache: Path | None, progress: _Progress | None = None) -> tuple[str, int]:
    """(XXH3-128 of the file's content, bytes read to take it: 0 from the cache)."""
    real = os.path.realpath(path)
    fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
    try:
        before = os.fstat(fd)
        key = _stat_key(real, before)
        if cache is None or max(before.st_ctime_ns, before.st_mtime_ns) > time.time_ns() - RACY_NS:
            return _hash_fd(fd, progress)  # no cache, or a file changed just now: no entry (see RACY_NS)
        name = xxhash.xxh3_128_hexdigest(json.dumps(key, sort_keys=True).encode())
        entry = os.open(cache / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            est = os.fstat(entry)
            if est.st_uid != os.geteuid() or not stat.S_ISREG(est.st_mode) or est.st_mode & 0o077:
                raise InsecureDirectory(cache / name, "a cache entry that is not this user's private file")
            fcntl.flock(entry, fcntl.LOCK_EX)  # one process hashes a file version; the others wait for its entry
            with open(entry, "rb", closefd=False) as f:
                text = f.read(4096)
            try:
                found = json.loads(text) if text else None
            except ValueError:
                found = None  # torn by a crash mid-write: hashed again
            if isinstance(found, dict) and found.get("key") == key and isinstance(found.get("digest"), str):
                return found["digest"], 0
            started = time.time_ns()
            digest, n = _hash_fd(fd, progress)
            after = os.fstat(fd)
            racy = max(before.st_ctime_ns, before.st_mtime_ns) > started - RACY_NS
            if _same_version(before, after) and not racy:
                os.ftruncate(entry, 0)
                os.pwrite(entry, json.dumps({"v": MANIFEST_VERSION, "key": key, "digest": digest,
                                             "algorithm": "xxh3-128"}).encode(), 0)
            return digest, n
        finally:
            os.close(entry)
    finally:
        os.close(fd)


def hf_commit(path: str) -> str | None:
    """The commit of a hub cache snapshot directory (.../snapshots/<sha>/...), if it is one."""
    found = _SNAPSHOT.search(os.path.abspath(path))
    return found.group(1) if found else None


def _resolve_repo(model: str, revision: str | None, hub_cache: str | None) -> str | None:
    """The local snapshot directory of a hub repo id at `revision`, from the cache alone."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", cache_dir=hub_cache, revision=revision)
    except ValueError:  # not a repo id
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def checkpoint_manifest(model: str, revision: str | None = None, *, cache_dir: Path | None = None,
                        hub_cache: str | None = None) -> dict:
    """What the identity is a digest of (also the evidence of what was read)."""
    manifest: dict = {"v": MANIFEST_VERSION, "revision": revision or "", "files": [], "hf_commit": None}
    root = Path(model)
    if not root.exists():
        snapshot = _resolve_repo(model, revision, hub_cache)
        manifest["hf_commit"] = hf_commit(snapshot) if snapshot else None
        if manifest["hf_commit"] is None:
            manifest["unresolved"] = model
            log.warning("kvpool identity: %r is neither a local checkpoint nor in the local hub cache: its "
                        "namespace names no weights; set the connector's model_revision", model)
        return manifest
    manifest["hf_commit"] = hf_commit(str(root))
    files = _checkpoint_files(root)
    cache = _cache(cache_dir)
    stats = [f.stat() for f in files]
    progress = _Progress(sum(s.st_size for s in stats), len(files), str(root))
    read = 0
    for f, st in zip(files, stats):
        digest, n = file_digest(f, cache=cache, progress=progress)
        read += n
        manifest["files"].append({"name": f.name, "size": st.st_size, "xxh3_128": digest})
    progress.finish()
    manifest["bytes_read"] = read
    return manifest


def model_identity(model: str, revision: str | None = None, *, cache_dir: Path | None = None,
                   hub_cache: str | None = None) -> str:
    manifest = checkpoint_manifest(model, revision, cache_dir=cache_dir, hub_cache=hub_cache)
    manifest.pop("bytes_read", None)
    return xxhash.xxh3_128_hexdigest(json.dumps(manifest, sort_keys=True).encode())
