"""A replica's fault-control file: JSON, re-read whenever it changes, so a test arms and
heals faults in a live replica without restarting it.

  ControlFile(path).section(name) -> (dict | None, generation)
        the named section of the file (None if absent) and a generation number that
        changes whenever the file does (a fault wrapper resets its firing count then).
Sections: "load" (faults.backend), "copier" (faults.copier).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


class ControlFileError(ValueError):
    """The control file is not a JSON object, or a section names an unknown fault."""


class ControlFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mtime: int | None = None
        self._doc: dict = {}
        self._generation = 0
        self._lock = threading.Lock()

    def section(self, name: str) -> tuple[dict | None, int]:
        with self._lock:
            try:
                mtime = os.stat(self.path).st_mtime_ns
            except FileNotFoundError:
                mtime = None
            if mtime != self._mtime:
                self._mtime = mtime
                doc = json.loads(self.path.read_text() or "{}") if mtime is not None else {}
                if not isinstance(doc, dict):
                    raise ControlFileError(f"{self.path}: a fault-control file holds a JSON object")
                self._doc = doc
                self._generation += 1
            value = self._doc.get(name)
            if value is not None and not isinstance(value, dict):
                raise ControlFileError(f"{self.path}: section {name!r} must be an object, got {value!r}")
            return value, self._generation
