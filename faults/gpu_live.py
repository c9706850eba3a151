"""The stream-delay fault and its negative control on a live vLLM replica on a GPU.

kvgate.faults.connector.FaultConnector uses both around kvpool's connector on CUDA. Armed through
the replica's fault-control file (kvgate.faults.control), section "gpu":

    {"gpu": {"stream_delay_ms": 300,   # torch.cuda._sleep on the engine's stream
             "times": 1,               # how many steps are delayed (then it heals)
             "control": "unordered",   # optional: the negative control
             "drop": "store_after_write"}}   # the ordering edge the control drops

  StreamDelay            at start_load_kv of a step that will publish blocks (vLLM calls
                         it before the forward), a `torch.cuda._sleep` is enqueued on the
                         engine's current stream, so every KV write of the step's forward
                         runs behind it. The store issued in wait_for_save must wait for
                         those writes; a copy that lost its dependency on the engine's
                         stream reads the blocks before they are written (stale KV).
  ControlledCudaCopier   kvpool.connector.gpu_copier.CudaCopier whose transfer engine
                         (SwitchableTransferEngine) drops one stream dependency
                         (kvpool.gpu.config.OrderingEdge) while the control is armed:
                         the seed-003 bug, switched on and off at run time without a
                         restart.
Every delay and every dropped edge is written to the history (`fault` events, sites
"gpu_stream" and "gpu_transfer"). Heal: disarm the section; the delayed work runs and
nothing is left behind once the stream drained.
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


def _spec(control: ControlFile) -> tuple[dict | None, int]:
    spec, generation = control.section(SECTION)
    if spec and spec.get("control") not in (None, *CONTROLS):
        raise ControlFileError(f"unknown gpu control {spec.get('control')!r}; known {CONTROLS}")
    return spec, generation


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
    `"control": "unordered"` is armed, and keeps every edge otherwise."""

    def __init__(self, *args, control: ControlFile, history: HistoryWriter, **kwargs):  # noqa: ANN002, ANN003
        self.control = control
        self.history = history
        self.dropped = 0
        super().__init__(*args, **kwargs)

    def _order(self, edge: OrderingEdge, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        spec, _ = _spec(self.control)
        if spec and spec.get("control") == "unordered" and edge == OrderingEdge(spec.get("drop", "store_after_write")):
            self.dropped += 1
            self.history.write("fault", site="gpu_transfer", kind="gpu_control", control="unordered",
                               edge=edge.value, dropped=self.dropped)
            return
        super()._order(edge, stream, event)


class ControlledCudaCopier(CudaCopier):
    """A CudaCopier on a SwitchableTransferEngine (armed by the replica's control file)."""

    def __init__(self, backend: PoolBackend, history: HistoryWriter, metrics: ClientMetrics | None = None, *,
                 control: str | Path | ControlFile, config: TransferConfig = TransferConfig()):
        super().__init__(backend, history, metrics, config=config)
        self.control = control if isinstance(control, ControlFile) else ControlFile(control)

    def _new_engine(self, ns: Namespace, layers: Sequence[torch.Tensor], config: TransferConfig) -> TransferEngine:
        return SwitchableTransferEngine(self.backend, ns, layers, config, self.lanes, control=self.control,
                                        history=self.history)
