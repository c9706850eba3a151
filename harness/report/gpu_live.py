"""Rendering a `kvgate gpu-live` result (kvgate.harness.gpu_live, from the parts in kvgate.harness.scenarios.gpu_live) as a
Markdown checklist.

  render_markdown(result, date) -> str
"""

from __future__ import annotations

from kvgate.harness.provenance import title_flag
from kvgate.harness.system.gpu import BLOCK_SIZE
from kvgate.harness.report.render import table


def render_markdown(result: dict, date: str) -> str:
    env = result["env"]
    gpus = int(result.get("gpus", 1))
    where = ("two replicas of the tiny model on one GPU" if gpus <= 1 else
             f"{len(result.get('placement', {}))} replicas of the tiny model, one per GPU ("
             + ", ".join(f"{k} on GPU {v}" for k, v in result.get("placement", {}).items()) + ")")
    prov = env.get("provenance") or {}  # a report from a dirty or unverified tree says so in its title
    lines = [f"# kvgate live on the GPU — {date}, {result.get('gpu_model', env.get('gpu', '?'))}{title_flag(prov)}", "",
             f"Commit {prov.get('short', 'unknown')}"
             + (f"; not the stamped tree: {'; '.join(prov['unverified'][:5])}" if prov.get("unverified") else "")
             + ".", "",
             f"{', '.join(env.get('gpus') or [env.get('gpu', '?')])}; vLLM {env.get('vllm')} (GPU bundle), torch "
             f"{env.get('torch')} (CUDA {env.get('cuda')}); {where} (2 layers, 2 KV heads, head 64, block "
             f"{BLOCK_SIZE}), all on one kvpool pool (one tenant: one segment of the host's pool), TRITON_ATTN, eager; "
             f"seed {result['seed']}; directions {', '.join(result.get('directions', ['A->B']))}.", ""]
    for ex in result.get("exchanges", []):
        lines += _exchange_lines(ex)
    if "error" in result:
        lines += ["", "Live part raised:", "", "```", result["error"][-1500:], "```"]
    live = ("not run (--no-exchanges)" if result.get("exchanges_skipped")
            else "PASS" if result.get("passed") else "FAIL")
    lines += ["", f"Overall (live exchanges): {live}", ""]
    if "tier" in result or "tier_error" in result:
        tier = result.get("tier") or {}
        lines += ["## The exchanges on a GPU keeper's tier", "",
                  "The same exchanges on two more replicas of the tiny model whose pool is a keeper's tier in device "
                  "memory (`kvpool keeper --backing vmm` on GPU 0; the replicas' GPU engines copy device to device); "
                  "the pool oracle reads each committed page out of the tier under a lease of its own.", ""]
        if result.get("tier_settings"):
            lines += [f"Tier replicas' settings besides: `{result['tier_settings']}`", ""]
        for ex in tier.get("exchanges", []):
            lines += _exchange_lines(ex)
        if result.get("tier_error"):
            lines += ["", "The tier exchanges raised:", "", "```", result["tier_error"][-1500:], "```"]
        lines += ["", f"Overall (tier exchanges): {'PASS' if tier.get('passed') else 'FAIL'}", ""]
    return _rest(result, lines)


