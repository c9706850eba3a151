"""The hostile store-forgery scenario's runner (kvgate.harness.scenarios.hostile.tier.store_forgery)
on stand-in replicas over a real redis-server with its access control on: no vLLM, so the
runner's steps (watching G's keys appear, the attack between G's publish and H's load, its
checks) run where CI runs. G's stand-in publishes each prompt's blocks through a real
RedisTier; H's loads them through kvpool.tier.interface.tier_load (behind
kvgate.faults.tier_controls.UnauthenticatedTier when the control is armed), recomputes what its
load did not install, and answers with tokens that are a function of the KV it attended
to; both write the history records the runner and the oracles read (lookup, tier_publish,
tier_load, namespace, audit). The run must pass, with the byte-exact and the declared
miss-cause oracles; the control run must fail, and the byte-exact oracle must catch it for
its reason, as kvgate.harness.scenarios.runner.judge_control requires."""

from __future__ import annotations

import hashlib
import types

import numpy as np
import pytest

import kvgate.harness.scenarios.hostile.tier as hostile_tier
import kvgate.harness.scenarios.hosts as hosts
from kvgate.faults.tier_controls import UNAUTHENTICATED_TIER, UnauthenticatedTier
from kvgate.harness.checkers.byte_exact import byte_exact
from kvgate.harness.checkers.history import read_history
from kvgate.harness.checkers.miss_causes import expected_causes
from kvgate.harness.scenarios.catalog import find
from kvgate.harness.system.pool import DEFAULT_TENANT
from kvgate.harness.system.stores import RedisServer, redis_binary
from kvpool.pool.digest import page_digest
from kvpool.connector.history import HistoryWriter
from kvpool.pool.keys import Namespace
from kvpool.tier.record import TierAuth
from kvpool.tier.interface import tier_load, tier_publish
from kvpool.tier.redis import RedisTier

PAGE = 4096
NS = Namespace(model_id="tiny", model_revision="r1", tokenizer_hash="t", kv_dtype="bfloat16", kv_layout="cpu",
               block_size=128, num_layers=2, num_kv_heads=2, head_size=64)
AUTH = TierAuth.from_secret(DEFAULT_TENANT, "the hosts' tier secret, never the store's")

pytestmark = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (make test installs it)")


def _blocks(prompt: str) -> tuple[list[bytes], list[bytes]]:
    """A prompt's complete blocks: their chain hashes and their KV (a function of the hash)."""
    n = hosts.PROMPT_TOKENS // hosts.B
    hashes = [hashlib.blake2b(f"{prompt}|{i}".encode(), digest_size=16).digest() for i in range(n)]
    pages = [np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, PAGE, dtype=np.uint8).tobytes()
             for h in hashes]
    return hashes, pages


