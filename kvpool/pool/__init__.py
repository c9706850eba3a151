"""The pool itself: what a page is and how the daemon keeps pages.

  keys         Namespace (everything that changes KV bytes) and chained block hashes.
  digest       the page digests (XXH3-128 on the host, the GPU sketch's kind).
  copy         host copies fused with the page digest.
  index        the seqlocked segment index clients probe without a round trip.
  records      what the catalog answers: Hits, Miss, Slot, the results and outcomes (which
               the wire protocol carries and the clients read).
  catalog      the bookkeeping: two-phase publish, leases, eviction, ghosts, admission
               and load limits. Pure state, no I/O.
  arena        the shared-memory arena of fixed-size pages, with generations, and the
               daemon's private state sealed against clients.
  protocol     the typed, versioned wire protocol (msgspec msgpack frames).
  metrics      Prometheus metrics of the daemon and of clients.
  private_dir  directories only their user can change, checked from /.
  config       the daemon's configuration (PoolConfig).
  state        what the daemon keeps per connection (Session) and per tenant (TenantPool).
  lookup_wait  the daemon's lookups that wait for a publish in flight.
  scrub        the daemon's scrub of committed pages at rest.
  attach       the daemon's handout of a tenant's segments over the attach socket.
  handlers     the daemon's request handlers: a decoded frame to its encoded reply.
  connection   one client connection of the daemon: the framing, the pre-hello bounds.
  daemon       the pool daemon: catalog + arena behind a Unix socket and TCP; its start-up,
               listeners, serving loop and shutdown, with the parts above mixed in.
  cli          the daemon's command (`kvpool serve`).
"""
