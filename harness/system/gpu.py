"""The system under test on GPUs: live vLLM 0.24 replicas (the offline GPU bundle) sharing
one kvpool pool.

  gpu_args(memory_utilization, block_size)   the vLLM flags of a replica sharing a GPU
  GpuCluster     kvgate.harness.system.cluster.Cluster whose replicas run on CUDA; `.arm(replica,
                 section)` writes the replica's "gpu" fault section (kvgate.faults.gpu_live, through
                 kvgate.faults.connector) and records the arming in the history.
"""

from __future__ import annotations


from kvgate.harness.system.cluster import Cluster

BLOCK_SIZE = 16  # TRITON_ATTN needs a multiple of 16; set explicitly so kernel and manager blocks agree


def gpu_args(memory_utilization: float, block_size: int = BLOCK_SIZE) -> tuple[str, ...]:
    """vLLM 0.24 flags for a replica sharing one GPU (the bundle has TRITON_ATTN only)."""
    return ("--attention-backend", "TRITON_ATTN", "--enforce-eager", "--block-size", str(block_size),
            "--gpu-memory-utilization", str(memory_utilization))


class GpuCluster(Cluster):
    def arm(self, replica: str, section: dict | None) -> None:
        """Write the replica's "gpu" fault section (None: disarm), whole at once (a rename: a
        replica's thread reading it meanwhile sees the old file or the new one)."""
        from kvgate.faults.control import write_control
        from kvgate.faults.gpu_live import check_section

        if section:
            check_section(section)  # a mistake in the section fails here, not in the replica's engine
        write_control(self.faults[replica], {"gpu": section} if section else {})
        self.nemesis("gpu_fault_arm" if section else "gpu_fault_heal", replica=replica, section=section)
