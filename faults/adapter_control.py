"""The adapter_by_name control's adapter (kvgate.faults.connector): a LoRA adapter as a
connector that keys adapters by their name alone sees it.

  by_name(lora, root) -> (seen before, LoRARequest)
      a LoRARequest of the same name, its id derived from the name, its path a directory
      under `root` derived from the name that holds one adapter_config.json naming it. Every
      replica given the same root (the fault-control file's folder) gets the same adapter
      for one name, whichever weights are loaded under it: an inner connector that keys by
      name, id, path or by the content at the path keys two adapters of one name alike.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_SEEN: set[str] = set()


def by_name(lora, root: Path):  # noqa: ANN001, ANN201
    from vllm.lora.request import LoRARequest

    name = str(lora.lora_name)
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    folder = Path(root) / "adapter-by-name" / digest
    config = folder / "adapter_config.json"
    if not config.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".adapter_config.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"kvgate_control": "adapter_by_name", "lora_name": name}, sort_keys=True))
        os.replace(tmp, config)  # the same bytes from every replica: whichever lands last
    seen = name in _SEEN
    _SEEN.add(name)
    return seen, LoRARequest(lora_name=name, lora_int_id=1 + int(digest[:6], 16), lora_path=str(folder))
