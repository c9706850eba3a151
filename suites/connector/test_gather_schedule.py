"""kvgate.faults.connector's schedule section `gather`: the requests of a tag prefix wait (the
connector answers None, "ask again", without asking the inner connector) until `count` of
them have arrived, then are admitted in arrival order, one per scheduler step; an admitted
request (a preempted one, resumed) is never held again, and requests of other tags pass."""

from __future__ import annotations

import json
from types import SimpleNamespace

from suites.connector.test_late_store import _connector




def _request(rid: str, tag: str):  # noqa: ANN202
    return SimpleNamespace(request_id=rid, prompt_token_ids=[1] * 10,
                           kv_transfer_params={"kvpool": {"tag": tag}})


def _schedule(c, waiting) -> list[str]:  # noqa: ANN001
    """One scheduler step over the waiting queue: the ids that were not held."""
    passed = [r.request_id for r in waiting if c.get_num_new_matched_tokens(r, 0)[0] is not None]
    c.build_connector_meta(SimpleNamespace())
    return passed


def test_gathered_requests_wait_for_each_other_then_are_admitted_one_per_step(tmp_path):
    (tmp_path / "faults.json").write_text(json.dumps({"schedule": {"gather": "burst-", "count": 3}}))
    c, _ = _connector(tmp_path, "scheduler")
    a, b, d = (_request(f"r{i}", f"burst-{i}") for i in range(3))
    other = _request("o", "other")
    assert _schedule(c, [a, other]) == ["o"]  # only a of the burst has arrived
    assert _schedule(c, [a, b]) == []
    assert _schedule(c, [a, b, d]) == []  # all three arrived this step; none admitted ahead of a
    assert _schedule(c, [a, b, d]) == ["r0"]
    assert _schedule(c, [b, d]) == ["r1"]
    assert _schedule(c, [d]) == ["r2"]
    assert _schedule(c, [a, b]) == ["r0", "r1"]  # resumed after a preemption: not held again


def test_without_the_section_nothing_waits(tmp_path):
    (tmp_path / "faults.json").write_text("{}")
    c, _ = _connector(tmp_path, "scheduler")
    assert _schedule(c, [_request("r0", "burst-0")]) == ["r0"]
