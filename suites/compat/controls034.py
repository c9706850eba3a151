"""Known-bad KVPoolConnectors, the negative controls of suites/compat/test_vllm034.py: each
undoes one thing kvpool does for vLLM 0.32 and 0.34, and the oracle of the test it belongs to
must catch it. vLLM builds them by name (kv_connector_module_path="suites.compat.controls034").

  NoPreemptionDrain    handle_preemptions does nothing (kvpool before it drained there): a
                       preempted request's stores are drained in start_load_kv alone, which
                       vLLM 0.32 and 0.34 call after the forward in a step without a
                       synchronous load.
  NoRelease            unregister_kv_caches does nothing: a store still running reads the KV
                       memory a sleep releases.
  LoadsNothing         claims the pool's blocks, and its start_load_kv installs nothing.
  HidesLoadErrors      never reports a block whose load failed (get_block_ids_with_load_errors
                       answers nothing): vLLM computes on what the failed load left.
"""

from __future__ import annotations

from kvpool.connector.facade import KVPoolConnector


class NoPreemptionDrain(KVPoolConnector):
    def handle_preemptions(self, kv_connector_metadata):  # noqa: ANN001, ANN201
        return None


class NoRelease(KVPoolConnector):
    def unregister_kv_caches(self):  # noqa: ANN201
        return None


class LoadsNothing(KVPoolConnector):
    def start_load_kv(self, forward_context, **kwargs):  # noqa: ANN001, ANN201
        return None


class HidesLoadErrors(KVPoolConnector):
    def get_block_ids_with_load_errors(self):  # noqa: ANN201
        if self.worker is not None:
            self.worker.take_failed()
        return set()
