"""kvpool: a shared host-memory pool of KV-cache blocks for LLM inference replicas.

Its parts, each a package, each importing only those listed after it:

  connector  the vLLM V1 KV connector (`kv_connector_module_path="kvpool.connector"`):
             settings, request parameters, scheduler and worker sides, the copy engines,
             stats, identity, history, vLLM compatibility, the audit wrapper, the HTTP check.
  gpu        the CUDA transfer engine between KV tensors and the registered arena.
  tier       the network tier: records in a distributed store (Redis, Mooncake), the tier
             rule, and the registry that opens a backend by URL.
  client     the client library every other part uses (zero-copy on one host).
  pool       the pool itself: keys, digests, copies, the index, the catalog, the arena, the
             wire protocol, metrics, the daemon and its command.
  errors     typed errors and MissCause, the one outcome of every failed lookup or load.
"""