def _exchange_lines(ex: dict) -> list[str]:
    v = ex["verdict"]
    mark = "x" if v["valid"] else " "
    label = "negative control caught" if ex["expect_caught"] and v["valid"] else (
        "pass" if v["valid"] else "FAIL")
    be = ex["byte_exact"]["evidence"]
    p, c = ex.get("producer", "A"), ex.get("consumer", "B")
    return [f"- [{mark}] **{ex['name']}** {p} → {c} ({label}): {v['reason']}",
           f"    - prompt {ex['prompt_tokens']} tokens; {c} loaded {ex['blocks_loaded_B']} of "
           f"{ex['blocks_expected']} blocks; installed {be.get('installed')}, differ from {p}'s "
           f"{be.get('differs_from_producer')}, from the pool's {be.get('differs_from_pool')}; cold recompute "
           f"compared {be.get('cold_compared', 'n/a (stopped at the first failure)')}, differ "
           f"{be.get('cold_differs', 'n/a')}",
           f"    - TTFT {p} {ex['A']['ttft_ms']} ms, {c} hit {ex['B_hit']['ttft_ms']} ms, {c} cold "
           f"{ex['B_cold']['ttft_ms']} ms; tokens {c} hit == {c} cold: {ex['tokens_equal_B_hit_vs_cold']}, "
           f"{p} == {c} cold: {ex['tokens_equal_A_vs_B_cold']}"
           + (f", {c} hit == {c} local prefix hit: {ex['tokens_equal_B_hit_vs_local_hit']}, local prefix hit == "
              f"cold: {ex['tokens_equal_B_local_hit_vs_cold']}" if "B_local_hit" in ex else ""),
           f"    - not checked: {v['not_checked']}"]


