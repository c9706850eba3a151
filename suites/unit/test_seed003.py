"""kvgate bench seed003's pure parts: the architecture fixture, the oracles' verdicts, the
side-by-side table (no GPU, no replicas)."""

from __future__ import annotations

import json

from kvgate.fixtures.arch_model import ARCHS, write_arch
from kvgate.harness.bench.seed003 import Plan, failures, render_markdown, side_by_side


def test_the_24b_geometry_is_the_published_one():
    a = ARCHS["mistral-small-24b"]
    assert a.kv_bytes_per_token == 160 * 1024  # 2 x 40 layers x 8 KV heads x 128 x 2 bytes
    assert a.kv_cache_groups == 1
    assert 23.5e9 < a.parameters < 23.7e9  # Mistral Small 3.1's text decoder: 23.6 B


def test_the_checkpoint_has_no_weights_and_a_tokenizer_of_the_full_vocabulary(tmp_path):
    a = ARCHS["smoke"]
    d = write_arch(tmp_path / "m", a)
    config = json.loads((d / "config.json").read_text())
    assert config["vocab_size"] == a.vocab and config["sliding_window"] is None
    assert not list(d.glob("*.safetensors"))
    vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(a.vocab))  # every id the model can emit decodes


def _ttft(bytes_ok: int = 2, output_equal: int = 2, cold_equal: int = 2) -> dict:
    return {"off_ms": {"median": 30000.0, "min": 29000.0, "max": 31000.0, "n": 2, "all": []},
            "on_ms": {"median": 600.0, "min": 590.0, "max": 610.0, "n": 2, "all": []},
            "reduction": 0.98, "h2d_floor_ms": 380.0,
            "oracles": {"hits": 2, "hits_bytes_ok": bytes_ok, "hits_output_equal_local_hit": output_equal,
                        "producer_cold_tokens_equal_B_cold": cold_equal, "compared_cold": 2, "errors": []}}


def _sessions(on_differ: list[str] | None = None, empty_cross: list[str] | None = None) -> dict:
    stats = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 2, "all": []}
    return {"improvement": 0.4, "session_ttft_sum_ms": {"off": stats, "on": stats},
            "oracles": {"off_blocks_differ": [], "on_blocks_differ": on_differ or [], "errors": [],
                        "settle_timeouts": 0, "cross_on_turns_without_remote_blocks": empty_cross or []}}


def test_a_clean_run_passes_and_every_broken_oracle_fails_it():
    plan = Plan()
    good = {"parts": {"ttft:128000": _ttft(), "sessions:32768": _sessions(), "control:32768": _sessions()}}
    assert failures(good, plan) == []
    for part, key in ((_ttft(bytes_ok=1), "did not load every block"),
                      (_ttft(output_equal=1), "other tokens or log-probabilities"),
                      (_ttft(cold_equal=1), "do not hold the same weights")):
        bad = {"parts": {**good["parts"], "ttft:128000": part}}
        assert any(key in f for f in failures(bad, plan)), key
    bad = {"parts": {**good["parts"], "sessions:32768": _sessions(on_differ=["s0-t3"])}}
    assert any("on blocks differ" in f for f in failures(bad, plan))
    bad = {"parts": {**good["parts"], "sessions:32768": _sessions(empty_cross=["s0-t1"])}}
    assert any("loaded nothing" in f for f in failures(bad, plan))
    assert any("not run" in f for f in failures({"parts": {"ttft:128000": {"not_run": "no time"}}}, plan))
    assert failures({"parts": {}}, plan) == ["no part ran"]


def test_a_publish_whose_records_cover_the_prompt_but_did_not_land_fails_the_run():
    """A publish record covers the blocks it offered, landed or not: the 256k run on the H200
    waited on such records while B then found only part of the prompt in the pool."""
    from kvgate.harness.scenarios.gpu_live import publish_outcome

    recs = [{"blocks": 512, "first_block": 0, "committed": 512},
            {"blocks": 512, "first_block": 512, "committed": 500, "exists": 12},
            {"blocks": 512, "first_block": 1024, "committed": 100, "no_capacity": 412,
             "error": "reserve: NoCapacity: pool full"}]
    out = publish_outcome(recs)
    assert (out["offered"], out["landed"], out["no_capacity"]) == (1536, 1124, 412)
    assert out["errors"] == ["blocks 1024+512: reserve: NoCapacity: pool full"]
    part = _ttft()
    part["oracles"]["publishes_short"] = [{"block": "1:on", "rep": 0, **out}]
    msgs = failures({"parts": {"ttft:256000": part}}, Plan())
    assert any("landed 1124 of 1536 blocks (no capacity 412" in m for m in msgs), msgs