class StandIns:
    """The multi-host system as the runner sees it: G and H, a Redis store host."""

    store_kind = "redis"

    def __init__(self, store: RedisServer, history_dir) -> None:  # noqa: ANN001
        self.store, self.history_dir = store, history_dir
        self.armed: dict[str, dict] = {}
        self.events: list[str] = []
        self.writers = {r: HistoryWriter(history_dir, r, "standin") for r in "GH"}
        for w in self.writers.values():
            w.write("namespace", ns=NS.as_dict())
        self.tiers = {r: RedisTier(store.tenant_url(DEFAULT_TENANT), AUTH) for r in "GH"}
        self.computed: set[str] = set()  # the prompts G has in its prefix cache

    def url(self, replica: str) -> str:
        return replica

    def arm(self, replica: str, section: str, spec: dict) -> None:
        self.armed[replica] = {section: spec}

    def store_client(self):  # noqa: ANN201
        return self.store.client()

    def nemesis(self, action: str, **fields: object) -> None:
        self.events.append(action)

    def complete(self, url: str, prompt: str, *, tag: str, replica: str, load: bool = True, publish: bool = True,
                 **kwargs: object):  # noqa: ANN201
        hashes, pages = _blocks(prompt)
        w = self.writers[replica]
        used = list(pages)  # the KV attention reads: computed unless loaded
        if replica == "G" and prompt in self.computed:  # its own prefix hit of every complete block
            w.write("lookup", tag=tag, prompt_tokens=hosts.PROMPT_TOKENS, local_tokens=len(hashes) * hosts.B,
                    external_tokens=0, hit_blocks=0, outcome="local_hit")
        elif replica == "G":
            self.computed.add(prompt)
            w.write("lookup", tag=tag, prompt_tokens=hosts.PROMPT_TOKENS, hit_blocks=0, outcome="miss",
                    miss_cause="never_published")
            res = tier_publish(self.tiers["G"], NS, hashes, pages)
            w.write("audit", kind="produced", tag=tag, hashes=[h.hex() for h in hashes],
                    digests=[page_digest(p).hex() for p in pages])
            w.write("tier_publish", tag=tag, put=res.put, refused=res.refused, error=res.error)
        elif load:
            n = self.tiers["H"].exists(NS, hashes)
            w.write("lookup", tag=tag, tier_blocks=n, tier_found=n, hit_blocks=0, outcome="remote_hit" if n else "miss")
            armed = self.armed.get("H", {}).get("copier", {}).get("control") == UNAUTHENTICATED_TIER
            reader = UnauthenticatedTier(self.tiers["H"]) if armed else self.tiers["H"]
            dest = [np.zeros(PAGE, np.uint8) for _ in range(n)]
            got = tier_load(reader, NS, hashes[:n], lambda i: dest[i])
            w.write("tier_load", tag=tag, loaded=got.loaded, blocks=n,
                    miss_cause=got.miss.cause.value if got.miss else None)
            used[:got.loaded] = [d.tobytes() for d in dest[:got.loaded]]
            if got.loaded:
                w.write("audit", kind="installed", tag=tag, block_ids=list(range(got.loaded)),
                        hashes=[h.hex() for h in hashes[:got.loaded]],
                        digests=[page_digest(p).hex() for p in used[:got.loaded]])
        tokens = list(hashlib.blake2b(b"".join(used), digest_size=8).digest())
        return types.SimpleNamespace(token_ids=tokens, logprobs=[0.0] * len(tokens), error=None, ttft_s=0.01)


@pytest.fixture
def standins(tmp_path, monkeypatch):
    store = RedisServer(tmp_path / "redis", tenants=(DEFAULT_TENANT,)).start()
    system = StandIns(store, tmp_path / "history")
    monkeypatch.setattr(hosts, "complete", system.complete)
    monkeypatch.setattr(hostile_tier, "complete", system.complete)
    monkeypatch.setattr(hostile_tier, "reset_prefix_cache", lambda url: None)
    yield system
    store.stop()


def _corpus() -> types.SimpleNamespace:
    return types.SimpleNamespace(text=lambda n, rng: f"prompt {rng.random()!r}")


def test_the_store_forgery_runner_passes_and_its_control_is_caught_by_byte_exact(standins, test_seed):
    sc = find("hostile-store-forgery")
    v = hostile_tier.RUNNERS[sc.runner](standins, _corpus(), test_seed, **sc.params)
    assert v.valid is True, v.reason
    assert standins.events == ["store_forgery"]
    recs = read_history(standins.history_dir)
    assert byte_exact(recs).valid is True
    assert expected_causes(recs, sc.expect_load_causes, sc.expect_lookup_causes).valid is True

    standins.store.client().flushall()  # the gate's reset between the run and its control
    for w in standins.writers.values():
        w.write("namespace", ns=NS.as_dict())
    t0 = max(r["t"] for r in recs)
    control = hostile_tier.RUNNERS[sc.runner](standins, _corpus(), test_seed + 1, **{**sc.params, **sc.control.params})
    assert control.valid is False  # the scenario's own checks see it too (nothing was corrupt)
    crecs = [r for r in read_history(standins.history_dir) if r["t"] > t0]
    be = byte_exact(crecs)
    assert be.valid is False and sc.control.because in be.reason, be.reason


def test_the_runner_refuses_what_it_cannot_play(standins):
    with pytest.raises(ValueError, match="control"):
        hostile_tier.store_forgery(standins, _corpus(), 1, control="deaf_tier_rule")
    with pytest.raises(ValueError, match="redis"):
        hostile_tier.store_forgery(standins, _corpus(), 1, store="mooncake")
