"""What every connector-agnostic scenario body is given and shares (the scenarios in
kvgate.harness.conformance.scenarios and in modules of their own import it; it imports none
of them): the run's context (Ctx: the cluster, the seeded corpus, the connector's profile,
what it claimed, installed and produced, from the audit's records), the output oracle across
connectors (same_output), the byte check of one exchange (_exact), a scenario's request tags
arming a connector control on a replica, and every digest a replica's audit recorded
(all_digests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvgate.faults.connector_controls import restart_after
from kvgate.harness.checkers.history import audit_digests, records
from kvgate.harness.checkers.verdict import Checks
from kvgate.harness.client.http import Completion, RequestFailed, complete
from kvgate.harness.workload.prompts import Corpus

BLOCK = 128  # the tiny model's block size on the default system


class ScenarioDown(Exception):
    """The system went down under the scenario (a replica died)."""


@dataclasses.dataclass
class Ctx:
    cluster: Any  # kvgate.harness.system.cluster.Cluster
    corpus: Corpus
    profile: Any  # kvgate.harness.conformance.connectors.Profile
    seed: int
    t0: float = 0.0  # wall clock at the scenario's start
    timeout_s: float = 600.0  # one request's limit: a request that hangs fails its cell after it
    # replicas a negative control was armed on in this run (the runner disarms them), and those
    # of them the runner must restart before the next cell: a control that keeps state of its
    # own (held stores, ids of requests freed early; kvgate.faults.connector_controls), or a
    # replica a scenario could not bring back to its own state
    armed: set = dataclasses.field(default_factory=set)
    restart: set = dataclasses.field(default_factory=set)
    healed: dict = dataclasses.field(default_factory=dict)  # after the last run: restarted, only disarmed
    # weights a replica loaded in place during the run (replica -> [(wall clock, what)]): the
    # wrong-KV count (kvgate.harness.conformance.wrong_kv) compares a block only with blocks
    # computed with the same weights
    reloaded: dict = dataclasses.field(default_factory=dict)
    wrong_kv: dict | None = None  # the last run's wrong-KV count (the runner sets it)
    service: Any = None  # the connector's server (kvgate.harness.conformance.connectors.Service), where it has one

    @property
    def h(self):  # noqa: ANN201
        return self.cluster.history_dir

    def reidentify(self, replica: str, weights: str | None) -> None:
        """The replica serves other weights from now on (loaded in place); None: its own again."""
        import time

        self.reloaded.setdefault(replica, []).append((time.time(), weights))

    def identity(self, replica: str, t: float) -> str:
        """The weights the replica served at wall-clock time t: its model folder, or what it
        loaded in place since (reidentify)."""
        spec = self.cluster.replicas[replica].spec if replica in self.cluster.replicas else None
        own = str((spec.model_dir if spec is not None else None) or self.cluster.model_dir)
        now = own
        for when, weights in self.reloaded.get(replica, ()):
            if when <= t:
                now = own if weights is None else f"{own} with {weights} loaded in place"
        return now

    def url(self, replica: str) -> str:
        return self.cluster.replicas[replica].url

    def run(self, replica: str, prompt: str, tag: str, **kw: Any) -> Completion:
        """The request, then the connector's settle hook (where it stores outside the
        engine, asynchronously: the next request sees what this one stored)."""
        try:
            out = complete(self.url(replica), prompt, tag=tag, replica=replica, **{"timeout_s": self.timeout_s, **kw})
        except (RequestFailed, OSError) as exc:
            gone = self.cluster.crashed()
            if gone:
                raise ScenarioDown(f"{replica} request {tag} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                                   f"gone: {gone}") from exc
            raise
        if self.profile.settle is not None:
            self.profile.settle(self.cluster.report_dir, replica, tag)
        return out

    def match(self, replica: str, tag: str) -> dict | None:
        """The connector's first answer to get_num_new_matched_tokens for the request."""
        found = records(self.h, "audit_match", tag=tag, replica=replica)
        return found[0] if found else None

    def installed(self, replica: str, tag: str) -> dict[str, str]:
        return audit_digests(self.h, "installed", tag, replica)

    def produced(self, replica: str, tag: str) -> dict[str, str]:
        return audit_digests(self.h, "produced", tag, replica)

    def installed_from(self, replica: str, tag: str, produced: dict[str, str]) -> list[str]:
        """The blocks the replica installed for `tag` that are byte for byte a producer's."""
        return [k for k, d in self.installed(replica, tag).items() if produced.get(k) == d]

    def failed_reported(self, replica: str) -> list[int]:
        """Block ids the connector reported failed since the scenario started."""
        return sorted({b for r in records(self.h, "audit_load_errors", replica=replica) if r["t"] >= self.t0
                       for b in r["block_ids"]})


def same_output(c: Checks, ctx: Ctx, name: str, got: Completion, ref: Completion) -> None:
    """The output oracle across connectors (Checks.output with both runs' cached prompt
    tokens): a connector that loads at another granularity than the reference's prefix
    hit (LMCache's 256-token chunks against 128-token blocks) computes the rest in another
    partition, so there the tokens must be equal and the log-probabilities are reported.
    The cached tokens are the engine's own cache hit plus the blocks the connector
    installed, never its claim: a claim past what was loaded (the claim_past_loaded
    control) does not make another partition, and is judged in full."""
    def cached(run: Completion) -> int | None:
        m = ctx.match(run.replica, run.tag)
        if m is None:
            return None
        return m["local_tokens"] + min(m["external_tokens"], len(ctx.installed(run.replica, run.tag)) * BLOCK)

    c.output(name, got, ref, cached=(cached(got), cached(ref)))


def _tag(prefix: str, seed: int) -> str:
    return f"c{prefix}{seed % 10**8}"


def _exact(c: Checks, ctx: Ctx, consumer: tuple[str, str], producer: tuple[str, str], least: int) -> dict[str, str]:
    """Every block the consumer installed equals the producer's bytes; at least `least`."""
    installed = ctx.installed(*consumer)
    produced = ctx.produced(*producer)
    differ = [k for k, d in installed.items() if produced.get(k) != d]
    c.check(f"{consumer[0]} installed at least {least} blocks", len(installed) >= least, len(installed))
    c.check(f"every block {consumer[0]} installed equals {producer[0]}'s bytes", not differ,
            f"{len(differ)} of {len(installed)} differ")
    c.evidence.update(installed=len(installed), produced=len(produced), installed_differ=len(differ))
    return installed


def arm_control(ctx: Ctx, replica: str, control: str) -> None:
    """Add a connector control (kvgate.faults.connector) to what the replica's fault file arms."""
    import json

    from kvgate.faults.control import write_control

    path = ctx.cluster.faults[replica]
    doc = json.loads(path.read_text() or "{}")
    doc["connector"] = {"control": control}
    write_control(path, doc)  # whole, never half-written: a connector reads it in the middle of a step
    ctx.armed.add(replica)
    if restart_after(control):
        ctx.restart.add(replica)


def all_digests(ctx: Ctx, kind: str, replica: str, tag: str) -> dict[str, set[str]]:
    """Every digest the replica's audit recorded per block (a preempted request's blocks
    are computed again: each computation counts)."""
    out: dict[str, set[str]] = {}
    for r in records(ctx.h, "audit", kind=kind, tag=tag, replica=replica):
        for k, d in zip(r["hashes"], r["digests"]):
            out.setdefault(k, set()).add(d)
    return out