def test_the_table_sets_kvgate_beside_the_seed_with_ratio_and_floor():
    result = {"parts": {"ttft:128000": _ttft(), "sessions:131072": _sessions()}, "env": {}, "arch": {}}
    rows = {r["row"]: r for r in side_by_side(result)}
    on = next(r for k, r in rows.items() if k.startswith("cross-replica TTFT ON") and "128000" in k)
    assert on["paper"] == 0.605 and on["kvgate"] == 0.6 and on["ratio"] == round(0.6 / 0.605, 3)
    assert on["floor"] == 0.38
    off = next(r for k, r in rows.items() if k.startswith("cross-replica TTFT OFF"))
    assert off["paper"] == 31.715 and off["ratio"] == round(30.0 / 31.715, 3)
    sess = next(r for k, r in rows.items() if k.startswith("six-turn"))
    assert sess["paper"] == 0.45 and sess["ratio"] == round(0.4 / 0.45, 3)
    assert any(r.get("kvgate") == "not run" and "256k" in k for k, r in rows.items())
    red = next(r for k, r in rows.items() if k.startswith("cross-replica TTFT reduction"))
    assert red["floor"] == f"{1 - 0.38 / 30.0:.4f} (ON at the floor)"  # the reduction with an ON at the floor
    assert off["floor"].startswith("no load")
    assert sess["floor"] is None  # no pinned rate in this result: no floor made up
    result.update(pinned_h2d_GBps=50.0, arch={"kv_bytes_per_token": 160 * 1024})
    rows = {r["row"]: r for r in side_by_side(result)}
    sess = next(r for k, r in rows.items() if k.startswith("six-turn"))
    assert sess["floor"].startswith(f"{131072 * 160 * 1024 / 50e9:.3f} s a load of the context")
    result["parts"]["ttft:32768"] = _ttft()
    short = next(r for r in side_by_side(result) if r["row"].startswith("cross-replica TTFT ON") and "32768" in r["row"])
    assert short["paper"] == "no figure" and short["ratio"] == "n/a"  # the seed has no 32k TTFT
    result["table"] = side_by_side(result)
    result["failures"] = []
    assert "| cross-replica TTFT ON" in render_markdown(result)


def test_a_plan_past_the_published_positions_raises_them_and_says_so():
    from kvgate.harness.bench.seed003 import with_positions

    a = ARCHS["mistral-small-24b"]
    same, note = with_positions(a, Plan(ttft_lengths=(128000,), session_contexts=(), control_contexts=()))
    assert same is a and note == ""
    plan = Plan(ttft_lengths=(256000,), session_contexts=(), control_contexts=())
    wide, note = with_positions(a, plan)
    assert wide.max_position_embeddings == 262144 >= plan.max_len() > a.max_position_embeddings
    assert "131072" in note and "262144" in note
    assert wide.kv_bytes_per_token == a.kv_bytes_per_token and wide.parameters == a.parameters


def test_the_replicas_memory_is_read_from_their_logs():
    from kvgate.harness.bench.seed003 import memory_line, replica_memory

    log = ("INFO [model_runner.py:302] Model loading took 22.87 GiB and 1.7 seconds\n"
           "INFO [gpu_worker.py:429] Initial free memory 139.29 GiB, reserved 40.0 GiB memory for KV Cache\n"
           "INFO [kv_cache_utils.py:2146] GPU KV cache size: 262,144 tokens\n")
    m = replica_memory(log)
    assert m == {"weights_gib": 22.87, "initial_free_gib": 139.29, "kv_cache_tokens": 262144}
    assert replica_memory("nothing") == {"weights_gib": None, "initial_free_gib": None, "kv_cache_tokens": None}
    line = memory_line({"replicas": {"A": m}, "gpu": {"used_mib": 130 * 1024, "total_mib": 140 * 1024}})
    assert "weights 22.87 GiB" in line and "262144 tokens" in line and "130.0 of 140.0 GiB" in line


