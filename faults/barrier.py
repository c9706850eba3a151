"""Turns: a race between processes, taken out of the scheduler's hands.

A turn list orders named points of several parties ("A:reserve", "B:witness", ...). A
party that reaches one of its points waits until every turn before it in the list is done
(and, at its first point, until every party has arrived at one of its points, so all of
them are in flight at once), runs the step, and marks its turn done. The order comes from
the run's seed (kvgate.faults.schedule draws it), so a replay gives the same interleaving.
State is files in one directory (every replica process sees it; a write is an atomic
create), so the parties need no channel of their own.

  Turns(directory, order, parties, timeout_s)
  turns.arrive(me)               mark this party in flight
  turns.wait(me, point) -> s     block until the turn (me:point) may run; seconds waited
  turns.done(me, point, **info)  mark it done (info: what the step saw, kept in the file)
  turns.skip(me, points, why)    mark turns this party will not take (a publish with
                                 nothing reserved commits nothing), so nobody waits on them
  turns.record(me, point)        the info written at done/skip, or None

Errors: TurnTimeout when a turn could not run within timeout_s (a party never arrived, or
a turn before it was never taken): the holder records it and goes on unheld, so a stuck
schedule never stops an engine; the scenario judges the record.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class TurnTimeout(TimeoutError):
    """A turn could not run within the schedule's time limit."""


def _name(turn: str) -> str:
    return turn.replace(":", ".")


class Turns:
    POLL_S = 0.01

    def __init__(self, directory: str | Path, order: list[str], parties: list[str], timeout_s: float = 60.0):
        self.dir = Path(directory)
        self.order = list(order)
        self.parties = list(parties)
        self.timeout_s = float(timeout_s)
        for turn in self.order:
            party, _, point = turn.partition(":")
            if party not in self.parties or not point:
                raise ValueError(f"turn {turn!r} is not 'party:point' of the parties {self.parties}")

    def _put(self, name: str, info: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.dir / name)

    def arrive(self, me: str) -> None:
        if not (self.dir / f"arrived.{me}").exists():
            self._put(f"arrived.{me}", {"t": time.time(), "pid": os.getpid()})

    def _ready(self, before: list[str]) -> bool:
        return all((self.dir / f"arrived.{p}").exists() for p in self.parties) and all(
            (self.dir / f"done.{_name(t)}").exists() for t in before)

    def wait(self, me: str, point: str) -> float:
        turn = f"{me}:{point}"
        if turn not in self.order:
            return 0.0
        self.arrive(me)
        before = self.order[: self.order.index(turn)]
        t0 = time.monotonic()
        while not self._ready(before):
            if time.monotonic() - t0 > self.timeout_s:
                missing = [p for p in self.parties if not (self.dir / f"arrived.{p}").exists()]
                undone = [t for t in before if not (self.dir / f"done.{_name(t)}").exists()]
                raise TurnTimeout(f"turn {turn} waited {self.timeout_s} s: parties not arrived {missing}, "
                                  f"turns not done {undone}")
            time.sleep(self.POLL_S)
        return time.monotonic() - t0

    def done(self, me: str, point: str, **info: Any) -> None:
        turn = f"{me}:{point}"
        if turn in self.order:
            self._put(f"done.{_name(turn)}", {"t": time.time(), **info})

    def skip(self, me: str, points: list[str], why: str) -> None:
        for point in points:
            self.done(me, point, skipped=why)

    def record(self, me: str, point: str) -> dict[str, Any] | None:
        path = self.dir / f"done.{_name(f'{me}:{point}')}"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None


def publish_race_order(rng_seed: int, parties: tuple[str, str]) -> tuple[list[str], dict[str, Any]]:
    """The seeded interleaving of two publishes of one prefix: who reserves first, and
    whether the second reserves while the first's pages are reserved and not yet written
    ("reserved") or written and not yet committed ("written"). The second looks the prefix
    up just before its reserve (its `witness`: what a reader sees mid-publish)."""
    import random

    rng = random.Random(f"{rng_seed}:publish_race")
    first, second = parties if rng.random() < 0.5 else parties[::-1]
    window = rng.choice(("reserved", "written"))
    f, s = first, second
    if window == "reserved":
        order = [f"{f}:reserve", f"{s}:witness", f"{s}:reserve", f"{f}:write", f"{f}:commit",
                 f"{s}:write", f"{s}:commit"]
    else:
        order = [f"{f}:reserve", f"{f}:write", f"{s}:witness", f"{s}:reserve", f"{f}:commit",
                 f"{s}:write", f"{s}:commit"]
    return order, {"first": first, "second": second, "window": window}
