"""Hostile scenario: rundir (see harness.scenarios.hostile)."""

from __future__ import annotations

from collections.abc import Callable

from harness.checkers.verdict import Verdict

RUNNERS: dict[str, Callable[..., Verdict]] = {}