def test_a_length_not_measured_yet_is_estimated_from_an_earlier_runs_cold_prefill():
    from kvgate.harness.bench.seed003 import _estimate_s

    assert _estimate_s("ttft", 256000, 1, {}, {})[0] == 0.0  # nothing measured: the part runs
    est, basis = _estimate_s("ttft", 256000, 1, {}, {128000: 80.0})
    per = 80.0 * 2 ** 1.6
    assert abs(est - (4 * per * 1.15 + 10)) < 1e-6
    assert "earlier run" in basis and "128000" in basis and "4 cold prefills" in basis
    est_here, basis_here = _estimate_s("sessions", 128000, 1, {128000: 81.0}, {128000: 80.0})
    assert est_here == 6 * 81.0 * 1.15 + 10 and "this run" in basis_here  # this run's own figure first


def test_rows_not_run_keep_the_seeds_figure_and_the_reason():
    result = {"parts": {"ttft:256000": {"not_run": "about 1200 s needed, 150 s left", "estimate": "4 cold prefills"},
                        "sessions:128000": {"not_run": "about 574 s needed, 118 s left"}}}
    rows = side_by_side(result)
    ttft = [r for r in rows if r["row"].startswith("cross-replica")]
    assert len(ttft) == 1  # the 256k part ran (as "not run"): no second 256k row
    assert ttft[0]["paper"] == "92.047 -> 0.79" and ttft[0]["kvgate"] == "not run"
    assert "150 s left" in ttft[0]["spread"] and "4 cold prefills" in ttft[0]["spread"]
    sess = next(r for r in rows if r["row"].startswith("six-turn"))
    assert sess["paper"] == 0.45 and sess["kvgate"] == "not run"


def test_the_cli_takes_fp8_and_earlier_cold_prefills():
    import argparse

    import pytest

    from kvgate.harness.bench.seed003 import add_arguments, plan_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    plan = plan_from_args(ap.parse_args(["--quantization", "fp8", "--cold-s", "128000=81.767", "--lengths", "256000",
                                         "--session-contexts", "", "--control-contexts", ""]))
    assert plan.quantization == "fp8" and plan.prior_cold_s == ((128000, 81.767),)
    assert plan.ttft_lengths == (256000,) and plan.session_contexts == ()
    with pytest.raises(ValueError):
        plan_from_args(ap.parse_args(["--cold-s", "128000"]))
    assert plan_from_args(ap.parse_args([])).quantization == ""


def test_a_hit_alone_is_planned_with_its_own_prefills_and_its_rows_say_which_block_did_not_run():
    import argparse

    import pytest

    from kvgate.harness.bench.seed003 import _estimate_s, add_arguments, plan_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert plan_from_args(ap.parse_args([])).ttft_blocks == ("off", "on", "on", "off")
    plan = plan_from_args(ap.parse_args(["--ttft-blocks", "on"]))
    assert plan.ttft_blocks == ("on",)
    for bad in ("", "on,of", "ON"):
        with pytest.raises(ValueError):
            plan_from_args(ap.parse_args(["--ttft-blocks", bad]))
    est, basis = _estimate_s("ttft", 256000, 1, {}, {256000: 300.0}, ttft_blocks=1)
    assert est == 300.0 * 1.15 + 10 and "1 cold prefills" in basis
    part = {"prompt_tokens": 256000, "blocks": ["on"], "off_ms": {"median": None, "min": None, "max": None, "n": 0},
            "on_ms": {"median": 900.0, "min": 900.0, "max": 900.0, "n": 1}, "reduction": None}
    rows = side_by_side({"parts": {"ttft:256000": part}})
    off = next(r for r in rows if "OFF (cold" in r["row"])
    on = next(r for r in rows if "ON (B loads" in r["row"])
    assert off["kvgate"] is None and "no OFF block" in off["spread"] and off["ratio"] == "n/a"
    assert on["kvgate"] == 0.9 and on["ratio"] == round(0.9 / 0.79, 3)


