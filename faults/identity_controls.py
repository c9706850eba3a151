"""Negative controls of the pool's identities: which checkpoint a namespace names, and
whose run directory and socket a daemon and a client trust. Each is the behaviour before
that boundary was closed; the hostile scenarios (kvgate.harness.scenarios.hostile.checkpoint,
.rundir) and their suites run each and require that it is caught.

  header_only_fingerprint(path)
      the model fingerprint that hashed, of a weight file over 64 MiB, only its
      safetensors header and its size: a tensor rewritten in place (same shape) keeps it.
  LegacyRunDirDaemon
      a PoolDaemon that makes its run directory with mkdir(parents=True) and checks the
      last component only: a parent another user created (and can rename things in) is
      accepted.
  UncheckedPeerClient
      a PoolClient that sends its hello (and token) to whoever listens at the socket's
      path, without asking the kernel who that is.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

from kvpool.client.pool_client import PoolClient
from kvpool.pool.daemon import InsecureRunDir, PoolDaemon


def header_only_fingerprint(path: str) -> str:
    """kvpool.connector's model fingerprint as it was: whole files up to 64 MiB, the
    safetensors header and the size beyond."""
    root = Path(path)
    if not root.is_dir():
        return ""
    h = hashlib.sha256()
    for f in sorted(root.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin"):
            h.update(f.name.encode())
            size = f.stat().st_size
            h.update(size.to_bytes(8, "little"))
            with open(f, "rb") as fh:
                if size <= 64 * 2**20:
                    h.update(fh.read())
                else:
                    head = fh.read(8)
                    h.update(fh.read(min(int.from_bytes(head, "little"), 16 * 2**20)))
    return h.hexdigest()[:16]


class LegacyRunDirDaemon(PoolDaemon):
    def _make_run_dir(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = self.run_dir.stat()
        if st.st_uid != os.getuid():
            raise InsecureRunDir(self.run_dir, f"belongs to uid {st.st_uid}")
        if st.st_mode & 0o077:
            os.chmod(self.run_dir, 0o700)
        return self.run_dir


class UncheckedPeerClient(PoolClient):
    def _verify_peer(self, sock: socket.socket, what: str) -> None:
        return None
