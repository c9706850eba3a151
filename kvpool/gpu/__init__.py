"""The GPU engine: CUDA stream-ordered copies between an engine's KV tensors and the
registered arena (or a keeper's tier in device memory), the GPU's page digest (sketch), and
the GPU tier. Its modules, each importing only those below it:

  cli       the keeper's command (`kvpool keeper`): one GPU's keeper and control plane as a
            process, its run directory, its address file, its stop (KeeperProcess).
  tier_backend  a keeper's tier as a pool backend (TierBackend) and as the engine's arena
            (TierArena), over a TierLink.
  transfer  TransferEngine: setup, the segment it follows, CUDA graphs, the hooks the
            negative controls replace, completion (poll, drain, close); the engine's
            contract is its docstring.
  keeper_server  the keeper's control plane: one GpuKeeper served on a Unix socket in the
            pool's wire protocol (hello, lookup, acquire, release, reserve, commit, abort), its
            maintenance thread (reaps, demotion) (KeeperServer).
  tier_client  a replica's client of it: the session, the mapping it hands out, the
            keeper's staleness from its heartbeat (TierClient, KeeperStale); the link that
            follows a restarted keeper through its address file (TierLink).
  store     Stores (TransferEngine's stores: units, chunks, sketches, commits),
            StoreHandle, StoreOutcome.
  load      Loads (TransferEngine's loads: staged copies, the check of what arrived, the
            install), LoadHandle, LoadOutcome, check_plan, arrived_digests.
  keeper    the GPU tier's owner: each tenant's VMM buffer, the tier's bookkeeping, the
            attach socket that hands the buffers out (GpuKeeper).
  tier_map  a replica's side of the GPU tier: the buffer imported and mapped (TierMap).
  tiered    tiers in lookup order as one pool backend: a lookup, load or publish that misses
            the first (a keeper's tier) falls through to the next (the host pool) (TieredBackend).
  driver    the driver path's calls: raw-pointer copies through cuda-python (Driver).
  vmm       device memory another process maps: VMM buffers, their export and import,
            interprocess events (cuda-python).
  tier      the GPU tier's bookkeeping: the pool's catalog per tenant, demotion (LRU), the
            quarantine of a crashed producer's pages, the fall-through order across tiers, a
            grant presented to another instance (WrongInstance).
  staging   host memory: the arena's registration, pinned sketch buffers, index rings.
  events    the host's waits for CUDA events.
  layout    the KV layout and the page order (KVLayout, block_page), the widest views.
  paths     the copy paths (engine x issue x host memory x digest kind x direction) and
            the ordering edges each has: the registry the gate's matrix enumerates.
  region    where the pool's pages lie as the engine copies them: the host pool's segment
            or a keeper's tier in device memory (PageRegion, page_region).
  config    TransferConfig, TransferCapabilities, the enums, the engine's errors.
  sketch    the digest a GPU takes of a page, the same function on the host.
  handout   the GPU tier's handout protocol over a Unix socket (descriptors by SCM_RIGHTS),
            the keeper's private state (generations, heartbeat).

The GPU tier's design: docs/gpu-tier.md.
"""
