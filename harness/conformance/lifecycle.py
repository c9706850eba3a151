"""Connector-agnostic scenarios of what happens to a cache around the requests: a reset of
the external cache after a weight update, a request that must not read any cache (prompt
log-probabilities), an adapter reloaded under its old name. Judged, like the others of
kvgate.harness.conformance.scenarios (which registers them), from the audit's records of
what the connector claimed, installed and produced, and from the outputs alone.

  reset_external            after `POST /reset_prefix_cache?reset_external=true` no request
                            may hit KV published before it, on the replica reset or another
  prompt_logprobs_warm      prompt_logprobs over a prefix the connector holds: the list is
                            full-length and equal to the cold run's
  adapter_reload_same_name  two LoRA adapters loaded in turn under one name: no stale hit

Each body takes `control` (its negative control, kvgate.faults.connector) and returns Checks;
the scenario's Ctx (kvgate.harness.conformance.scenarios.Ctx) is its first argument.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kvgate.harness.checkers.verdict import Checks
from kvgate.harness.client import engine_api
from kvgate.harness.conformance.context import _tag, all_digests, arm_control

ADAPTER = "ad"  # the adapter name the adapter scenario reloads
LORA_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
LORA_ENV = (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),)


def _digests(ctx: Any, kind: str, replica: str, tag: str) -> set[str]:
    return {d for ds in all_digests(ctx, kind, replica, tag).values() for d in ds}


def _cold(c: Checks, ctx: Any, refs: list[tuple[str, str]]) -> None:
    """A reference run under a cache_salt of its own must be computed cold (nothing
    installed): else the output comparison against it proves nothing (a connector that
    serves KV across cache salts gives its reference the KV under test)."""
    loaded = {f"{rep}/{t}": len(ctx.installed(rep, t)) for rep, t in refs}
    c.check("the references were computed cold (nothing installed under their own cache_salt)",
            not any(loaded.values()), loaded)


def _r2_weights(ctx: Any) -> Path:
    """The tiny model's revision r2 (other weights, the same architecture and tokenizer),
    in a folder of its own: the weights a replica loads in place."""
    from kvgate.fixtures.tiny_model import build_tiny_model

    out = Path(ctx.cluster.report_dir) / "model" / "tiny-r2-weights"
    if not (out / "model.safetensors").exists():
        build_tiny_model(out, seed=0, revision="r2")
    return out


def reset_external(ctx: Any, prompt_tokens: int = 1200, control: str | None = None) -> Checks:
    """A computes two prompts on revision r1 and the connector stores them. Then the
    weight update of an RL loop: A and B load revision r2's weights in place (the model's
    name and files do not change, so neither does anything a connector keys by), and A's
    `POST /reset_prefix_cache?reset_external=true` (asked again while it answers success
    false) must reset the connector's cache. After it, A asks for the first prompt and B
    for the second: no block published before the reset may be claimed or installed
    (nothing was published since: any hit is stale), and each output equals its
    replica's cold run on r2 (under a cache_salt of its own, checked cold: nothing
    installed) to the last bit (vLLM 0.24 answers the reset with no outcome: then only
    what follows it is judged). Positive
    control: after the reset A computes a third prompt and B installs A's blocks of it
    (the connector still shares). The replicas load r1 again at the end. Negative control
    `deaf_reset` (on A): reset_cache answers None and keeps the store, vLLM reports
    success, and the replicas load KV that r1 computed."""
    rng = random.Random(ctx.seed)
    p_a, p_b, q = (ctx.corpus.text(prompt_tokens, rng) for _ in range(3))
    tag = _tag("z", ctx.seed)
    ctx.run("A", p_a, f"{tag}-a1")
    ctx.run("A", p_b, f"{tag}-b1")
    before = _digests(ctx, "produced", "A", f"{tag}-a1") | _digests(ctx, "produced", "A", f"{tag}-b1")
    r2 = _r2_weights(ctx)
    c = Checks()
    reloaded: list[str] = []
    try:
        for name in ("A", "B"):
            engine_api.reload_weights(ctx.url(name), str(r2))
            ctx.reidentify(name, "r2")
            reloaded.append(name)
        if control:
            arm_control(ctx, "A", control)
        reset = engine_api.reset_external(ctx.url("A"))
        if reset["reported"]:  # a server that reports no outcome (vLLM 0.24) is judged by what follows alone
            c.check("the reset (reset_external=true) reported success", reset["success"], reset)
        after = {"A": ctx.run("A", p_a, f"{tag}-a2"), "B": ctx.run("B", p_b, f"{tag}-b2")}
        refs = {"A": ctx.run("A", p_a, f"{tag}-aref", cache_salt=f"{tag}-ref"),
                "B": ctx.run("B", p_b, f"{tag}-bref", cache_salt=f"{tag}-ref")}
        ctx.run("A", q, f"{tag}-qa")
        ctx.run("B", q, f"{tag}-qb")
    finally:
        for name in reloaded:  # r1 again, as the next scenario expects
            try:
                engine_api.reload_weights(ctx.url(name), str(ctx.cluster.model_dir))
                ctx.reidentify(name, None)
            except engine_api.RequestFailed:
                ctx.restart.add(name)  # restarted by the runner instead
    stale = {}
    for name, t in (("A", f"{tag}-a2"), ("B", f"{tag}-b2")):
        m = ctx.match(name, t)
        installed = ctx.installed(name, t)
        old = [k for k, d in installed.items() if d in before]
        stale[name] = {"claimed_tokens": None if m is None else m["external_tokens"], "installed": len(installed),
                       "installed_before_reset": len(old)}
    c.check("no request after the reset hit KV published before it",
            all(s["claimed_tokens"] == 0 and s["installed"] == 0 for s in stale.values()), stale)
    _cold(c, ctx, [("A", f"{tag}-aref"), ("B", f"{tag}-bref")])
    for name in ("A", "B"):
        c.output(f"{name}'s output after the reset equals its cold run on the new weights", after[name], refs[name])
    shared = ctx.installed_from("B", f"{tag}-qb", ctx.produced("A", f"{tag}-qa"))
    c.check("positive control: after the reset B installed A's blocks of a prompt A computed then", len(shared) > 0,
            len(shared))
    c.evidence.update(reset=reset, after_reset=stale, positive_control_installed=len(shared),
                      weights={"before": "r1", "after": "r2 (loaded in place)"})
    return c


def prompt_logprobs_warm(ctx: Any, prompt_tokens: int = 1500, control: str | None = None) -> Checks:
    """A computes a prompt and the connector stores it. B is asked for the same prompt
    with prompt_logprobs: its list has an entry for every prompt token (the first None,
    every other one computed) and equals, entry for entry, the list of B's cold run of the
    prompt (under a cache_salt of its own, checked cold: nothing installed), and so do the generated tokens
    with their log-probabilities. vLLM marks such a request skip_reading_prefix_cache: a
    prompt log-probability is only computed for a token the engine computes. Negative
    control `load_despite_skip` (on B): the flag cleared before the connector and the
    engine read it, as on a vLLM before #57269 with a connector that does not honour it:
    the engine takes the hit and the list comes back short."""
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    tag = _tag("g", ctx.seed)
    ctx.run("A", prompt, f"{tag}-a")
    cold = engine_api.prompt_logprobs(ctx.url("B"), prompt, tag=f"{tag}-bcold", replica="B",
                                      cache_salt=f"{tag}-cold", timeout_s=ctx.timeout_s)
    if control:
        arm_control(ctx, "B", control)
    failed = None
    try:
        warm = engine_api.prompt_logprobs(ctx.url("B"), prompt, tag=f"{tag}-b", replica="B", timeout_s=ctx.timeout_s)
    except engine_api.RequestFailed as exc:  # judged below: the list never came
        warm, failed = None, str(exc)[:300]
    if ctx.profile.settle is not None:
        ctx.profile.settle(ctx.cluster.report_dir, "B", f"{tag}-b")
    c = Checks()
    n = cold.prompt_tokens
    _cold(c, ctx, [("B", f"{tag}-bcold")])
    c.check("the cold run's list is full-length (the reference is sound)",
            len(cold.entries) == n and cold.computed() == n - 1, {"entries": len(cold.entries), "prompt_tokens": n})
    got = warm.entries if warm is not None else []
    c.check("the warm request's prompt_logprobs are full-length",
            warm is not None and len(got) == n and warm.computed() == n - 1,
            {"entries": len(got), "with_a_value": warm.computed() if warm else 0, "prompt_tokens": n,
             **({"request_failed": failed} if failed else {})})
    differ = [i for i, (a, b) in enumerate(zip(got, cold.entries)) if a != b]
    c.check("the warm request's prompt_logprobs equal the cold run's, entry for entry",
            len(got) == len(cold.entries) and not differ, {"first_differing": differ[:3], "differing": len(differ)})
    c.output("the warm request's output equals the cold run's", warm, cold)
    m = ctx.match("B", f"{tag}-b")
    installed = ctx.installed("B", f"{tag}-b")
    produced = ctx.produced("A", f"{tag}-a")
    # The connector may claim a hit the engine then drops (vLLM 0.32 zeroes it): evidence, not
    # a failure; a load the engine took shows in the installed blocks and the list.
    c.evidence.update(claimed=m, installed=len(installed), producer_blocks=len(produced), prompt_tokens=n,
                      warm_entries=len(got), warm_computed=warm.computed() if warm else 0, warm_failed=failed)
    return c


def _loaded(ctx: Any, replica: str, path: Path, *, inplace: bool = False) -> None:
    engine_api.load_adapter(ctx.url(replica), ADAPTER, str(path), inplace=inplace)


def adapter_reload_same_name(ctx: Any, prompt_tokens: int = 1500, control: str | None = None) -> Checks:
    """vLLM keys an adapter by its name (vllm#30931; the server keeps the id of a name on a
    reload, and one path may hold other weights after a training step). One adapter
    folder: E loads adapter `ad` from it (weights w1) and computes a prompt under it; the
    folder is rewritten with other weights w2 (another seed: other KV); F loads `ad` from
    it and asks for the prompt: nothing E computed under w1 may be claimed or installed
    (no block's bytes may be one of E's), and F's output equals F's cold run under w2
    (a cache_salt of its own, checked cold) to the last bit. Then E reloads `ad` in place (same name,
    id and path) and, its own prefix cache reset (vLLM's local cache would serve w1: not
    the connector's), asks again: no block with E's w1 bytes. Positive control: E's
    second run installs F's w2 blocks (the same adapter on two replicas shares). Negative
    control `adapter_by_name` (on E and F): the connector sees the adapter by its name
    alone, and F installs E's w1 KV."""
    from kvgate.fixtures.tiny_model import build_tiny_lora
    from kvgate.harness.client.http import reset_prefix_cache
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    tag = _tag("n", ctx.seed)
    first = 1 + rng.randrange(10**6)
    seeds = (first, first + 1)  # the adapter's weights before and after the reload
    folder = Path(ctx.cluster.report_dir) / "adapters" / tag
    build_tiny_lora(folder, seeds[0])
    if control:
        for name in ("E", "F"):
            arm_control(ctx, name, control)
    c = Checks()
    try:
        _loaded(ctx, "E", folder)
        e1 = ctx.run("E", prompt, f"{tag}-e1", model=ADAPTER)
        w1 = _digests(ctx, "produced", "E", f"{tag}-e1")
        build_tiny_lora(folder, seeds[1])  # the same folder, other weights
        _loaded(ctx, "F", folder)
        f2 = ctx.run("F", prompt, f"{tag}-f2", model=ADAPTER)
        fref = ctx.run("F", prompt, f"{tag}-fref", model=ADAPTER, cache_salt=f"{tag}-ref")
        _loaded(ctx, "E", folder, inplace=True)
        reset_prefix_cache(ctx.url("E"))
        e2 = ctx.run("E", prompt, f"{tag}-e2", model=ADAPTER)
    finally:
        for name in ("E", "F"):  # the next run of the scenario loads it again
            try:
                engine_api.unload_adapter(ctx.url(name), ADAPTER)
            except engine_api.RequestFailed:
                pass  # never loaded (a load that failed): nothing to unload
    m = ctx.match("F", f"{tag}-f2")
    f_installed = ctx.installed("F", f"{tag}-f2")
    e_installed = ctx.installed("E", f"{tag}-e2")
    f_stale = [k for k, d in f_installed.items() if d in w1]
    e_stale = [k for k, d in e_installed.items() if d in w1]
    c.check("F (the adapter reloaded under the same name) hit no KV of the adapter's previous weights",
            m is not None and m["external_tokens"] == 0 and not f_stale,
            {"claimed": m, "installed": len(f_installed), "installed_of_w1": len(f_stale)})
    c.check("E (the adapter reloaded in place) installed no KV of the adapter's previous weights", not e_stale,
            {"installed": len(e_installed), "installed_of_w1": len(e_stale)})
    _cold(c, ctx, [("F", f"{tag}-fref")])
    c.output("F's output equals its cold run under the reloaded adapter", f2, fref)
    shared = ctx.installed_from("E", f"{tag}-e2", ctx.produced("F", f"{tag}-f2"))
    c.check("positive control: E, reloaded, installed F's blocks of the same adapter", len(shared) > 0, len(shared))
    c.check("the two adapters' KV differs (else the scenario proves nothing)",
            not (w1 & _digests(ctx, "produced", "F", f"{tag}-fref")), None)
    c.evidence.update(adapter_seeds=seeds, folder=str(folder), positive_control_installed=len(shared),
                      e1_tokens=e1.token_ids[:4], e2_error=e2.error)
    return c
