"""Pool-level checks shared by the suites and the gate; each returns a Verdict.

  exchange_between_processes(pool, seed, out_dir)
      two separate processes publish seeded pages through one daemon, then each loads
      the other's; the parent compares every loaded byte with a fresh regeneration.
  miss_causes(seed)
      one injected condition per miss cause (never published, evicted, incompatible,
      throttled, corrupt, timeout, transport error) against a live daemon; each must come
      back as exactly its cause, at the right block.
  crash_and_restart(seed)
      SIGKILL the daemon with pages committed and a lease open; the next daemon must
      find the leftovers, say so, and start empty; a graceful stop must leave nothing.
  state_machine(seed, examples)
      kvgate.harness.scenarios.pool_machine.PoolMachine, seeded.
  catalog_controls(seed)
      each known-bad catalog (kvgate.faults.controls) through the state machine, caught only by
      the kind of finding it breaks, within CONTROL_BUDGET programs.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np

from kvgate.harness.checkers.verdict import Verdict
from kvgate.harness.system.pool import DEFAULT_TENANT, PoolProcess
from kvpool.pool.arena import processes_mapping, segment_label
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.errors import MissCause, PoolError
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("kvgate-check", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
EXCHANGE_BLOCKS = 24
EXCHANGE_PAGE = 16 * 1024
CONTROL_BUDGET = 400  # programs per known-bad catalog: over seeds 0-19 the most any needed was 150
# (`python -m kvgate.harness.scenarios.pool budget`: forgetful 60, leaseless 150, leaky 144, crossed 127)


def _tokens(who: int, seed: int) -> list[int]:
    base = random.Random(f"{seed}:{who}").randrange(1 << 20)
    return [base + who * 100_000 + i for i in range(EXCHANGE_BLOCKS * 16)]


def exchange_blocks(seed: int, who: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, who])
    return [rng.integers(0, 256, EXCHANGE_PAGE, dtype=np.uint8) for _ in range(EXCHANGE_BLOCKS)]


def _exchange_worker(who: int, seed: int, address: str, token: str, out_dir: str, barrier) -> None:  # noqa: ANN001
    client = PoolClient(address, "default", token, name=f"proc-{who}")
    res = publish(client, NS, block_hashes(_tokens(who, seed), 16), exchange_blocks(seed, who))
    if res.committed != EXCHANGE_BLOCKS:
        raise SystemExit(f"process {who}: published {res}")
    barrier.wait(60)
    out = np.zeros((EXCHANGE_BLOCKS, EXCHANGE_PAGE), np.uint8)
    got = load(client, NS, block_hashes(_tokens(1 - who, seed), 16), out.__getitem__)
    np.save(Path(out_dir) / f"loaded-by-{who}.npy", out[: got.loaded])
    client.close()


def exchange_between_processes(pool: PoolProcess, seed: int, out_dir: Path) -> Verdict:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_exchange_worker, args=(w, seed, pool.unix, pool.token, str(out_dir), barrier))
             for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        return Verdict(False, f"worker processes exited with {codes}", {"exit_codes": codes})
    differing = 0
    loaded = 0
    for who in (0, 1):
        got = np.load(out_dir / f"loaded-by-{who}.npy")
        expected = np.stack(exchange_blocks(seed, 1 - who))
        loaded += len(got)
        if got.shape != expected.shape:
            return Verdict(False, f"process {who} loaded {len(got)} of {EXCHANGE_BLOCKS} blocks", {"loaded": loaded})
        differing += int(np.count_nonzero((got != expected).any(axis=1)))
    evidence = {"blocks_loaded": loaded, "bytes_compared": loaded * EXCHANGE_PAGE, "blocks_differing": differing}
    if differing:
        return Verdict(False, f"{differing} loaded blocks differ from what was published", evidence)
    return Verdict(True, "every loaded byte equals the published byte", evidence,
                   not_checked="ordering under concurrent eviction (the state machine covers eviction)")


def miss_causes(seed: int) -> Verdict:
    """Each cause injected once, in a seeded order; each must be reported as itself."""
    rng = random.Random(seed)
    page = 4096
    # no scrub pass at rest: the corrupt probe's page is met by its loader, not dropped first
    pool = PoolProcess.start(page_size=page, num_pages=32,
                             extra_args=("--max-loads-per-client", "1", "--scrub-rest-pages", "0"))
    observed: dict[str, str] = {}
    try:
        c = pool.client(name="probe")
        holder = pool.client(name="holder")

        def fresh(n: int) -> list[bytes]:
            base = rng.randrange(1 << 24)
            return block_hashes(range(base, base + 16 * n), 16)

        def data(n: int) -> list[np.ndarray]:
            return [np.frombuffer(rng.randbytes(page), np.uint8) for _ in range(n)]

        def sink(n: int) -> list[np.ndarray]:
            return [np.zeros(page, np.uint8) for _ in range(n)]

        def probe_never_published() -> tuple[MissCause | None, int]:
            hs = fresh(3)
            publish(c, NS, hs[:1], data(1))
            r = load(c, NS, hs, sink(3).__getitem__)
            return (r.miss.cause if r.miss else None), (r.miss.index if r.miss else -1)

        def probe_evicted() -> tuple[MissCause | None, int]:
            hs = fresh(3)
            publish(c, NS, hs, data(3))
            c.evict(NS, hs[2:])
            r = load(c, NS, hs, sink(3).__getitem__)
            return (r.miss.cause if r.miss else None), (r.miss.index if r.miss else -1)

        def probe_incompatible() -> tuple[MissCause | None, int]:
            hs = fresh(2)
            publish(c, NS, hs, data(2))
            r = c.lookup(NS.replace(model_revision="r2"), hs)
            if r.miss is not None and r.miss.fields != ("model_revision",):
                return None, -1
            return (r.miss.cause if r.miss else None), (r.miss.index if r.miss else -1)

        def probe_throttled() -> tuple[MissCause | None, int]:
            hs = fresh(2)
            publish(c, NS, hs, data(2))
            held = holder.acquire(NS, hs)  # holder's one allowed lease
            r = holder.acquire(NS, hs)
            holder.release(held.lease_id)
            return (r.miss.cause if r.miss else None), (r.miss.index if r.miss else -1)

        def probe_corrupt() -> tuple[MissCause | None, int]:
            hs = fresh(3)
            publish(c, NS, hs, data(3))
            victim = c.lookup(NS, hs).hits[1].page
            c.arena.page(victim)[rng.randrange(page)] ^= 1 << rng.randrange(8)  # a stray bit flip
            r = load(c, NS, hs, sink(3).__getitem__)
            return (r.miss.cause if r.miss else None), (r.miss.index if r.miss else -1)

        def probe_timeout() -> tuple[MissCause | None, int]:
            hs = fresh(2)
            publish(c, NS, hs, data(2))
            r = load(c, NS, hs, sink(2).__getitem__, deadline_s=-1.0)
            return (r.miss.cause if r.miss else None), (r.miss.index if r.miss else -1)

        def probe_transport_error() -> tuple[MissCause | None, int]:
            from kvgate.faults.proxy import FaultProxy

            hs = fresh(2)
            publish(c, NS, hs, data(2))
            sockdir = Path(tempfile.mkdtemp(prefix="kvg-probe-"))
            # the connection is reset where the acquire's reply would be: the lease is granted, never seen
            with FaultProxy(pool.unix, f"unix:{sockdir}/p.sock", sockdir / "control.json", seed, remote=False) as proxy:
                proxy.configure({"reset": {"ops": ["acquire"], "direction": "reply", "times": 1}})
                with PoolClient(proxy.address, DEFAULT_TENANT, pool.token, name="doomed") as doomed:
                    r = load(doomed, NS, hs, sink(2).__getitem__)
            shutil.rmtree(sockdir, ignore_errors=True)
            return (r.miss.cause if r.miss else None), (r.miss.index if r.miss else -1)

        def probe_in_flight() -> tuple[MissCause | None, int]:
            hs = fresh(2)
            publish(c, NS, hs[:1], data(1))
            res = holder.reserve(NS, hs[1:], [page])  # a publish in flight: reserved, never committed
            r = c.lookup(NS, hs, wait_pending_s=0.05)
            holder.abort(res.reservation_id)
            return (r.miss.cause if r.miss else None), (r.miss.index if r.miss else -1)

        probes = {
            MissCause.NEVER_PUBLISHED: (probe_never_published, 1),
            MissCause.IN_FLIGHT: (probe_in_flight, 1),
            MissCause.EVICTED: (probe_evicted, 2),
            MissCause.INCOMPATIBLE: (probe_incompatible, 0),
            MissCause.THROTTLED: (probe_throttled, 0),
            MissCause.CORRUPT: (probe_corrupt, 1),
            MissCause.TIMEOUT: (probe_timeout, 0),
            MissCause.TRANSPORT_ERROR: (probe_transport_error, 0),
        }
        order = list(probes)
        rng.shuffle(order)
        wrong = []
        for cause in order:
            fn, index = probes[cause]
            got, at = fn()
            observed[cause.value] = f"{got.value if got else None}@{at}"
            if got != cause or at != index:
                wrong.append(f"{cause.value}: got {got} at block {at}, expected block {index}")
        c.close()
        holder.close()
    finally:
        pool.stop()
        pool.cleanup()
    evidence = {"order": [c.value for c in order], "observed": observed}
    if wrong:
        return Verdict(False, "; ".join(wrong), evidence)
    return Verdict(True, "each injected condition was reported as exactly its cause, at its block", evidence)


def crash_and_restart(seed: int) -> Verdict:
    run_dir = Path(tempfile.mkdtemp(prefix="kvgate-crash-"))
    pool = PoolProcess.start(page_size=4096, num_pages=16, run_dir=run_dir)
    try:
        hs = block_hashes(range(seed % 1000, seed % 1000 + 64), 16)
        label = segment_label(pool.name, "")
        with pool.client() as c:
            publish(c, NS, hs, [np.full(4096, i, np.uint8) for i in range(4)])
            c.acquire(NS, hs)
            mapped_before = sorted(processes_mapping(label))  # the daemon and this client
            pool.kill()
        left = sorted(processes_mapping(label))  # the client has unmapped it: nobody should map it now
        pool.restart()
        evidence = {"mapped_before_crash": len(mapped_before), "mapped_after_crash": left,
                    "recovery_note": pool.address.get("recovery_note")}
        with pool.client() as c:
            empty = c.lookup(NS, hs).miss.cause == MissCause.NEVER_PUBLISHED
            stats = c.stats()
            evidence["said_so"] = c.hello.restarted_after_crash
        clean_stop = (pool.stop() == 0 and not processes_mapping(label)
                      and not any((run_dir / f).exists() for f in ("pid", "pool.sock", "attach.sock")))
        evidence.update(started_empty=empty, free_pages=stats["free_pages"], clean_stop=clean_stop)
        ok = (len(mapped_before) == 2 and not left and evidence["said_so"] and empty and stats["free_pages"] == 16
              and clean_stop)
        return Verdict(bool(ok), "a SIGKILLed daemon leaves no segment mapped; the restart starts empty and says so; "
                       "graceful stop leaves nothing" if ok else "crash recovery incomplete", evidence)
    finally:
        pool.cleanup()


def state_machine(seed: int, examples: int = 25, steps: int = 30, catalog_factory: type | None = None,
                  shrink: bool = True, judged: frozenset[str] | None = None) -> Verdict:
    """`catalog_factory` plugs a negative control (kvgate.faults.controls) into the daemon;
    `judged` limits the kinds of finding that end a run (kvgate.harness.scenarios.pool_machine.FINDINGS), so a
    control is caught by the behaviour it breaks; `shrink=False` reports the first failing
    program as found (controls need no minimal example, only the fact that they fail).
    The evidence says how many programs ran (for a control: how many it took to catch)."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as hseed
    from hypothesis.stateful import run_state_machine_as_test

    from kvgate.harness.scenarios.pool_machine import PoolMachine

    attrs: dict = {"examples_run": 0}
    if catalog_factory is not None:
        attrs["catalog_factory"] = catalog_factory
    if judged is not None:
        attrs["judged"] = frozenset(judged)
    machine = hseed(seed)(type("SeededPoolMachine", (PoolMachine,), attrs))
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
            phases=tuple(Phase) if shrink else (Phase.explicit, Phase.generate),
            suppress_health_check=[HealthCheck.too_slow]))
    except (AssertionError, PoolError, BaseExceptionGroup) as exc:
        return Verdict(False, f"the daemon disagreed with the reference model: {type(exc).__name__}: {str(exc)[:400]}",
                       {"examples": examples, "steps": steps, "examples_run": machine.examples_run,
                        "finding": _finding(exc)})
    return Verdict(True, "the daemon agreed with the reference model at every step",
                   {"examples": examples, "steps": steps, "examples_run": machine.examples_run},
                   not_checked="thread interleavings inside the daemon (it is single-threaded by design)")


