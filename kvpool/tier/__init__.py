"""The network tier: kvpool's pages in a distributed store, for replicas on other hosts.

The host pool (kvpool.pool.daemon) shares KV among the replicas of one host. Past one host,
pages go to an existing distributed store through one interface:

  Tier                  the interface every backend keeps (kvpool.tier.redis.RedisTier, ...),
                        each bound to one tenant's TierAuth:
    .put(ns, block_hash, page, digest) -> bool
                        store one page (complete or invisible: a reader never sees part of
                        one); False when the store refused it (full, or not admitted)
    .get(ns, block_hash, max_page_bytes=None) -> TierPage | None
                        the page as stored, authenticated and checked (below); None when the
                        store has no such key (never stored, or evicted: the store cannot
                        tell which). With `max_page_bytes`, a record longer than
                        record_bound(max_page_bytes) is TierCorrupt and is never read whole
                        (a store client cannot make a reader allocate more than one page)
    .get_record(ns, block_hash, max_page_bytes=None) -> bytes | None
                        the raw record under the block's key, unchecked (what .get decodes),
                        bounded as .get is
    .exists(ns, hashes) -> int
                        how many of `hashes`, from the first, the store holds (advisory, as
                        a host-pool lookup is: the get is what counts)
    .remove(ns, block_hash) -> None
    .close() -> None
    .caps               TierCaps: what the store guarantees (leases on reads, ...)
  Errors are typed: TierUnavailable (the store cannot be reached within the tier's
  timeout, or its access control refused the call: a transport_error miss), TierCorrupt
  (the record is not this tenant's record of this block in this namespace, or its bytes
  do not match the digest taken at publish: corrupt), TierRecordError (not a kvpool record
  at all: corrupt). TierIncompatible (incompatible, naming the fields) is kept for
  callers that tell it apart; a record of another namespace under a block's key can only
  have been moved there, so the reader calls it corrupt.

Trust: the store and every other client of it are untrusted. They can drop, move, copy,
replay and rewrite records, and list keys; they never see the tenant's tier secret.

  TierAuth.from_secret(tenant, secret)
                        a tenant's keys, derived from its tier secret (16 bytes or more,
                        shared by the tenant's replicas on every host; the store never sees
                        it) with keyed BLAKE2b, one `person` label per use, the tenant's
                        name as the input (two tenants given one secret still get
                        different keys):
    .mac_key            HMAC-SHA256 key of the tenant's records
    .name_key           keyed BLAKE2b key of the tenant's store keys
    .prefix             "kvpool:TENANT:": every key of the tenant starts with it (a Redis
                        ACL user of the tenant is restricted to `~kvpool:TENANT:*`); the
                        tenant name is [A-Za-z0-9_.-], 1 to 64 characters (no glob
                        characters in an ACL pattern)
    .key(ns, block_hash) -> str
                        the block's store key: the prefix, then a keyed BLAKE2b-128 of the
                        namespace and the block's chain hash. Opaque: a store client without
                        the secret cannot tell which namespaces or blocks (which prompts)
                        a tenant holds, nor compute the key of a block it knows.
  encode_record(auth, ns, block_hash, page, digest) / decode_record(auth, ns, block_hash, blob)
                        a record is TAG (32 bytes) then BODY: a 4-byte big-endian header
                        length, a msgpack header (magic, version, the writer's whole
                        namespace with its tenant, the block's chain hash, digest kind,
                        digest, length), then the page bytes. TAG = HMAC-SHA256(mac_key,
                        BODY). The reader checks the tag over the whole body first (a
                        record forged, damaged, of another tenant or written without the
                        secret is corrupt), then that the header names its own namespace
                        and block (a genuine record moved under another block's key, or
                        replayed from another namespace, is corrupt), then the length and
                        the digest: no byte is handed out before all of it holds. The cost,
                        measured on a 1 MiB page (a two-core EPYC): HMAC-SHA256 0.6 ms (keyed
                        BLAKE2b 1.5 ms; OpenSSL's SHA-256 uses the CPU's SHA instructions),
                        the whole decode 0.7 ms, a Redis GET of the record over loopback
                        4-8 ms. A record of version 1 (before records were authenticated) is
                        corrupt to this reader: the tier's pages are recomputed once.
  split_record(blob) -> (tag, header, page)
                        a record's parts, unauthenticated: for tools that inspect a store;
                        nothing it returns may be installed.
  tier_load(tier, ns, hashes, dest, deadline_s) -> LoadResult
                        install the longest run of the tier's pages into dest(i) (as
                        kvpool.client.transfer.load does from the host pool), digesting the bytes
                        as installed; every failure ends the run as one miss cause
  tier_publish(tier, ns, hashes, blocks) -> TierPublishResult
                        put each block's bytes with their digest; best effort, counted
  redact_url(url) -> str
                        the URL with its password replaced (for messages and records).
The backends (kvpool.tier.redis, kvpool.tier.mooncake) import this module; it imports no
backend. The backend a URL names is chosen by kvpool.tier.registry.open_tier.

Modules:
  interface  Tier, tier_load, tier_publish.
  record     the record, its authentication (TierAuth) and the tier's errors.
  registry   open_tier: the backend a URL names, imported only when named.
  redis, mooncake  the backends.
  rule       when a remote block is worth loading (the tier rule).
"""
