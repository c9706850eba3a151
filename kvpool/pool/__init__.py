"""The pool itself: what a page is and how the daemon keeps pages.

  keys         Namespace (everything that changes KV bytes) and chained block hashes.
  digest       the page digests (XXH3-128 on the host, the GPU sketch's kind).
  copy         host copies fused with the page digest.
  index        the seqlocked segment index clients probe without a round trip.
  catalog      the bookkeeping: two-phase publish, leases, eviction, ghosts, admission
               and load limits. Pure state, no I/O.
  arena        the shared-memory arena of fixed-size pages, with generations, and the
               daemon's private state sealed against clients.
  protocol     the typed, versioned wire protocol (msgspec msgpack frames).
  metrics      Prometheus metrics of the daemon and of clients.
  private_dir  directories only their user can change, checked from /.
  daemon       the pool daemon: catalog + arena behind a Unix socket and TCP.
  cli          the daemon's command (`kvpool serve`).
"""
