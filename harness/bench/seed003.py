"""`kvgate bench seed003`: seed 003's experiment at its own scale, side by side with its figures.

The seed (shared/seeds/003_13ba88f9229fb28c.txt) reports, for two single-GPU 27B vLLM
replicas sharing a host pool: median cross-replica time to first token from 31.715 s to
0.605 s at 128k input and from 92.047 s to 0.790 s at 256k (a four-block OFF-ON-ON-OFF
comparison); six-turn sessions alternating replicas about 35% better at 32k and 45% at
128k; a fixed-placement control with little benefit. This bench runs that experiment:

Model: a named public architecture (kvgate.fixtures.arch_model; default "mistral-small-24b", the
text decoder of Mistral Small 3.1 24B: 40 layers, 8 KV heads of 128, 160 KiB of bf16 KV per
token, 23.6 B parameters, full attention in every layer so one KV-cache group) with vLLM's
dummy weights (--load-format dummy: both replicas hold the same weights from one fixed seed).
Replicas A and B run at the same time on the one GPU (vLLM 0.24, TRITON_ATTN, eager), each
with an explicit KV cache (`kv_bytes`), both on one kvpool pool in host memory. Two bf16
replicas (43.9 GiB of weights each) leave room for 20 GiB of KV each (128k tokens); at 256k
(40 GiB of KV each) they fit only with `quantization="fp8"` (vLLM's online quantization of
the dummy weights as they load: the linear layers' weights in fp8, the KV cache still bf16).
A plan longer than the published model's positions (131072) runs with the positions raised
to the next power of two (RoPE unchanged), said in the result. The weights each replica
loaded, its KV cache and the GPU's memory in use are read back after the start (`memory`).

Parts, in this order, while time is left (a part that would not finish is not started and
is reported "not run"; not run is never a pass):
  ttft <n>        the four blocks OFF, ON, ON, OFF at prompt length n, `reps` prompts per block
                  (the same prompts in every block, each block under its own cache_salt):
                  OFF: B computes the prompt cold (pool neither read nor written);
                  ON:  A computes and publishes it (its TTFT is kept as the producer's), then B
                       serves it: the cross-replica hit, measured after a primer request;
                  the median TTFT of the OFF and of the ON measurements with their spread (min,
                  max, every value, each block's median); the ON hit's phases
                  (kvgate.harness.bench.live.remote_phases: where its time goes); the host-to-device
                  floor of the prefix's bytes at the pinned copy rate measured in this run.
  sessions <n>    kvgate.harness.scenarios.gpu_live.run_session_blocks: six-turn sessions whose turns
                  alternate A and B, OFF-ON-ON-OFF, initial context n.
  control <n>     the same with fixed placement (router "sticky": a session stays on one replica).

Oracles on every hit (a failure fails the run, exit 1):
  * bytes: kvpool checks every page it loads over the bytes that arrived in B's GPU memory
    against the digest A committed from its own KV (kvpool.gpu.transfer: kv-sketch-1); a page
    that differs is not installed and the load reports it. Each ON hit must have loaded every
    block of its prompt before the last token ((n - 1) // 16) with no miss.
  * output: B's hit and A's own prefix-cache hit of the same prompt (the same prefill
    partition: the cached blocks, then the tail computed) give the same tokens and the same
    log-probabilities to the last bit; and A's cold prefill of the prompt (ON) gives B's cold
    tokens of it (OFF): the replicas hold the same weights.
  * sessions: every turn of the two OFF blocks, and of the two ON blocks, gives the same
    tokens (the same path twice); in ON blocks a session's first turn on the other replica
    loaded the context from the pool; no turn errored and every publish landed. Tokens OFF against ON are reported, not judged: with
    dummy weights the last-token logits are near ties, and a hit computes the tail in a
    smaller partition than a cold prefill does.
Not checked: the published weights' numerics (these are dummy weights), and bytes beyond
what the connector's page digests cover (the audit wrapper's host digests would add seconds
to a 128k hit, so the timed replicas run without it).

  run(report_dir, ...) -> int    writes result.json and seed003.md after every part; the last
                                 line printed is the result as one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.fixtures.arch_model import ARCHS, Arch, write_arch

if TYPE_CHECKING:  # the harness's live parts are imported where they run (the CLI imports this module)
    from kvgate.harness.system.cluster import Cluster
    from kvgate.harness.workload.prompts import Corpus

BLOCK_SIZE = 16  # kvgate.harness.system.gpu.BLOCK_SIZE: the engine's block of tokens (and the pool page's) on CUDA
CPU_BLOCK_SIZE = 128  # vLLM's CPU attention takes multiples of 32; the CPU clusters' default

# The seed's figures (shared/seeds/003_13ba88f9229fb28c.txt).
PAPER = {
    "ttft_off_s": {131072: 31.715, 262144: 92.047},
    "ttft_on_s": {131072: 0.605, 262144: 0.790},
    "session_improvement": {32768: 0.35, 131072: 0.45},
    "control": "little benefit (no figure)",
}
PAPER_LENGTH = {128000: 131072, 131072: 131072, 256000: 262144, 262144: 262144}  # our n -> the seed's "128k"/"256k"

CHUNK = 8192  # max_num_batched_tokens: a cold prompt prefills in chunks of this many tokens
ORACLE_TOKENS = 8  # tokens generated per measured request (TTFT is the first)
MEMORY_UTILIZATION = 0.05  # vLLM's start check only (free memory >= this share); the KV size is explicit
SESSION_TURNS = 6


class Seed003Error(RuntimeError):
    """A step of the bench could not run (a publish never landed, too little memory)."""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Plan:
    arch: str = "mistral-small-24b"
    ttft_lengths: tuple[int, ...] = (32768, 128000)
    ttft_reps: tuple[int, ...] = (3, 1)  # prompts per block, per length
    session_contexts: tuple[int, ...] = (32768, 128000)
    sessions: tuple[int, ...] = (2, 1)  # sessions per block, per context
    control_contexts: tuple[int, ...] = (32768, 128000)
    kv_bytes: int = 20 << 30  # per replica: 8192 blocks of 16 tokens at 160 KiB per token
    pool_bytes: int = 28 << 30
    seed: int = 3
    deadline_s: float = 1500.0
    order: tuple[str, ...] = ("ttft:0", "ttft:1", "sessions:0", "control:0", "sessions:1", "control:1")
    # the TTFT part's blocks in order: "off" (a cold prefill on B) or "on" (A prefills and
    # publishes, B loads); the seed's comparison is OFF, ON, ON, OFF; ("on",) measures a hit
    # alone, at a quarter of the prefills, when the cold figure is known from an earlier run
    ttft_blocks: tuple[str, ...] = ("off", "on", "on", "off")
    quantization: str = ""  # "" (the bf16 dummy weights) or "fp8" (vLLM's online quantization of them)
    # (n, seconds): cold prefills of n tokens measured by an earlier run of the same build, for
    # the time estimates of lengths this run has not measured itself
    prior_cold_s: tuple[tuple[int, float], ...] = ()

    def max_len(self) -> int:
        from kvgate.harness.scenarios.gpu_live import (
            SESSION_CHUNK,  # the warm-up's prompts are a chunk and 1000 tokens
        )

        longest = max((*self.ttft_lengths, *self.session_contexts, *self.control_contexts, SESSION_CHUNK + 2048))
        return longest + SESSION_TURNS * (64 + 16) + 2 * BLOCK_SIZE


def with_positions(arch: Arch, plan: Plan) -> tuple[Arch, str]:
    """The architecture with room for the plan's longest request, and a note when that is more
    than the published positions: then the next power of two (RoPE base unchanged; the
    weights are dummy, so nothing learned is stretched)."""
    need = plan.max_len()
    if need <= arch.max_position_embeddings:
        return arch, ""
    wider = dataclasses.replace(arch, max_position_embeddings=1 << (need - 1).bit_length())
    return wider, (f"positions raised from the published {arch.max_position_embeddings} to "
                   f"{wider.max_position_embeddings} for requests of up to {need} tokens (RoPE base unchanged)")


def weights_text(arch: Arch, plan: Plan) -> str:
    bf16 = 2 * arch.parameters / 2**30
    if plan.quantization == "fp8":
        return (f"fp8 weights (vLLM's online quantization, --quantization fp8, of the dummy weights as they "
                f"load; {bf16:.1f} GiB in bf16; the KV cache bf16)")
    if plan.quantization:
        return f"{plan.quantization} weights (vLLM's online quantization of the dummy weights)"
    return f"the bf16 dummy weights ({bf16:.1f} GiB)"


def not_256k_text(arch: Arch) -> str:
    kv = 256000 * arch.kv_bytes_per_token / 2**30
    w = 2 * arch.parameters / 2**30
    return (f"two bf16 replicas of this geometry at 256k need {kv:.0f} GiB of KV each beside {w:.1f} GiB of "
            f"weights each ({2 * (kv + w):.0f} GiB): more than one H200 holds with both resident; with fp8 "
            f"weights they fit (--quantization fp8 --kv-gib 40 --pool-gib 40 --lengths 256000)")


_MEMORY_LINES = {
    "weights_gib": re.compile(r"Model loading took ([0-9.]+) GiB"),
    "initial_free_gib": re.compile(r"Initial free memory ([0-9.]+) GiB"),
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([0-9,]+) tokens"),
}


def replica_memory(log_text: str) -> dict:
    """What a vLLM replica's log says of its memory: the weights it loaded (GiB), the free
    memory it found (GiB) and its KV cache (tokens); a figure the log lacks is None."""
    out: dict = {}
    for key, rx in _MEMORY_LINES.items():
        found = rx.findall(log_text)
        out[key] = None if not found else (int(found[-1].replace(",", "")) if key == "kv_cache_tokens"
                                           else float(found[-1]))
    return out


def gpu_memory() -> dict | None:
    """The GPU's memory in use and in all (MiB) by nvidia-smi; None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True)
        used, total = (int(x) for x in out.stdout.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return {"used_mib": used, "total_mib": total}


def memory_report(cluster: Cluster) -> dict:
    reps = {}
    for name, rep in cluster.replicas.items():
        try:
            reps[name] = replica_memory(rep.log_path.read_text(errors="replace"))
        except OSError as exc:
            reps[name] = {"error": str(exc)}
    return {"replicas": reps, "gpu": gpu_memory()}


def memory_line(memory: dict) -> str:
    """A run's `memory` (the replicas' logs and nvidia-smi after the warm-up) in one line."""
    parts = []
    for name, m in sorted(memory.get("replicas", {}).items()):
        if "error" in m:
            parts.append(f"{name}: {m['error']}")
            continue
        parts.append(f"{name}: weights {m.get('weights_gib')} GiB, KV cache {m.get('kv_cache_tokens')} tokens, "
                     f"free at its start {m.get('initial_free_gib')} GiB")
    gpu = memory.get("gpu")
    if gpu:
        parts.append(f"GPU memory in use {gpu['used_mib'] / 1024:.1f} of {gpu['total_mib'] / 1024:.1f} GiB")
    return "; ".join(parts)


def probe() -> dict:
    """The environment (GPU, vLLM, torch, provenance: kvgate.harness.scenarios.gpu_live.environment) and
    the host-to-device floor's rate (a plain pinned copy of 1 GiB, None without CUDA), in a
    child process, so the bench's own process holds no CUDA context beside the replicas."""
    code = ("import json, torch; from kvgate.harness.scenarios.gpu_live import environment; "
            "from kvgate.harness.bench.gpu_live import pinned_h2d_GBps as f; "
            "print(json.dumps({'env': environment(), 'h2d': f() if torch.cuda.is_available() else None}, "
            "default=str))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise Seed003Error(f"the environment probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def start(report_dir: Path, arch: Arch, plan: Plan, cuda: bool, block: int) -> Cluster:
    from kvgate.harness.system.cluster import Cluster, ReplicaSpec
    from kvgate.harness.system.gpu import gpu_args
    from kvgate.harness.system.pool import PRODUCTION_TTL_ARGS
    model = write_arch(report_dir / "model", arch)
    page = arch.kv_bytes_per_token * block
    pool_bytes = plan.pool_bytes
    need = max((*plan.ttft_lengths, *plan.session_contexts, *plan.control_contexts), default=0) * arch.kv_bytes_per_token
    if pool_bytes < need:
        raise Seed003Error(f"a pool of {pool_bytes / 2**30:.1f} GiB cannot hold the longest prompt's KV "
                           f"({need / 2**30:.1f} GiB)")
    extra = (*(gpu_args(MEMORY_UTILIZATION, block) if cuda else ("--block-size", str(block))),
             "--load-format", "dummy", "--max-num-seqs", "4",
             *(("--quantization", plan.quantization) if plan.quantization else ()))
    specs = [ReplicaSpec(name, core=str(i), kv_bytes=plan.kv_bytes, max_model_len=plan.max_len(),
                         max_num_batched_tokens=CHUNK, extra_args=extra)
             for i, name in enumerate(("A", "B"))]
    # The production TTLs, named: a 256k prompt's chunks take ~17 s each, so a publish outlives
    # the 30 s reservation TTL only by renewing (kvpool.gpu.store); the bench must see that.
    cluster = Cluster(model, report_dir, page_size=page, pool_pages=pool_bytes // page,
                      pool_args=PRODUCTION_TTL_ARGS)
    t0 = time.monotonic()
    cluster.start(specs, timeout=600.0)
    _say(f"bench seed003: replicas A, B of {arch.name} up after {time.monotonic() - t0:.0f} s "
         f"(pool {pool_bytes / 2**30:.1f} GiB, KV {plan.kv_bytes / 2**30:.1f} GiB each)")
    return cluster


def _stats(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0, "all": []}
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1), "n": len(values), "all": [round(v, 1) for v in values]}


