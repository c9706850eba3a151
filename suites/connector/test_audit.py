"""The audit connector (kvpool.connector.audit) records what it claims: every digest it writes
(produced, seen, installed) equals the digest of the block's bytes read directly from the
engine's KV tensors at that moment, and an installed block's digest equals its producer's.
A deliberately misaligned audit (it digests the neighbouring block) must fail the same
check, so the check can fail. Both roles run in this process against a real pool, driven
with the scheduler outputs a prefill produces (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from suites.connector.engine_calls import ask_matched, finished
from kvgate.harness.checkers.history import read_history
from kvgate.harness.system.cluster import CONNECTOR, connector_config
from kvgate.harness.system.pool import thread_pool
from kvpool.connector import vllm_compat as compat
from kvpool.connector.audit import AuditConnector
from kvpool.pool.copy import digest_segments

B, LAYERS, HEADS, HEAD = 16, 2, 2, 64
PAGE = LAYERS * HEADS * B * 2 * HEAD * 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class MisalignedAudit(AuditConnector):
    """A known-bad audit: it digests the block after the one it names."""

    def _digest(self, block_id: int) -> str:
        return super()._digest(block_id + 1)


@pytest.fixture
def pool():
    d = thread_pool(page_size=PAGE, num_pages=32)
    yield d
    d.stop_thread()


def _config(tmp_path, pool):  # noqa: ANN001, ANN202
    extra = {"pool": f"unix:{pool.unix_path}", "token": "tok", "replica": "R", "history_dir": str(tmp_path / "h")}
    mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: HEADS, get_head_size=lambda: HEAD)
    kv = SimpleNamespace(kv_connector_extra_config=connector_config(CONNECTOR, extra, "recompute",
                                                                    audit=True)["kv_connector_extra_config"])
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=B),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           device_config=SimpleNamespace(device_type="cpu"), kv_transfer_config=kv)


def _request(rid: str, tokens: list[int]):  # noqa: ANN202
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                           kv_transfer_params=None)


def _step(rid: str, block_ids: list[int], scheduled: int, computed: int = 0):  # noqa: ANN202
    """A step scheduling a new request: `computed` tokens before it (its local and external hit)."""
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=[block_ids],
                                                               num_computed_tokens=computed)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                                 resumed_req_ids=set()),
                           num_scheduled_tokens={rid: scheduled})


def _run_step(sched, worker, step) -> None:  # noqa: ANN001
    worker.bind_connector_metadata(sched.build_connector_meta(step))
    worker.start_load_kv(None)
    worker.wait_for_layer_load(NAMES[0])
    worker.wait_for_save()
    worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()


def _direct(layers: list[torch.Tensor], block_id: int) -> str:
    return digest_segments([t[block_id].contiguous().view(torch.uint8).numpy() for t in layers]).hex()


def audit_mismatches(tmp_path, pool, seed: int, audit_class=AuditConnector) -> list[str]:  # noqa: ANN001
    """Produce 3 blocks, load them into other engine blocks; every audit digest against the
    bytes read from the tensors right after the step that recorded it."""
    config = _config(tmp_path, pool)
    sched = audit_class(config, compat.KVConnectorRole.SCHEDULER, None)
    worker = audit_class(config, compat.KVConnectorRole.WORKER, None)
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randint(-8, 8, (32, HEADS, B, 2 * HEAD), generator=gen).to(torch.bfloat16) for _ in NAMES]
    worker.register_kv_caches(dict(zip(NAMES, layers)))
    tokens = [int(x) for x in torch.randint(0, 2000, (3 * B + 1,), generator=gen)]
    bad: list[str] = []
    expected: dict[tuple[str, int], str] = {}

    producer = _request("p", tokens)
    assert ask_matched(sched, producer, 0) == (0, False)
    sched.update_state_after_alloc(producer, None, 0)
    _run_step(sched, worker, _step("p", [1, 2, 3, 4], len(tokens)))
    expected.update({("produced", b): _direct(layers, b) for b in (1, 2, 3)})
    sched.request_finished(producer, [1, 2, 3, 4])
    assert finished(worker, {"p"}) == {"p"}  # its stores are done

    consumer = _request("c", tokens)
    assert ask_matched(sched, consumer, 0) == (3 * B, False)
    sched.update_state_after_alloc(consumer, None, 3 * B)
    _run_step(sched, worker, _step("c", [10, 11, 12, 13], 1, 3 * B))
    expected.update({(kind, b): _direct(layers, b) for kind in ("seen", "installed") for b in (10, 11, 12)})

    recs = [r for r in read_history(tmp_path / "h") if r["ev"] == "audit"]
    got = {(r["kind"], b): d for r in recs for b, d in zip(r["block_ids"], r["digests"])}
    if set(got) != set(expected):
        bad.append(f"records for {sorted(set(got) ^ set(expected))}")
    bad += [f"{k}: recorded {got[k][:8]}, tensor {v[:8]}" for k, v in expected.items() if got.get(k, v) != v]
    produced = [got.get(("produced", b)) for b in (1, 2, 3)]
    installed = [got.get(("installed", b)) for b in (10, 11, 12)]
    if installed != produced:
        bad.append("installed digests differ from the producer's")
    return bad


def test_every_audit_record_equals_the_bytes_in_the_kv_tensors(tmp_path, pool, test_seed):
    assert audit_mismatches(tmp_path, pool, test_seed % 2**31) == []


def test_control_a_misaligned_audit_is_caught(tmp_path, pool, test_seed):
    bad = audit_mismatches(tmp_path, pool, test_seed % 2**31, MisalignedAudit)
    assert any("recorded" in b for b in bad), bad
