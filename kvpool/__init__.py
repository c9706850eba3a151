"""kvpool: a shared host-memory pool of KV-cache blocks for LLM inference replicas.

Modules, one job each:
  keys      Namespace (everything that changes KV bytes) and chained block hashes.
  errors    typed errors and MissCause, the one outcome of every failed lookup or load.
  arena     the POSIX shared-memory arena of fixed-size pages, with page generations.
  catalog   the pool's bookkeeping: two-phase publish, leases, eviction, ghosts,
            admission and load limits. Pure state, no I/O.
  protocol  the typed, versioned wire protocol (msgspec msgpack frames).
  server    the pool daemon: catalog + arena behind a Unix socket and TCP; a lookup may
            wait (parked, within a bound) for a publish of its block in flight.
  client    the client library every other part uses (zero-copy on one host).
  copy      host copies fused with the page digest; digest: the page digest itself.
  metrics   Prometheus metrics of the daemon and of clients.
  history   the JSON-lines history every lookup, load, publish and audit record goes to.
  connector the vLLM V1 KV connector (scheduler and worker sides); vllm_compat: the one
            place that knows vLLM version and platform differences.
  copier    the worker's copy engine on CPU: pool transfers on a copy thread, in an
            order the engine relies on (loads before attention, stores before reuse).
  gpu_transfer, gpu_copier
            the CUDA stream-ordered transfer engine between KV tensors and the
            registered arena, and the same copier interface on top of it.
  audit     a V1 connector that wraps any other and records digests of the KV bytes.
  identity  which checkpoint a namespace names: a digest of every weight file's content,
            cached per file version (realpath, inode, size, mtime, ctime).
  private_dir
            directories only their user can change, checked from / (the run directory,
            the identity's cache).
  testing   the reference model and the Hypothesis state machine that checks a pool.
"""