def _finding(exc: BaseException) -> str | None:
    """The kind of finding ("[kind] ..." from kvgate.harness.scenarios.pool_machine) that ended a run, if any."""
    import re

    m = re.match(r"\[(\w+)\]", str(exc))
    return m.group(1) if m else None


def catalog_controls(seed: int, examples: int = CONTROL_BUDGET, steps: int = 50) -> Verdict:
    """Every known-bad catalog of kvgate.faults.controls through the state machine, judged only by
    the kind of finding it exists to show (kvgate.faults.controls.CATALOG_BREAKS): caught when
    that finding ended the run; the evidence has the programs each one needed."""
    from kvgate.faults.controls import CATALOG_BREAKS, CATALOG_CONTROLS

    caught, needed, findings = {}, {}, {}
    for name, cls in CATALOG_CONTROLS.items():
        kind = CATALOG_BREAKS[name]
        v = state_machine(seed, examples=examples, steps=steps, catalog_factory=cls, shrink=False,
                          judged=frozenset({kind}))
        findings[name] = v.evidence.get("finding")
        caught[name] = v.valid is False and findings[name] == kind
        needed[name] = v.evidence.get("examples_run")
    missed = [n for n, ok in caught.items() if not ok]
    evidence = {"caught": caught, "programs_needed": needed, "finding": findings, "budget": examples}
    if missed:
        return Verdict(False, f"controls not caught by the behaviour they break: {missed} "
                              f"(findings {[findings[n] for n in missed]}, wanted {[CATALOG_BREAKS[n] for n in missed]})",
                       evidence)
    return Verdict(True, "every known-bad catalog was caught by the behaviour it breaks: "
                   + ", ".join(f"{n} by {CATALOG_BREAKS[n]} after {needed[n]} programs" for n in caught), evidence)