def producer_against_cold(rows: list[dict]) -> list[bool]:
    """Per ON row whose prompt an OFF block also ran on B (the first OFF block's), whether A's
    cold tokens (the producer's) equal B's: the replicas hold the same weights. A plan without
    an OFF block compares nothing."""
    first_off = next((r["block"] for r in rows if r["block"].endswith(":off")), None)
    cold_tokens = {r["rep"]: r["tokens"] for r in rows if r["block"] == first_off}
    return [r["producer_tokens"] == cold_tokens[r["rep"]] for r in rows
            if "producer_tokens" in r and r["rep"] in cold_tokens]


def ttft_blocks(cluster: Cluster, corpus: Corpus, n: int, reps: int, seed: int, h2d_GBps: float | None,
                kv_per_token: int, block: int = BLOCK_SIZE, rows_log: Path | None = None,
                blocks: tuple[str, ...] = ("off", "on", "on", "off")) -> dict:
    """The cross-replica TTFT at prompt length n (tokens, BOS included) over `blocks` (the
    seed's four, OFF ON ON OFF, unless told otherwise); each row is also appended to
    `rows_log` (JSON lines) as it is measured."""
    from kvgate.harness.bench.live import median_phases, primer, remote_phases
    from kvgate.harness.checkers.history import records
    from kvgate.harness.client import http
    from kvgate.harness.client.http import complete
    from kvgate.harness.scenarios.gpu_live import publish_outcome, wait_published

    http.RECORDER = cluster.history
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    hist = cluster.history_dir
    rng = random.Random(f"seed003:{seed}:ttft:{n}")
    prompts = [corpus.text(n - 1, rng) for _ in range(reps)]
    prime = primer(corpus, rng)
    want = (n - 1) // block
    rows: list[dict] = []
    t_part = time.monotonic()
    for i, on in enumerate(b == "on" for b in blocks):
        label = f"{i}:{'on' if on else 'off'}"
        salt = f"seed003-{seed}-ttft-{n}-{i}"
        for j, prompt in enumerate(prompts):
            tag = f"x{n}-{i}-r{j}"
            row: dict = {"block": label, "rep": j}
            if on:
                pub = complete(A, prompt, tag=f"{tag}-pub", replica="A", max_tokens=ORACLE_TOKENS, load=False,
                               cache_salt=salt)
                t_pub = time.monotonic()
                published = publish_outcome(wait_published(hist, "A", f"{tag}-pub", n // block, timeout_s=300))
                row.update(producer_ttft_ms=round(pub.ttft_s * 1e3, 1), producer_tokens=pub.token_ids,
                           producer_error=pub.error, publish_landed_after_response_s=round(time.monotonic() - t_pub, 3),
                           publish=published)
                prime(B, "B")
                sent = time.time()  # the history's clock
                hit = complete(B, prompt, tag=tag, replica="B", max_tokens=ORACLE_TOKENS, publish=False,
                               cache_salt=salt)
                phases = remote_phases(hist, tag, sent, hit.ttft_s)
                loads = records(hist, "load", replica="B", tag=tag)
                looks = records(hist, "lookup", replica="B", tag=tag)
                # A's own prefix-cache hit of the same prompt: the same partition as B's hit
                local = complete(A, prompt, tag=f"{tag}-local", replica="A", max_tokens=ORACLE_TOKENS, load=False,
                                 publish=False, cache_salt=salt)
                loaded = sum(int(r["loaded"]) for r in loads)
                misses = [r["miss_cause"] for r in loads if r.get("miss_cause")]
                row.update(ttft_ms=round(hit.ttft_s * 1e3, 1), tokens=hit.token_ids, error=hit.error,
                           phases_ms={k: round(v, 1) for k, v in phases.items()} if phases else None,
                           lookup=[{k: r.get(k) for k in ("outcome", "hit_blocks", "via", "miss_cause")}
                                   for r in looks],
                           blocks_loaded=loaded, blocks_expected=want, load_misses=misses,
                           local_hit_ttft_ms=round(local.ttft_s * 1e3, 1), local_hit_tokens=local.token_ids,
                           output_equal_local_hit=hit.same_output(local) and len(hit.token_ids) == ORACLE_TOKENS,
                           bytes_ok=loaded == want and not misses)
            else:
                prime(B, "B")
                cold = complete(B, prompt, tag=tag, replica="B", max_tokens=ORACLE_TOKENS, load=False, publish=False,
                                cache_salt=salt)
                row.update(ttft_ms=round(cold.ttft_s * 1e3, 1), tokens=cold.token_ids, error=cold.error)
            rows.append(row)
            if rows_log is not None:  # a long part's rows survive a run that ends inside it
                with rows_log.open("a") as f:
                    f.write(json.dumps({"part": f"ttft:{n}", **row}, default=str) + "\n")
            _say(f"  ttft {n}: block {label} rep {j}: {row['ttft_ms']:.0f} ms"
                 + (f" (producer {row['producer_ttft_ms']:.0f} ms, published {row['publish']['landed']}/"
                    f"{row['publish']['offered']} landed, loaded {row['blocks_loaded']}/{want}, output "
                    f"equal {row['output_equal_local_hit']})" if on else ""))
    off = [r["ttft_ms"] for r in rows if r["block"].endswith("off")]
    on_ = [r["ttft_ms"] for r in rows if r["block"].endswith(":on")]
    across = producer_against_cold(rows)
    out = {
        "prompt_tokens": n, "reps_per_block": reps, "kv_bytes": n * kv_per_token, "blocks": list(blocks),
        "off_ms": _stats(off), "on_ms": _stats(on_),
        "producer_cold_ms": _stats([r["producer_ttft_ms"] for r in rows if "producer_ttft_ms" in r]),
        "block_medians_ms": {b: round(statistics.median(r["ttft_ms"] for r in rows if r["block"] == b), 1)
                             for b in dict.fromkeys(r["block"] for r in rows)},
        "reduction": round(1 - statistics.median(on_) / statistics.median(off), 4) if off and on_ else None,
        "on_phases_ms": median_phases([r["phases_ms"] for r in rows if r.get("phases_ms")])
        if any(r.get("phases_ms") for r in rows) else None,
        "oracles": {
            "hits": len(on_),
            "hits_bytes_ok": sum(1 for r in rows if r.get("bytes_ok")),
            "publishes_short": [{"block": r["block"], "rep": r["rep"], **r["publish"]} for r in rows
                                if "publish" in r and r["publish"]["landed"] < n // block],
            "hits_output_equal_local_hit": sum(1 for r in rows if r.get("output_equal_local_hit")),
            "producer_cold_tokens_equal_B_cold": sum(across), "compared_cold": len(across),
            "errors": [r["error"] for r in rows if r.get("error")] + [r["producer_error"] for r in rows
                                                                       if r.get("producer_error")],
        },
        "wall_s": round(time.monotonic() - t_part, 1),
        "rows": rows,
    }
    if h2d_GBps:
        out["h2d_floor_ms"] = round(n * kv_per_token / (h2d_GBps * 1e9) * 1e3, 1)
        if out["on_ms"]["median"]:
            out["on_vs_floor"] = round(out["on_ms"]["median"] / out["h2d_floor_ms"], 3)
    return out


def session_part(cluster: Cluster, corpus: Corpus, n: int, sessions: int, seed: int, router: str,
                 block: int = BLOCK_SIZE) -> dict:
    """OFF-ON-ON-OFF six-turn sessions at initial context n (kvgate.harness.scenarios.gpu_live), with
    this bench's oracles on the turns."""
    from kvgate.harness.scenarios.gpu_live import run_session_blocks

    t0 = time.monotonic()
    label = f"{'alt' if router == 'alternating' else 'fix'}{n}"
    out = run_session_blocks(cluster, corpus, seed, context_tokens=n, sessions=sessions, turns=SESSION_TURNS,
                             router=router, label=label, block_size=block)
    turns = out["turns_detail"]

    def pair(a: str, b: str) -> list[str]:
        ta = {(r["session"], r["turn"]): r["tokens"] for r in turns if r["block"] == a}
        tb = {(r["session"], r["turn"]): r["tokens"] for r in turns if r["block"] == b}
        return [f"s{s}-t{t}" for (s, t) in sorted(ta) if ta[(s, t)] != tb.get((s, t))]

    sums = {b: [sum(r["ttft_ms"] for r in turns if r["block"] == b and r["session"] == s) for s in range(sessions)]
            for b in ("0:off", "1:on", "2:on", "3:off")}
    off_sums = sums["0:off"] + sums["3:off"]
    on_sums = sums["1:on"] + sums["2:on"]
    cross_on = [r for r in turns if r["block"].endswith(":on") and r["cross"]]
    out.update(
        wall_s=round(time.monotonic() - t0, 1),
        session_ttft_sum_ms={"off": _stats(off_sums), "on": _stats(on_sums), "by_block": sums},
        improvement=round(1 - statistics.median(on_sums) / statistics.median(off_sums), 4),
        cross_turn_ttft_ms={"off": _stats([r["ttft_ms"] for r in turns if r["block"].endswith("off") and r["cross"]]),
                            "on": _stats([r["ttft_ms"] for r in cross_on])},
        oracles={"off_blocks_differ": pair("0:off", "3:off"), "on_blocks_differ": pair("1:on", "2:on"),
                 "off_vs_on_differ_reported": pair("0:off", "1:on"),
                 "cross_on_turns": len(cross_on),
                 # a session's first turn on the other replica must load the context the first
                 # computed; a later one may find nothing new in the pool beyond its own prefix cache
                 "cross_on_turns_without_remote_blocks": [f"s{r['session']}-t{r['turn']}" for r in cross_on
                                                          if not r["remote_hit_blocks"] and r["turn"] == 1],
                 "later_cross_on_turns_loading_nothing": [f"s{r['session']}-t{r['turn']}" for r in cross_on
                                                          if not r["remote_hit_blocks"] and r["turn"] > 1],
                 "errors": [r["error"] for r in turns if r["error"]],
                 "settle_timeouts": sum(1 for r in turns if r.get("timed_out"))},
    )
    _say(f"  {router} sessions {n}: session TTFT sum OFF {out['session_ttft_sum_ms']['off']['median']} ms, ON "
         f"{out['session_ttft_sum_ms']['on']['median']} ms: improvement {out['improvement']}")
    return out


def failures(result: dict, plan: Plan) -> list[str]:
    out: list[str] = []
    for key, part in result.get("parts", {}).items():
        if "not_run" in part:
            out.append(f"{key}: not run ({part['not_run']})")
            continue
        if "error" in part:
            out.append(f"{key}: raised: {part['error'].strip().splitlines()[-1][:300]}")
            continue
        o = part["oracles"]
        if key.startswith("ttft"):
            for short in o.get("publishes_short", []):
                out.append(f"{key}: block {short['block']} rep {short['rep']}: A's publish landed {short['landed']} of "
                           f"{short['offered']} blocks (no capacity {short['no_capacity']}, not admitted "
                           f"{short['not_admitted']}, rejected {short['rejected']}, errors {short['errors'][:2]})")
            if o["hits_bytes_ok"] < o["hits"]:
                out.append(f"{key}: {o['hits'] - o['hits_bytes_ok']} of {o['hits']} hits did not load every block")
            if o["hits_output_equal_local_hit"] < o["hits"]:
                out.append(f"{key}: {o['hits'] - o['hits_output_equal_local_hit']} of {o['hits']} hits gave other "
                           f"tokens or log-probabilities than the producer's own prefix hit")
            if o["producer_cold_tokens_equal_B_cold"] < o["compared_cold"]:
                out.append(f"{key}: A's cold tokens differ from B's for {o['compared_cold'] - o['producer_cold_tokens_equal_B_cold']} "
                           f"prompts (the replicas do not hold the same weights)")
        else:
            for k in ("off_blocks_differ", "on_blocks_differ", "errors"):
                if o[k]:
                    out.append(f"{key}: {k.replace('_', ' ')}: {o[k][:6]}")
            if o["settle_timeouts"]:
                out.append(f"{key}: {o['settle_timeouts']} publishes never landed")
            if key.startswith("sessions") and o["cross_on_turns_without_remote_blocks"]:
                out.append(f"{key}: ON turns on the other replica loaded nothing: "
                           f"{o['cross_on_turns_without_remote_blocks'][:6]}")
        if o.get("errors") and key.startswith("ttft"):
            out.append(f"{key}: {len(o['errors'])} requests errored ({str(o['errors'][0])[:200]})")
    if result.get("error"):
        out.append("the bench raised: " + result["error"].strip().splitlines()[-1][:300])
    if not result.get("parts"):
        out.append("no part ran")
    return out


def _why_not(part: dict) -> str:
    if "not_run" not in part:
        return "raised"
    return part["not_run"] + (f" ({part['estimate']})" if part.get("estimate") else "")


NO_FIGURE = "no figure"


def h2d_floor_ms(n: int, result: dict) -> float | None:
    """n tokens' KV at the run's pinned host-to-device rate (ms); None without the rate."""
    rate, kv = result.get("pinned_h2d_GBps"), result.get("arch", {}).get("kv_bytes_per_token")
    if not isinstance(rate, (int, float)) or not rate or not kv:
        return None
    return round(n * kv / (rate * 1e9) * 1e3, 1)


def side_by_side(result: dict) -> list[dict]:
    """The seed's table next to kvgate's: per row the paper's figure, kvgate's, their ratio
    (kvgate / paper) and the host-to-device floor where one applies."""
    rows: list[dict] = []
    parts = result.get("parts", {})
    for key, part in parts.items():
        if not key.startswith("ttft"):
            continue
        n = int(key.split(":")[1])
        paper_n = PAPER_LENGTH.get(n)
        label = f"{n} tokens" + (f" (the seed's {paper_n // 1024}k)" if paper_n else "")
        if "not_run" in part or "error" in part:
            rows.append({"row": f"cross-replica TTFT OFF -> ON, {label}", "kvgate": "not run", "part": key,
                         "paper": f"{PAPER['ttft_off_s'][paper_n]} -> {PAPER['ttft_on_s'][paper_n]}" if paper_n
                         else None, "spread": _why_not(part)})
            continue
        floor_s = round(part["h2d_floor_ms"] / 1e3, 3) if "h2d_floor_ms" in part else None
        for what, k in (("OFF (cold prefill on B)", "ttft_off_s"), ("ON (B loads A's KV)", "ttft_on_s")):
            st = part["off_ms" if k == "ttft_off_s" else "on_ms"]
            paper = PAPER[k].get(paper_n) if paper_n else None
            ours = st["median"] / 1e3 if st["median"] is not None else None
            rows.append({"row": f"cross-replica TTFT {what}, {label}", "unit": "s", "part": key,
                         "paper": paper if paper else NO_FIGURE,
                         "kvgate": round(ours, 3) if ours is not None else None,
                         "spread": f"{st['min'] / 1e3:.3f}-{st['max'] / 1e3:.3f} (n={st['n']})" if st["n"] else
                         f"no {'OFF' if k == 'ttft_off_s' else 'ON'} block in this run (blocks "
                         f"{','.join(part.get('blocks', []))})",
                         "ratio": round(ours / paper, 3) if paper and ours else "n/a",
                         "floor": floor_s if k == "ttft_on_s" else "no load (a cold prefill)"})
        paper_red = (1 - PAPER["ttft_on_s"][paper_n] / PAPER["ttft_off_s"][paper_n]) if paper_n else None
        off_s = part["off_ms"]["median"] / 1e3 if part["off_ms"]["median"] else None
        rows.append({"row": f"cross-replica TTFT reduction, {label}", "unit": "", "part": key,
                     "paper": round(paper_red, 4) if paper_red else NO_FIGURE, "kvgate": part["reduction"],
                     "spread": "from the two medians above",
                     "ratio": round(part["reduction"] / paper_red, 3) if paper_red and part["reduction"] else "n/a",
                     "floor": f"{1 - floor_s / off_s:.4f} (ON at the floor)" if floor_s and off_s else None})
    if not any(PAPER_LENGTH.get(int(k.split(":")[1])) == 262144 for k in parts if k.startswith("ttft:")):
        rows.append({"row": "cross-replica TTFT OFF -> ON, 256k", "unit": "s",
                     "paper": f"{PAPER['ttft_off_s'][262144]} -> {PAPER['ttft_on_s'][262144]}",
                     "kvgate": "not run", "spread": result.get("not_256k", "")})
    for key, part in parts.items():
        if not key.startswith(("sessions", "control")):
            continue
        n = int(key.split(":")[1])
        paper_n = PAPER_LENGTH.get(n, n)
        what = "six-turn sessions alternating replicas" if key.startswith("sessions") else \
            "fixed-placement control (sessions stay on one replica)"
        paper = PAPER["session_improvement"].get(paper_n) if key.startswith("sessions") else PAPER["control"]
        if "not_run" in part or "error" in part:
            rows.append({"row": f"{what}, {n}-token context", "kvgate": "not run", "part": key, "paper": paper,
                         "spread": _why_not(part)})
            continue
        st = part["session_ttft_sum_ms"]
        if key.startswith("control"):
            floor: object = "no load (a session stays on one replica)"
        else:
            fl = part.get("h2d_floor_ms") or h2d_floor_ms(n, result)
            cross = (part.get("cross_turn_ttft_ms") or {}).get("on", {}).get("median")
            floor = None if fl is None else (f"{fl / 1e3:.3f} s a load of the context"
                                             + (f" (ON turns on the other replica: median {cross / 1e3:.3f} s)"
                                                if cross else ""))
        rows.append({"row": f"{what}, {n}-token context: improvement of the session's summed TTFT (ON vs OFF)",
                     "unit": "", "paper": paper, "kvgate": part["improvement"], "part": key,
                     "spread": f"OFF {st['off']['min'] / 1e3:.2f}-{st['off']['max'] / 1e3:.2f} s, ON "
                               f"{st['on']['min'] / 1e3:.2f}-{st['on']['max'] / 1e3:.2f} s (n={st['on']['n']})",
                     "ratio": round(part["improvement"] / paper, 3) if isinstance(paper, float) else "n/a",
                     "floor": floor})
    return rows


def render_markdown(result: dict, sources: dict[str, str] | None = None) -> str:
    """The report as Markdown; `sources`: part -> the run it comes from (a column of its own)."""
    from kvgate.harness.provenance import title_flag

    sources = sources or {}
    env = result.get("env", {})
    arch = result.get("arch", {})
    lines = [f"# Seed 003 at its own scale{title_flag(env.get('provenance', {}))}", "",
             f"{env.get('gpu', 'no GPU')}; vLLM {env.get('vllm')}, torch {env.get('torch')}; commit "
             f"{env.get('provenance', {}).get('short', '?')} (clean: {env.get('provenance', {}).get('clean')})", "",
             f"Model: {arch.get('source')} geometry ({arch.get('layers')} layers, hidden {arch.get('hidden')}, "
             f"{arch.get('heads')} heads, {arch.get('kv_heads')} KV heads of {arch.get('head_dim')}, MLP "
             f"{arch.get('intermediate')}, vocab {arch.get('vocab')}; {arch.get('parameters', 0) / 1e9:.1f} B "
             f"parameters; {arch.get('kv_bytes_per_token', 0) // 1024} KiB of KV per token; "
             f"{arch.get('kv_cache_groups')} KV-cache group), vLLM dummy weights. {result.get('placement', '')}", "",
             f"Host-to-device floor: the prefix's bytes at a plain pinned copy's rate, "
             f"{result.get('pinned_h2d_GBps')} GB/s, measured in the same run as the row.", "",
             *([f"Memory after the warm-up: {memory_line(result['memory'])}.", ""] if result.get("memory") else []),
             "| row | paper | kvgate (median) | spread | kvgate / paper | host-to-device floor |"
             + (" run |" if sources else ""),
             "|---|---|---|---|---|---|" + ("---|" if sources else "")]

    def f(v: object) -> str:
        return "" if v is None else str(v)

    for r in result.get("table", []):
        lines.append(f"| {r['row']} | {f(r.get('paper'))} | {f(r.get('kvgate'))} | {f(r.get('spread'))} | "
                     f"{f(r.get('ratio'))} | {f(r.get('floor'))} |" + (f" {sources.get(r.get('part'), '')} |"
                                                                        if sources else ""))
    lines.append("")
    for key, part in result.get("parts", {}).items():
        if key.startswith("ttft") and part.get("on_phases_ms"):
            local = [r["local_hit_ttft_ms"] for r in part.get("rows", []) if "local_hit_ttft_ms" in r]
            lines.append(f"- {key}: where the ON hit's TTFT goes (medians, ms): "
                         + ", ".join(f"{k} {v}" for k, v in part["on_phases_ms"].items())
                         + f"; the producer's own prefix-cache hit of the same prompt "
                           f"{round(statistics.median(local), 1) if local else None} ms; the producer's cold "
                           f"prefill (with publishing) {part['producer_cold_ms']['median']} ms")
    lines += ["", f"## Overall: {'PASS' if not result.get('failures') else 'FAIL'}", ""]
    lines += [f"- {f}" for f in result.get("failures", [])] or ["- every oracle held on every hit"]
    if result.get("command"):
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def _write(report_dir: Path, result: dict) -> None:
    result["table"] = side_by_side(result)
    (report_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    (report_dir / "seed003.md").write_text(render_markdown(result))


def _estimate_s(kind: str, n: int, count: int, cold_s: dict[int, float],
                prior: dict[int, float] | None = None, ttft_blocks: int = 4) -> tuple[float, str]:
    """Seconds a part is expected to take and how that was reckoned, from the cold prefills
    measured so far in this run, else those `prior` (an earlier run of the same build)
    gives: prefill grows faster than linearly with n, so scaled by (n / n0)^1.6 from the
    nearest shorter one. No figure at all: 0 (the part runs)."""
    for source, figures in (("this run", cold_s), ("an earlier run", prior or {})):
        if not figures:
            continue
        n0 = n if n in figures else max((k for k in figures if k <= n), default=min(figures))
        c = figures[n0] * (n / n0) ** 1.6
        per = {"ttft": ttft_blocks * count, "sessions": 6 * count, "control": 4 * count}[kind]
        scaled = "" if n0 == n else f" scaled by ({n}/{n0})^1.6"
        return per * c * 1.15 + 10, (f"{per} cold prefills of about {c:.0f} s: {figures[n0]:.1f} s at {n0} tokens "
                                      f"measured in {source}{scaled}, plus 15%")
    return 0.0, "no cold prefill measured yet"


def run(report_dir: Path, plan: Plan = Plan(), command: str = "") -> int:
    from kvgate.harness.scenarios.gpu_live import warm_up_sessions
    from kvgate.harness.system import gpu
    from kvgate.harness.workload.prompts import Corpus
    from kvpool.pool.arena import memory_available

    if gpu.BLOCK_SIZE != BLOCK_SIZE:
        raise Seed003Error(f"the engine's block is {gpu.BLOCK_SIZE} tokens, this bench counts {BLOCK_SIZE}")

    t0 = time.monotonic()
    t_end = t0 + plan.deadline_s
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "rows.jsonl").unlink(missing_ok=True)  # this run's rows only, as result.json
    arch, positions_note = with_positions(ARCHS[plan.arch], plan)
    probed = probe()
    env, h2d = probed["env"], probed["h2d"]
    cuda = "gpu" in env
    block = BLOCK_SIZE if cuda else CPU_BLOCK_SIZE
    result: dict = {"plan": dataclasses.asdict(plan), "arch": {**arch.describe(), "positions": positions_note},
                    "env": env, "command": command,
                    "paper": {k: (v if isinstance(v, str) else {str(n): x for n, x in v.items()})
                              for k, v in PAPER.items()},
                    "placement": "Replicas A and B at the same time on the one GPU, each with "
                                 f"{plan.kv_bytes / 2**30:.0f} GiB of KV cache and {weights_text(arch, plan)}, on one "
                                 f"kvpool pool of {plan.pool_bytes / 2**30:.0f} GiB in host memory."
                                 + (f" The model's {positions_note}." if positions_note else ""),
                    "not_256k": not_256k_text(arch),
                    "parts": {}}
    result["pinned_h2d_GBps"] = round(h2d, 2) if h2d else None
    result["host_memory_available_gib"] = round(memory_available() / 2**30, 1)
    _write(report_dir, result)
    cluster = None
    try:
        cluster = start(report_dir / "run", arch, plan, cuda, block)
        corpus = Corpus(cluster.model_dir)
        warm_up_sessions(cluster, corpus, plan.seed, block)
        result["memory"] = memory_report(cluster)
        _say(f"bench seed003: warmed up after {time.monotonic() - t0:.0f} s; memory {json.dumps(result['memory'])}")
        _write(report_dir, result)
        cold_s: dict[int, float] = {}
        prior = dict(plan.prior_cold_s)
        for item in plan.order:
            kind, idx = item.split(":")
            i = int(idx)
            lengths = {"ttft": plan.ttft_lengths, "sessions": plan.session_contexts,
                       "control": plan.control_contexts}[kind]
            if i >= len(lengths):
                continue
            n = lengths[i]
            counts = plan.ttft_reps if kind == "ttft" else plan.sessions
            count = counts[min(i, len(counts) - 1)]
            key = f"{kind}:{n}"
            left = t_end - time.monotonic()
            est, basis = _estimate_s(kind, n, count, cold_s, prior, len(plan.ttft_blocks))
            if est > left:
                result["parts"][key] = {"not_run": f"about {est:.0f} s needed, {left:.0f} s left", "estimate": basis}
                _say(f"bench seed003: {key} not run: about {est:.0f} s needed, {left:.0f} s left")
                _write(report_dir, result)
                continue
            _say(f"bench seed003: {key} ({count} per block; about {est:.0f} s, {left:.0f} s left)")
            try:
                if kind == "ttft":
                    part = ttft_blocks(cluster, corpus, n, count, plan.seed, h2d, arch.kv_bytes_per_token, block,
                                       rows_log=report_dir / "rows.jsonl", blocks=plan.ttft_blocks)
                    # B's cold prefills, else A's (the producer's prefill is cold too)
                    cold_ms = part["off_ms"]["median"] or part["producer_cold_ms"]["median"]
                    if cold_ms:
                        cold_s[n] = cold_ms / 1e3
                else:
                    part = session_part(cluster, corpus, n, count, plan.seed,
                                        "alternating" if kind == "sessions" else "sticky", block)
            except Exception as exc:  # recorded in the result and the exit status; the next parts still run
                import traceback

                part = {"error": "".join(traceback.format_exception(exc))[-4000:]}
                _say(f"bench seed003: {key} raised:\n{part['error']}")
                if cluster.crashed():
                    result["parts"][key] = part
                    raise Seed003Error(f"processes ended: {cluster.crashed()}") from exc
            result["parts"][key] = part
            _write(report_dir, result)
    except Exception as exc:  # recorded in the result and the exit status
        import traceback

        result["error"] = "".join(traceback.format_exception(exc))[-4000:]
        _say(f"bench seed003: raised:\n{result['error']}")
    finally:
        if cluster is not None:
            try:
                cluster.stop()
            except Exception as exc:  # an orphan: recorded, fails the run
                result["error"] = (result.get("error") or "") + f"\nstop: {exc}"
    result["wall_s"] = round(time.monotonic() - t0)
    result["failures"] = failures(result, plan)
    result["ok"] = not result["failures"]
    _write(report_dir, result)
    print(json.dumps({k: v for k, v in result.items() if k != "parts"}, default=str))
    for f in result["failures"]:
        _say(f"bench seed003: FAIL: {f}")
    _say(f"bench seed003: {'PASS' if result['ok'] else 'FAIL'} after {result['wall_s']} s")
    return 0 if result["ok"] else 1


def plan_from_args(args) -> Plan:
    def ints(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.split(",") if x)

    def blocks(s: str) -> tuple[str, ...]:
        out = tuple(x for x in s.split(",") if x)
        if not out or any(x not in ("off", "on") for x in out):
            raise ValueError(f"--ttft-blocks takes off and on, comma-separated (e.g. off,on,on,off), not {s!r}")
        return out

    def colds(s: str) -> tuple[tuple[int, float], ...]:
        pairs = [x.split("=") for x in s.split(",") if x]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"--cold-s takes N=SECONDS[,N=SECONDS...], not {s!r}")
        return tuple((int(n), float(v)) for n, v in pairs)

    return Plan(arch=args.arch, ttft_lengths=ints(args.lengths), ttft_reps=ints(args.reps),
                session_contexts=ints(args.session_contexts), sessions=ints(args.sessions),
                control_contexts=ints(args.control_contexts), kv_bytes=int(args.kv_gib * 2**30),
                pool_bytes=int(args.pool_gib * 2**30), seed=args.seed, deadline_s=args.deadline,
                order=tuple(x for x in args.order.split(",") if x), quantization=args.quantization,
                prior_cold_s=colds(args.cold_s), ttft_blocks=blocks(args.ttft_blocks))


def add_arguments(p) -> None:
    d = Plan()
    p.add_argument("--arch", default=d.arch, choices=sorted(ARCHS), help="kvgate.fixtures.arch_model's architectures")
    p.add_argument("--lengths", default="32768,128000", help="prompt lengths of the four-block TTFT (tokens)")
    p.add_argument("--reps", default="3,1", help="prompts per block, per length")
    p.add_argument("--session-contexts", default="32768,128000")
    p.add_argument("--sessions", default="2,1", help="sessions per block, per context")
    p.add_argument("--control-contexts", default="32768,128000")
    p.add_argument("--order", default=",".join(d.order),
                   help="the parts in order (kind:index into its lengths); a part that would not finish in time "
                        "is not run")
    p.add_argument("--ttft-blocks", default=",".join(d.ttft_blocks),
                   help="the TTFT part's blocks in order (off: a cold prefill on B; on: A publishes, B loads); "
                        "'on' alone measures the hit with a quarter of the seed's prefills")
    p.add_argument("--kv-gib", type=float, default=d.kv_bytes / 2**30, help="each replica's KV cache")
    p.add_argument("--pool-gib", type=float, default=d.pool_bytes / 2**30)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--deadline", type=float, default=d.deadline_s, help="seconds for the whole run")
    p.add_argument("--quantization", default=d.quantization, choices=["", "fp8"],
                   help="the replicas' weights: bf16 dummy weights (default) or fp8 (vLLM's online quantization of "
                        "them; for 256k with both replicas resident)")
    p.add_argument("--cold-s", default="", metavar="N=SECONDS[,...]",
                   help="cold prefills measured by an earlier run of this build, for the time estimate of a length "
                        "this run has not measured (a part that would not finish in --deadline is not run)")
    p.add_argument("--report-dir", type=Path, default=Path("reports/runs/seed003"))