def test_the_producers_cold_tokens_are_compared_with_b_s_only_where_an_off_block_ran_the_prompt():
    from kvgate.harness.bench.seed003 import producer_against_cold

    def on(block, rep, toks):
        return {"block": block, "rep": rep, "tokens": [9], "producer_tokens": toks}

    off = [{"block": "0:off", "rep": 0, "tokens": [1, 2]}, {"block": "0:off", "rep": 1, "tokens": [3, 4]}]
    assert producer_against_cold([on("0:on", 0, [1, 2])]) == []  # no OFF block: nothing to compare
    assert producer_against_cold([*off, on("1:on", 0, [1, 2]), on("2:on", 1, [3, 4])]) == [True, True]
    assert producer_against_cold([*off, on("1:on", 0, [1, 2]), on("2:on", 1, [3, 5])]) == [True, False]
    late = [on("0:on", 0, [7]), {"block": "1:off", "rep": 0, "tokens": [1, 2]}]  # the OFF block after
    assert producer_against_cold(late) == [False]


def _table_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "seed003_table.py"
    spec = importlib.util.spec_from_file_location("seed003_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_merged_runs_take_each_part_from_the_run_that_measured_it_and_keep_why_the_rest_did_not_run():
    table = _table_module()
    prov = {"env": {"provenance": {"short": "aaaaaaa"}}}
    run1 = {**prov, "plan": {"order": ["ttft:0", "sessions:0"], "ttft_lengths": [128000], "session_contexts": [128000]},
            "parts": {"ttft:128000": _ttft(), "sessions:128000": {"not_run": "about 574 s needed, 118 s left"}}}
    run2 = {"env": {"provenance": {"short": "bbbbbbb"}},
            "plan": {"order": ["sessions:0"], "session_contexts": [128000]}, "parts": {"sessions:128000": _sessions()}}
    run3 = {"env": {"provenance": {"short": "ccccccc"}}, "plan": {"order": ["ttft:0"], "ttft_lengths": [256000]},
            "parts": {}, "error": "Traceback\n(APIServer pid=7) ModuleNotFoundError: No module named 'x'\n"}
    merged, sources = table.merge([run1, run2, run3], {"ttft:256000": "four cold prefills of 248 s; 196 s left"})
    assert sources["ttft:128000"].startswith("run 1") and sources["sessions:128000"].startswith("run 2")
    assert merged["parts"]["sessions:128000"]["improvement"] == 0.4
    why = merged["parts"]["ttft:256000"]["not_run"]
    assert why.startswith("run 3 (ccccccc) raised before it: ModuleNotFoundError") and why.endswith("196 s left")
    rows = [r for r in side_by_side(merged) if "256" in r["row"]]
    assert len(rows) == 1 and rows[0]["paper"] == "92.047 -> 0.79" and "196 s left" in rows[0]["spread"]
    assert any("ttft:256000: not run" in f for f in merged["failures"])  # not run is never a pass
    import pytest

    with pytest.raises(SystemExit):  # a reason for a part a run measured is refused
        table.merge([run1, run2], {"ttft:128000": "no"})


def test_the_table_recomputes_the_weights_oracle_from_the_rows_and_says_when_the_record_differs():
    table = _table_module()
    rows = [{"block": "0:on", "rep": 0, "tokens": [5], "producer_tokens": [5]}]
    recorded = {**_ttft(cold_equal=0), "rows": rows}
    recorded["oracles"] = {**recorded["oracles"], "compared_cold": 1}  # a hit alone compared with nothing
    run = {"env": {"provenance": {"short": "ddddddd"}}, "plan": {"order": ["ttft:0"], "ttft_lengths": [256000]},
           "parts": {"ttft:256000": recorded}}
    assert any("same weights" in f for f in failures(run, Plan()))  # as the run itself judged it
    merged, sources = table.merge([run])
    assert merged["parts"]["ttft:256000"]["oracles"]["compared_cold"] == 0
    assert "recomputed from the rows: 0 of 0 equal (the run recorded 0 of 1)" in sources["ttft:256000"]
    assert not any("same weights" in f for f in merged["failures"])
    off = [{"block": "0:off", "rep": 0, "tokens": [1]}, {"block": "1:on", "rep": 0, "tokens": [1],
                                                          "producer_tokens": [2]}]
    wrong = {**_ttft(cold_equal=1), "rows": off}  # recorded as if equal; the rows say otherwise
    wrong["oracles"] = {**wrong["oracles"], "compared_cold": 1}
    merged, sources = table.merge([{**run, "parts": {"ttft:256000": wrong}}])
    assert any("same weights" in f for f in merged["failures"])
