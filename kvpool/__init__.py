"""kvpool: a shared host-memory pool of KV-cache blocks for LLM inference replicas.

Modules, one job each:
  keys      Namespace (everything that changes KV bytes) and chained block hashes.
  errors    typed errors and MissCause, the one outcome of every failed lookup or load.
  arena     the POSIX shared-memory arena of fixed-size pages, with page generations.
  catalog   the pool's bookkeeping: two-phase publish, leases, eviction, ghosts,
            admission and load limits. Pure state, no I/O.
  protocol  the typed, versioned wire protocol (msgspec msgpack frames).
  server    the pool daemon: catalog + arena behind a Unix socket and TCP.
  client    the client library every other part uses (zero-copy on one host).
  metrics   Prometheus metrics of the daemon.
"""
