"""Routing a session's turns to replicas.

  Router(kind, replicas, seed)  sticky / alternating / random (seeded) choice of replica
                                per (session, turn).
"""

from __future__ import annotations

import random


class Router:
    KINDS = ("sticky", "alternating", "random")

    def __init__(self, kind: str, replicas: list[str], seed: int):
        if kind not in self.KINDS:
            raise ValueError(f"router kind {kind!r} not in {self.KINDS}")
        self.kind = kind
        self.replicas = list(replicas)
        self._rng = random.Random(f"router:{seed}")
        self._sticky: dict[str, str] = {}

    def pick(self, session: str, turn: int) -> str:
        if self.kind == "sticky":
            if session not in self._sticky:
                self._sticky[session] = self.replicas[len(self._sticky) % len(self.replicas)]
            return self._sticky[session]
        if self.kind == "alternating":
            start = self._sticky.setdefault(session, self.replicas[len(self._sticky) % len(self.replicas)])
            return self.replicas[(self.replicas.index(start) + turn) % len(self.replicas)]
        return self._rng.choice(self.replicas)
