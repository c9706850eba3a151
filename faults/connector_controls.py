"""The negative controls of the fault-injecting connector (kvgate.faults.connector), by name,
and what each one leaves in a replica once it is disarmed.

A control acts through the connector API while its fault file names it; the file is re-read
on the connector's next call, so the call after a disarm decides as an unarmed connector
would. What the control did while armed can outlive it in two places only:

- the engine: KV computed over blocks that were never loaded (a claim past the load, a
  hidden failure), held in the engine's local prefix cache. A reset of the prefix cache
  drops it, and vLLM refuses that reset while any block is still held by a request, so
  an accepted reset also says the engine is idle;
- the fault connector itself: state kept across calls.

HEALED_BY_DISARM lists the controls that keep no state of their own across calls past
the requests they acted on, with why: after a disarm and an accepted prefix-cache reset
the replica is what a restarted one would be, less cumulative counters (which every
oracle reads as a difference over its own run). A runner may go on with such a replica
without restarting it. A control not listed (late_store: its held saves replay at the
next step and the ids of the requests it freed early are kept) must be restarted.
"""

from __future__ import annotations

CONTROLS = ("hide_failures", "claim_past_loaded", "claim_one_more", "double_count_stats", "late_store",
            "deaf_tier_rule", "deaf_reset", "load_despite_skip", "adapter_by_name", "stale_completion")

HEALED_BY_DISARM: dict[str, str] = {
    "hide_failures": "it drops one step's failure report; the KV computed over the failed blocks is in the "
                     "engine's prefix cache only",
    "claim_past_loaded": "its claim count per request is taken back at the request's allocation; the KV of the "
                         "tokens never loaded is in the engine's prefix cache only",
    "claim_one_more": "as claim_past_loaded, for one token at a block boundary",
    "double_count_stats": "it doubles the stats object of one call; counters are read as differences",
    "deaf_tier_rule": "it drops one call's stats and lifts the tier rule's hold per request; the rule holds a tier "
                      "off again at its next failure",
    "deaf_reset": "it answers one reset call; the next reset, disarmed, reaches the inner connector",
    "load_despite_skip": "it clears a flag on the request it is asked about, nothing of its own",
    "adapter_by_name": "it shows the inner connector one request's adapter by a path derived from the name; "
                       "nothing is kept (the scenario unloads its adapters)",
    "stale_completion": "it reports, in the call that tells it of their finish, the requests that finished while it "
                        "was armed; nothing is kept (the engine it acts on dies of it)",
}

assert set(HEALED_BY_DISARM) <= set(CONTROLS)


def restart_after(control: str | None) -> bool:
    """True when a replica the control was armed on must be restarted before it serves
    another run (an unknown control, or None for a fault of unknown kind, too)."""
    return control not in HEALED_BY_DISARM
