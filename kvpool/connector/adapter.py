"""Which LoRA adapter a request's KV was computed with: a digest of the adapter's content,
never its name (vLLM keys an adapter by its name, vllm#30931, and keeps a name's id when it
is reloaded; one path may hold other weights after a training step).

  adapter_identity(lora_request) -> bytes
      16 bytes: a digest of the adapter folder's manifest (kvpool.connector.identity: every
      *.json at its top, adapter_config.json among them, and every weight file, each by
      name, size and a digest of its content; the hub commit of a hub snapshot). The same
      adapter gives the same identity on every replica, whatever name, id or path it is
      loaded under (so replicas share its KV), and other weights under the same name and
      path give another. Taken again whenever a file of the folder changes (its size,
      mtime, ctime or inode), which an in-place reload after a rewrite needs; the weight
      bytes are read once per version of a file (identity's cache). UnreadableAdapter where
      the content cannot be read (no such folder, not in the local hub cache, an adapter
      given as tensors): the request is then served without the pool.

Limit: the files are the truth. An adapter whose folder is rewritten while the engine keeps
serving the weights it loaded before (no reload) has its KV keyed by the new files.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

from kvpool.connector.identity import checkpoint_manifest

MEMO_ENTRIES = 256


class UnreadableAdapter(ValueError):
    """kvpool cannot read the adapter's content, so it cannot key its KV."""


_memo: OrderedDict[tuple, bytes] = OrderedDict()
_lock = threading.Lock()


def _version(folder: Path) -> tuple:
    """What changes when any file of the folder changes (names, sizes, times, inodes)."""
    if folder.is_file():
        st = folder.stat()
        return ((folder.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),)
    out = []
    with os.scandir(folder) as entries:
        for e in entries:
            if e.is_file():
                st = e.stat()
                out.append((e.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(sorted(out))


def adapter_identity(lora) -> bytes:  # noqa: ANN001 - a vllm.lora.request.LoRARequest
    path = str(getattr(lora, "lora_path", "") or "")
    if not path:
        raise UnreadableAdapter(f"LoRA adapter {getattr(lora, 'lora_name', '?')!r} has no path to read it from")
    folder = Path(path)
    try:
        key = (os.path.realpath(path), _version(folder)) if folder.exists() else (path, None)
    except OSError as exc:
        raise UnreadableAdapter(f"LoRA adapter at {path}: {exc}") from exc
    with _lock:
        found = _memo.get(key)
        if found is not None:
            _memo.move_to_end(key)
            return found
    manifest = checkpoint_manifest(path)
    manifest.pop("bytes_read", None)
    if manifest.get("unresolved") or not (manifest["files"] or manifest["hf_commit"]):
        raise UnreadableAdapter(f"LoRA adapter at {path}: neither a local folder with its files nor in the local "
                                "hub cache")
    ident = hashlib.blake2b(b"kvgate/lora-content/v1" + json.dumps(manifest, sort_keys=True).encode(),
                            digest_size=16).digest()
    with _lock:
        _memo[key] = ident
        while len(_memo) > MEMO_ENTRIES:
            _memo.popitem(last=False)
    return ident
