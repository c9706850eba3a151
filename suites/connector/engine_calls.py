"""The connector's hooks called the way vLLM's engine calls them, for tests that drive the
connector without an engine: a lookup answered None is asked again at the next step, and
get_finished is called at every step until it reports the request."""

from __future__ import annotations

import time

STEP_S = 0.01  # between two of these "steps"
PATIENCE_S = 30.0


def ask_matched(scheduler, request, num_computed_tokens: int):  # noqa: ANN001, ANN201
    """get_num_new_matched_tokens until it is not None (vLLM defers the request meanwhile)."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        answer = scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer
        time.sleep(STEP_S)


def finished(worker, req_ids: set[str], expect: set[str] | None = None) -> set[str]:  # noqa: ANN001
    """Call get_finished (a connector) or finished_sending (a KVPoolWorker) with `req_ids`,
    then with nothing at each later step, until `expect` (default: req_ids) are reported."""
    expect = set(req_ids) if expect is None else expect

    def call(ids: set[str]) -> set[str]:
        if hasattr(worker, "get_finished"):
            return set(worker.get_finished(ids)[0] or ())
        return set(worker.finished_sending(ids))

    done, deadline = call(set(req_ids)), time.monotonic() + PATIENCE_S
    while not expect <= done and time.monotonic() < deadline:
        time.sleep(STEP_S)
        done |= call(set())
    return done
