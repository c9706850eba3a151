"""The one fault-control file reader: every injector (the pool-client wrapper, the copier
wrapper, the fault-injecting connector, the GPU controls, the transport proxy) is armed and
healed at run time through a JSON file it re-reads when it changes, so a test switches
faults in a live replica without restarting it.

  ControlFile(path).read() -> (document, generation)
        the file's JSON object ({} when the file is missing or empty) and a generation
        number that changes whenever the file is written (an injector resets its firing
        counts then: every write arms anew, even of the same faults). A file written in the last 100 ms is read again on every
        call: two writes within one timestamp tick look alike by their metadata alone.
  ControlFile(path).section(name) -> (dict | None, generation)
        one section of the document (None if absent).
  write_control(path, document)
        replace the file atomically (a reader never sees half a write).
Errors: ControlFileError (a ValueError) when the content is not a JSON object or a section
is not an object, raised on every read until the file changes; `.generation` says which
content it is about.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class ControlFileError(ValueError):
    """The control file is not a JSON object, or a section names an unknown fault."""

    def __init__(self, message: str, generation: int = 0):
        super().__init__(message)
        self.generation = generation


class ControlFile:
    RECENT_S = 0.1

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._key: tuple[int, int, int] | None = None
        self._text: str | None = None
        self._doc: dict[str, Any] = {}
        self._error: str | None = None
        self._generation = 0
        self._lock = threading.Lock()

    def _current(self) -> tuple[tuple[int, int, int] | None, str]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None, ""
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._key and self._text is not None and time.time() - st.st_mtime > self.RECENT_S:
            return key, self._text
        try:
            return key, self.path.read_text()
        except FileNotFoundError:
            return None, ""

    def read(self) -> tuple[dict[str, Any], int]:
        with self._lock:
            key, text = self._current()
            if key != self._key or text != self._text:  # every write is a new arming, even of the same faults
                self._key, self._text = key, text
                self._generation += 1
                self._error = None
                try:
                    doc = json.loads(text) if text.strip() else {}
                except json.JSONDecodeError as exc:
                    self._error, doc = f"{self.path}: not JSON: {exc}", {}
                if not isinstance(doc, dict):
                    self._error, doc = f"{self.path}: a fault-control file holds a JSON object, got {doc!r}"[:300], {}
                self._doc = doc
            if self._error is not None:
                raise ControlFileError(self._error, self._generation)
            return self._doc, self._generation

    def section(self, name: str) -> tuple[dict[str, Any] | None, int]:
        doc, generation = self.read()
        value = doc.get(name)
        if value is not None and not isinstance(value, dict):
            raise ControlFileError(f"{self.path}: section {name!r} must be an object, got {value!r}", generation)
        return value, generation


def write_control(path: str | Path, document: dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(document, sort_keys=True))
    os.replace(tmp, path)
