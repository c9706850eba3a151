"""The run's history as JSON lines: every lookup, load, publish and audit record that
the connector sees, one object per line, appended by each process to its own file
(`<dir>/<replica>.<role>.<pid>.jsonl`), so no two writers share a file.

  HistoryWriter(dir, replica, role)   .write(event, **fields): appends and flushes.
  read_history(dir, pattern="*.jsonl")   every record of those files, ordered by time; a
        file's last line without its newline is a record still being written (a writer's line
        may reach the file in more than one write) and is not read.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class HistoryWriter:
    def __init__(self, directory: str | Path | None, replica: str, role: str):
        self.replica = replica
        self.role = role
        self._lock = threading.Lock()
        self._file = None
        if directory:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            self._file = open(path / f"{replica}.{role}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, event: str, **fields: object) -> None:
        if self._file is None:
            return
        record = {"ev": event, "t": time.time(), "replica": self.replica, "role": self.role, **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_history(directory: str | Path, pattern: str = "*.jsonl") -> list[dict]:
    records: list[dict] = []
    for path in sorted(Path(directory).glob(pattern)):
        with open(path) as f:
            for line in f:
                if line.endswith("\n") and line.strip():  # only the last line can lack its newline
                    records.append(json.loads(line))
    records.sort(key=lambda r: r["t"])
    return records