def _rest(result: dict, lines: list[str]) -> str:
    for s in result.get("sessions", []):
        if "skipped" in s:
            lines += [f"## OFF-ON-ON-OFF at {s['context_tokens']} tokens: not run ({s['skipped']})", ""]
            continue
        lines += [f"## OFF-ON-ON-OFF, six-turn sessions alternating replicas, {s['context_tokens']}-token context",
                  "", f"{s['sessions']} sessions x {s['turns']} turns (user {s['user_tokens']} tokens, answers "
                  f"{s['max_tokens']} tokens), router {s['router']} over {', '.join(s['replicas'])}; the bench model "
                  f"(16 layers, hidden 2048, 8 KV heads, head 128, 64 KiB of KV per token); every turn after the "
                  f"first runs on another replica than the turn before.", "",
                  *table(("block", "median TTFT, cross-replica turns (ms)", "mean session TTFT sum (ms)",
                          "TTFT by turn (ms)", "remote-hit blocks"),
                         [(b, d["ttft_median_ms_cross_turns"], d["session_ttft_sum_ms_mean"],
                           " / ".join(str(v) for v in d["ttft_median_ms_by_turn"].values()), d["remote_hit_blocks"])
                          for b, d in s["blocks"].items()])]
        lines += ["", f"- improvement (1 - ON/OFF): cross-turn median {s['improvement_cross_turn_median']}, session "
                      f"TTFT sum {s['improvement_session_ttft_sum']}",
                  f"- [{'x' if s['tokens_equal_all_blocks'] else ' '}] every (session, turn) generated the same tokens "
                  f"in all four blocks" + ("" if s["tokens_equal_all_blocks"] else
                                            f" (differ: {', '.join(s['mismatched_turns'])})"), ""]
    if "sessions_error" in result:
        lines += ["Sessions raised:", "", "```", result["sessions_error"][-1500:], "```", ""]
    bench = result.get("bench")
    if bench and bench.get("rows") and "cold_prefill_ms" not in bench["rows"][0]:  # the tier's rows alone
        lines += _tier_rows(bench)
    elif bench:
        lines += ["## `kvgate bench gpu` part 2 (live TTFT)", "", bench.get("model", ""), "",
                  *table(("prefix tokens", "cold ms", "local hit ms", "kvgate remote hit ms",
                          "kvgate, sync loads ms", "OffloadingConnector CPU hit ms",
                          "the same, prefix caching on ms", "remote / peer", "remote / peer (caching on)",
                          "remote / local", "host-to-device floor / local"),
                         [(r["prefix_tokens"], r["cold_prefill_ms"], r["local_hit_ttft_ms"], r["remote_hit_ttft_ms"],
                           r.get("remote_sync_hit_ttft_ms", "-"), r["peer_hit_ttft_ms"],
                           r.get("peer_cached_hit_ttft_ms", "-"), r["remote_vs_peer"],
                           r.get("remote_vs_peer_cached", "-"), r.get("remote_vs_local", "-"),
                           r.get("floor_vs_local", "-")) for r in bench["rows"]]), ""]
        for key, text in (("remote_no_slower_than_peer_at_every_length",
                           "kvgate's remote hit no slower than the peer's CPU-tier hit at every length"),
                          ("remote_no_slower_than_peer_cached_at_every_length",
                           "kvgate's remote hit no slower than the peer's CPU-tier hit with prefix caching on at every "
                           "length"),
                          ("remote_at_most_1.2x_local_at_every_length",
                           "kvgate's remote hit at most 1.2x the local prefix-cache hit at every length"),
                          ("floor_at_most_1.2x_local_at_every_length",
                           "the prefix's bytes at the pinned host-to-device rate fit within 1.2x the local hit "
                           "(the bound on any host-memory pool)")):
            if key in bench["targets"]:
                met = bench["targets"][key]
                lines += [f"- [{'x' if met else ' '}] {text} ({'met' if met else 'NOT met'})"]
        lines += [""]
        if any("gpu_tier_hit_ttft_ms" in r for r in bench["rows"]):
            lines += _tier_rows(bench, heading=False)
    if "failures" in result:  # every failure the run measured, of the parts asked for (the exit status)
        lines += [f"## Overall: {'PASS' if not result['failures'] else 'FAIL'}", ""]
        lines += [f"- {f}" for f in result["failures"]] or ["- nothing failed of what was asked for"]
        lines += [""]
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    if result.get("command"):
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def _tier_rows(bench: dict, heading: bool = True) -> list[str]:
    """The GPU tier's rows (kvgate.harness.bench.gpu_live: measure_tier, or measure with the tier)."""
    rows = [r for r in bench["rows"] if "gpu_tier_hit_ttft_ms" in r]
    lines = (["## The GPU tier, live (TTFT)", "", bench.get("model", ""), "", bench.get("gpu_tier", ""), ""]
             if heading else ["### The GPU tier", "", bench.get("gpu_tier", ""), ""])
    if bench.get("tier_settings"):
        lines += [f"Tier replicas' settings: `{bench['tier_settings']}`", ""]
    lines += [*table(("prefix tokens", "tier hit ms", "its local hit ms", "tier / local", "tier, sync loads ms",
                      "its local hit ms", "sync / local", "OffloadingConnector CPU hit ms", "tier / peer",
                      "sync / peer", "local / peer", "blocks loaded"),
                     [(r["prefix_tokens"], r["gpu_tier_hit_ttft_ms"], r["gpu_tier_local_hit_ttft_ms"],
                       r["gpu_tier_remote_vs_local"], r.get("gpu_tier_sync_hit_ttft_ms", "-"),
                       r.get("gpu_tier_sync_local_hit_ttft_ms", "-"), r.get("gpu_tier_sync_remote_vs_local", "-"),
                       r["peer_hit_ttft_ms"], r["gpu_tier_vs_peer"], r.get("gpu_tier_sync_vs_peer", "-"),
                       r.get("gpu_tier_local_vs_peer", "-"),
                       f"{r['gpu_tier_blocks_loaded']}/{r['gpu_tier_blocks_expected']}"
                       + (f", {r['gpu_tier_sync_blocks_loaded']}/{r['gpu_tier_sync_blocks_expected']}"
                          if "gpu_tier_sync_blocks_loaded" in r else "")) for r in rows]), ""]
    installs = [f"{r['prefix_tokens']}: " + ", ".join(
        f"{label} {r[f'gpu_tier_{m}direct_loads']} direct / {r[f'gpu_tier_{m}staged_loads']} staged"
        for m, label in (("", "tier"), ("sync_", "sync")) if f"gpu_tier_{m}direct_loads" in r)
        for r in rows if "gpu_tier_direct_loads" in r]
    if installs:  # a busy engine's load stages although the direct install is set
        lines += ["Installs of the tier's loads (per prefix): " + "; ".join(installs) + ".", ""]
    for key, met in sorted(bench.get("targets", {}).items()):
        if key.startswith("gpu_tier"):
            lines.append(f"- [{'x' if met else ' '}] {key.replace('_', ' ')} ({'met' if met else 'NOT met'})")
    return lines + [""]