def programs_to_catch(seeds: range, examples: int = 2000, steps: int = 50) -> dict[str, list[int | None]]:
    """For each known-bad catalog, per seed: how many programs the state machine ran until
    the finding it breaks ended the run (None: not caught within `examples`). The budget
    CONTROL_BUDGET must stay above the largest of these."""
    from kvgate.faults.controls import CATALOG_BREAKS, CATALOG_CONTROLS

    out: dict[str, list[int | None]] = {}
    for name, cls in CATALOG_CONTROLS.items():
        kind = CATALOG_BREAKS[name]
        out[name] = []
        for seed in seeds:
            v = state_machine(seed, examples=examples, steps=steps, catalog_factory=cls, shrink=False,
                              judged=frozenset({kind}))
            caught = v.valid is False and v.evidence.get("finding") == kind
            out[name].append(v.evidence.get("examples_run") if caught else None)
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m kvgate.harness.scenarios.pool budget [--seeds N]: the programs each known-bad
    catalog needed to be caught, per seed, against CONTROL_BUDGET."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m kvgate.harness.scenarios.pool")
    ap.add_argument("what", choices=["budget"])
    ap.add_argument("--seeds", type=int, default=20)
    a = ap.parse_args(argv)
    needed = programs_to_catch(range(a.seeds))
    ok = True
    for name, runs in needed.items():
        worst = None if None in runs else max(runs)
        ok = ok and worst is not None and worst <= CONTROL_BUDGET
        print(f"{name:<10} max {worst} median {sorted(r for r in runs if r)[len(runs) // 2] if all(runs) else '-'} "
              f"of {len(runs)} seeds (budget {CONTROL_BUDGET}): {runs}")
    print(json.dumps({"budget": CONTROL_BUDGET, "needed": needed, "within_budget": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
