"""The GPU engine: CUDA stream-ordered copies between an engine's KV tensors and the
registered arena, and the GPU's page digest (sketch).

  transfer  the transfer engine (staging, stores, loads, the driver path).
  sketch    the digest a GPU takes of a page, the same function on the host.
"""
