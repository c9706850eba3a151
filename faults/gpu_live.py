"""The stream-delay fault and its negative control on a live vLLM replica on a GPU.

kvgate.faults.connector.FaultConnector uses both around kvpool's connector on CUDA. Armed through
the replica's fault-control file (kvgate.faults.control), section "gpu":

    {"gpu": {"stream_delay_ms": 300,   # torch.cuda._sleep on the engine's stream
             "times": 1,               # how many steps are delayed (then it heals)
             "control": "unordered",   # optional: the negative control
             "drop": "store_after_write"}}   # the ordering edge the control drops
    {"gpu": {"load_delay_ms": 300,     # torch.cuda._sleep on the stream that writes a load's blocks
             "times": 1, "control": "unordered",
             "drop": ["read_after_load", "release_after_copy"],   # one edge or several
             "install": "staged"}}     # the loads take the staged install even where direct is set

  StreamDelay            at start_load_kv of a step that will publish blocks (vLLM calls
                         it before the forward), a `torch.cuda._sleep` is enqueued on the
                         engine's current stream, so every KV write of the step's forward
                         runs behind it. The store issued in wait_for_save must wait for
                         those writes; a copy that lost its dependency on the engine's
                         stream reads the blocks before they are written (stale KV).
  load delay             (`load_delay_ms`) the consumer's side: at each of the first `times`
                         loads after an arming, a `torch.cuda._sleep` is enqueued on the
                         stream whose work writes the load's blocks into the KV cache
                         (TransferEngine.load_write_stream) before the load is enqueued,
                         so its installs run late. The engine's reads must still wait for
                         them: a stream wait (read_after_load) where loads are
                         synchronous, the host's wait before the load is reported done
                         (release_after_copy) where they are asynchronous. With the direct
                         install (pages in device memory, install_direct) the kernel that
                         writes the blocks also sketches them and load() returns only after
                         the host has read those sketches (verify_after_check): the writes
                         are over before any read can be enqueued, whatever edge is dropped
                         (measured live: the reads' edges dropped, nothing read early).
                         `"install": "staged"` puts a load on the staged install, whose
                         writes follow the check, for the control that drops those edges.
  ControlledCudaCopier   kvpool.connector.gpu_copier.CudaCopier whose transfer engine
                         (SwitchableTransferEngine) drops one ordering edge
                         (kvpool.gpu.config.OrderingEdge: a stream wait, or a wait of the
                         host for a copy) while the control is armed: the seed-003 bug,
                         switched on and off at run time without a restart.
Every delay and every dropped edge is written to the history (`fault` events, sites
"gpu_stream" and "gpu_transfer"). Heal: disarm the section; the delayed work runs and
nothing is left behind once the stream drained, except what a control let run early (the
consumer's reads before its load's writes: the blocks the engine computed from them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from kvgate.faults.control import ControlFile, ControlFileError
from kvgate.faults.gpu_controls import cycles_per_ms, delay_stream
from kvpool.client.backend import PoolBackend
from kvpool.connector.copier import CopyRun
from kvpool.connector.gpu_copier import CudaCopier
from kvpool.gpu.config import OrderingEdge, TransferConfig
from kvpool.gpu.transfer import TransferEngine
from kvpool.connector.history import HistoryWriter
from kvpool.pool.keys import Namespace
from kvpool.pool.metrics import ClientMetrics

SECTION = "gpu"
CONTROLS = ("unordered",)


INSTALLS = ("staged",)


def check_section(spec: dict) -> None:
    """ControlFileError where the section names an unknown control, edge or install."""
    if spec.get("control") not in (None, *CONTROLS):
        raise ControlFileError(f"unknown gpu control {spec.get('control')!r}; known {CONTROLS}")
    if spec.get("control"):
        dropped_edges(spec)  # an unknown edge is an error of the file, not a control that drops nothing
    if spec.get("install") not in (None, *INSTALLS):
        raise ControlFileError(f"gpu section: install {spec.get('install')!r}; known {INSTALLS}")


def _spec(control: ControlFile) -> tuple[dict | None, int]:
    spec, generation = control.section(SECTION)
    if spec:
        check_section(spec)
    return spec, generation


def dropped_edges(spec: dict) -> frozenset[OrderingEdge]:
    """The edges an armed control drops: `drop` names one edge or a list of them (default
    store_after_write)."""
    drop = spec.get("drop", OrderingEdge.STORE_AFTER_WRITE.value)
    names = [drop] if isinstance(drop, str) else drop
    try:
        return frozenset(OrderingEdge(n) for n in names)
    except (TypeError, ValueError) as exc:
        raise ControlFileError(f"gpu control: drop {drop!r} is not an ordering edge or a list of them; known "
                               f"{[e.value for e in OrderingEdge]}") from exc


class StreamDelay:
    """Fires `times` delays per arming of the control file (a new file content re-arms)."""

    def __init__(self, control: str | Path | ControlFile, history: HistoryWriter):
        self.control = control if isinstance(control, ControlFile) else ControlFile(control)
        self.history = history
        self._generation = -1
        self._fired = 0
        self._cycles_per_ms: float | None = None
        self._lock = threading.Lock()

    def maybe_fire(self, stores: Sequence[CopyRun]) -> float:
        """Enqueue the delay on the current stream if armed and the step publishes blocks
        (`stores`); returns the delay in ms (0 if none)."""
        spec, generation = _spec(self.control)
        with self._lock:
            if generation != self._generation:
                self._generation, self._fired = generation, 0
            ms = float(spec.get("stream_delay_ms", 0)) if spec else 0.0
            if ms <= 0 or not stores or self._fired >= int(spec.get("times", 1)):
                return 0.0
            self._fired += 1
        if self._cycles_per_ms is None:
            self._cycles_per_ms = cycles_per_ms(torch.cuda.current_device())
        stream = torch.cuda.current_stream()
        delay_stream(stream, int(ms * self._cycles_per_ms))
        self.history.write("fault", site="gpu_stream", kind="stream_delay", delay_ms=ms,
                           cycles_per_ms=round(self._cycles_per_ms), stream=int(stream.cuda_stream),
                           reqs=sorted({r.req_id for r in stores}), tags=sorted({r.tag for r in stores}),
                           store_blocks=sum(len(r.block_ids) for r in stores), control=spec.get("control"))
        return ms


class SwitchableTransferEngine(TransferEngine):
    """A TransferEngine that drops the ordering edge the control file names while
    `"control": "unordered"` is armed, and keeps every edge otherwise; with `load_delay_ms`
    armed, the writes of its next `times` loads run behind a delay (the module's docstring)."""

    def __init__(self, *args, control: ControlFile, history: HistoryWriter, **kwargs):  # noqa: ANN002, ANN003
        self.control = control
        self.history = history
        self.dropped = 0
        self._load_generation = -1
        self._loads_delayed = 0
        self._cycles_per_ms: float | None = None
        super().__init__(*args, **kwargs)

    def _armed(self) -> dict | None:
        """The "gpu" section; a file that cannot be read as one (half written by a writer that
        does not rename, or wrong) arms nothing here: the engine keeps every edge, and the
        error is in the history. These hooks run on the engine's own threads (a commit's, a
        release's), where a raise would leave a copy running under pages given back."""
        try:
            return _spec(self.control)[0]
        except ControlFileError as exc:
            if exc.generation != getattr(self, "_error_generation", None):  # once per content of the file
                self._error_generation = exc.generation
                self.history.write("fault_control_error", site="gpu_transfer", error=str(exc)[:300])
            return None

    def _drops(self, edge: OrderingEdge) -> bool:
        spec = self._armed()
        if spec and spec.get("control") == "unordered" and edge in dropped_edges(spec):
            self.dropped += 1
            self.history.write("fault", site="gpu_transfer", kind="gpu_control", control="unordered",
                               edge=edge.value, dropped=self.dropped)
            return True
        return False

    def _order(self, edge: OrderingEdge, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        if not self._drops(edge):
            super()._order(edge, stream, event)

    def _await_copy(self, edge: OrderingEdge, event: torch.cuda.Event, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if self._drops(edge):
            return None  # the host goes on as if the copies were over
        return super()._await_copy(edge, event, *args, **kwargs)

    def _direct_install(self) -> bool:
        spec = self._armed()
        if spec and spec.get("install") == "staged":  # the consumer's control: its loads take the staged install
            return False
        return super()._direct_install()

    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes], deadline_s: float | None = None):  # noqa: ANN201
        # on the caller's thread (start_load_kv): a file that cannot be read raises to it, as
        # the connector's other fault sites do
        spec, generation = _spec(self.control)
        if generation != self._load_generation:
            self._load_generation, self._loads_delayed = generation, 0
        ms = float(spec.get("load_delay_ms", 0)) if spec else 0.0
        if not (ms > 0 and block_ids and self._loads_delayed < int(spec.get("times", 1))):
            return super().load(block_ids, hashes, deadline_s)
        self._loads_delayed += 1
        if self._cycles_per_ms is None:
            self._cycles_per_ms = cycles_per_ms(self.device)
        stream = self.load_write_stream()
        delay_stream(stream, int(ms * self._cycles_per_ms))
        direct_before = self.direct_loads
        handle = None
        try:
            handle = super().load(block_ids, hashes, deadline_s)
        finally:
            # which install the load took: the direct one only where the engine's earlier work was
            # over (TransferEngine._copy_in); None where it raised or installed nothing. The delay
            # is on the stream load_write_stream() names for the configured install; a load that
            # staged instead has its copy held there, and its installs, which follow the host's
            # check of that copy, with it
            loaded = handle.loaded if handle is not None else 0
            self.history.write("fault", site="gpu_stream", kind="load_delay", delay_ms=ms,
                               cycles_per_ms=round(self._cycles_per_ms), stream=int(stream.cuda_stream),
                               blocks=len(block_ids), loaded=loaded, control=spec.get("control"),
                               direct=(self.direct_loads > direct_before) if loaded else None)
        threading.Thread(target=self._note_delayed_done, args=(handle,), name="kvgate-load-delay-done",
                         daemon=True).start()
        return handle

    def _note_delayed_done(self, handle) -> None:  # noqa: ANN001 - a LoadHandle
        """`load_delay_done` once every write of the delayed load ran on the GPU (its `done`
        event): what a scenario waits for before it reuses the consumer, since a control that
        drops the reads' edges lets the engine go on before them."""
        try:
            handle._done.synchronize()
        finally:
            self.history.write("load_delay_done", site="gpu_stream", blocks=len(handle.block_ids),
                               loaded=handle.loaded)


class ControlledCudaCopier(CudaCopier):
    """A CudaCopier on a SwitchableTransferEngine (armed by the replica's control file)."""

    def __init__(self, backend: PoolBackend, history: HistoryWriter, metrics: ClientMetrics | None = None, *,
                 control: str | Path | ControlFile, config: TransferConfig = TransferConfig()):
        super().__init__(backend, history, metrics, config=config)
        self.control = control if isinstance(control, ControlFile) else ControlFile(control)

    def _new_engine(self, ns: Namespace, layers: Sequence[torch.Tensor], config: TransferConfig) -> TransferEngine:
        return SwitchableTransferEngine(self.backend, ns, layers, config, self.lanes, control=self.control,
                                        history=self.history)
