"""Conformance scenario `exact_boundaries`: prompts of exactly a multiple of the prefill
chunk (max_num_batched_tokens, chunked prefill), of the KV block, and of the connector's
own chunk where it has one, each with one token below and one above.

A full hit at an exact multiple is where an off-by-one hides: the engine must compute at
least the last prompt token, so a synchronous loader may claim at most n - 1 tokens, and
the block that holds token n - 1 is the one both sides round differently (LMCache#5151:
a full hit at an exact chunk multiple gave wrong output; vllm#51094). For each prompt A
computes it cold, B (another replica) is asked for it and loads what A stored, and A asks
again (its own prefix-cache hit: the reference of B's prefill partition). B's claim leaves
a token to compute (or B loads asynchronously), every block B installed is A's bytes, B's
output equals A's prefix hit to the last bit, and its tokens equal A's cold run.

Negative control `claim_one_more` (kvgate.faults.connector): at a prompt of an exact block
multiple the connector claims one token past what it loads; the token at the claim's end
is neither loaded nor computed, and the output oracle must see it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from kvgate.harness.checkers.verdict import Checks

if TYPE_CHECKING:
    from kvgate.harness.conformance.context import Ctx


def boundary_lengths(block: int, prefill_chunk: int, connector_chunk: int = 0) -> dict[str, int]:
    """The exact multiples (prompt tokens, BOS included): a block multiple that is no
    multiple of a larger unit (11 blocks: odd, below the prefill chunk), the connector's
    chunk multiple where it has one (the smallest multiple of it past the block multiple
    that is not the prefill chunk), and the prefill chunk itself."""
    out = {"block": 11 * block}
    if connector_chunk and connector_chunk != block:
        m = (out["block"] // connector_chunk + 1) * connector_chunk
        if m % prefill_chunk == 0:
            m += connector_chunk
        out["connector_chunk"] = m
    out["prefill_chunk"] = prefill_chunk
    return out


def exact_boundaries(ctx: Ctx, control: str | None = None) -> Checks:
    from kvgate.harness.conformance import context as base
    from kvgate.harness.system.cluster import DEFAULT_CHUNK

    rng = random.Random(ctx.seed)
    B = base.BLOCK
    multiples = boundary_lengths(B, DEFAULT_CHUNK, ctx.profile.chunk_tokens)
    # Each exact multiple with one token below and one above; under the control only the exact
    # multiples (the control claims one token too many there and nowhere else).
    cases = [(f"{unit}{d:+d}" if d else unit, m + d) for unit, m in multiples.items()
             for d in ((0,) if control else (-1, 0, 1))]
    tag = base._tag("b", ctx.seed)
    if control:
        base.arm_control(ctx, "B", control)
    c = Checks()
    per_case = {}
    for name, n in cases:
        prompt = ctx.corpus.text(n - 1, rng)  # + BOS: n prompt tokens
        t = f"{tag}-{name}"
        cold = ctx.run("A", prompt, f"{t}-a")
        b = ctx.run("B", prompt, f"{t}-b")
        a_hit = ctx.run("A", prompt, f"{t}-ahit")
        m = ctx.match("B", f"{t}-b")
        claimed = None if m is None else m["local_tokens"] + m["external_tokens"]
        # A stored the prompt: a connector that claims nothing missed a hit (no wrong KV, but the
        # boundary case was not exercised, and a store it cannot find again is a defect of its own)
        c.check(f"[{name}: {n} tokens] B's connector found the prompt A stored (a hit)",
                m is not None and m["external_tokens"] > 0, m)
        c.check(f"[{name}: {n} tokens] B's claim leaves a prompt token to compute (or it loads asynchronously)",
                m is not None and (claimed < n or m["load_async"]), m)
        installed = ctx.installed("B", f"{t}-b")
        produced = ctx.produced("A", f"{t}-a")
        differ = [k for k, d in installed.items() if produced.get(k) != d]
        c.check(f"[{name}: {n} tokens] every block B installed equals A's bytes", not differ,
                f"{len(differ)} of {len(installed)} differ")
        c.check(f"[{name}: {n} tokens] B generated 16 tokens", len(b.token_ids) == 16 and b.error is None, b.error)
        base.same_output(c, ctx, f"[{name}: {n} tokens] B's output equals A's prefix hit", b, a_hit)
        # the cold run computed the whole prompt: another partition, so its tokens are compared
        c.output(f"[{name}: {n} tokens] B's tokens equal A's cold run", b, cold, cached=(claimed, 0))
        per_case[name] = {"prompt_tokens": n, "claimed": None if m is None else m["external_tokens"],
                          "local": None if m is None else m["local_tokens"],
                          "load_async": None if m is None else m["load_async"], "installed": len(installed)}
    c.evidence.update(multiples=multiples, cases=per_case, control=control)
    return c
