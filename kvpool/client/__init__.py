"""The client library: everything that talks to a pool daemon goes through here.

  PoolBackend        the interface (a Protocol) the connector, benches and tests use; fault
                     injectors and audit wrap a PoolBackend and are PoolBackends themselves.
  PoolClient         the real one: a blocking socket client (Unix or TCP) with typed errors.
                     On the daemon's host it maps the arena and copies page bytes directly
                     (zero-copy: no page byte crosses the socket; the daemon's private
                     state, which probe() reads, is mapped read-only); elsewhere page
                     bytes travel in WritePages / ReadPages frames.
  lookup(ns, hashes, wait_pending_s=w)
                     w > 0: the daemon waits up to w seconds (capped by its
                     max_lookup_wait_s) for a publish in flight of the first missing
                     block, then answers with what is visible (MissCause.IN_FLIGHT if that
                     publish is still in flight); that call's socket timeout is the
                     client's timeout plus w. w = 0 (the default): answer at once.
  publish(...)       reserve -> write -> commit, with digests; returns what became visible.
  load(...)          acquire (lease) -> copy each page into the caller's buffer -> digest
                     the installed bytes -> (a page that fails the check: reported with
                     report_corrupt, where the backend has it, while the lease holds it)
                     -> release (generation re-check). With a
                     deadline, every pool call of the load (and the wait for the client's
                     lock behind another thread's call) ends by it: a stalled pool costs
                     the load its deadline, not the client's timeout per call.
  with client.call_deadline(s): ...
                     this thread's calls end within s seconds from now (PoolTimeout past
                     it; a call begun after it still gets MIN_CALL_S). Returns how many
                     leading blocks were installed and, if fewer than asked, exactly one
                     MissCause (including the loader-side ones: corrupt, transport_error,
                     timeout).

Addresses: "unix:/path/to/pool.sock" or "tcp:HOST:PORT". On a Unix socket (the pool's and
the attach socket) the client sends nothing, not the hello with its token nor an attach
ticket, until the kernel's credentials of the listening process (SO_PEERCRED) name one of
`pool_uids` (default: this user and root); otherwise UntrustedPool (a TransportError).

Modules:
  backend      PoolBackend, PublishResult, LoadResult, parse_address.
  pool_client  PoolClient.
  transfer     publish and load over any PoolBackend.
"""
