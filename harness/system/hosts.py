"""Several hosts on one machine: each host a network namespace (kvgate.harness.system.netns) with
its own kvpool daemon and vLLM replicas, one more host running the network tier's store,
everything started and torn down by the harness.

  MultiHost(model_dir, report_dir, replicas={"h1": ["G"], "h2": ["H"]}, settings=..., store="redis")
      store "redis": redis-server on the store host, its access control on: the replicas'
      tenant has an ACL user restricted to its own keys, and the replicas' tier URL carries
      its credentials (the default user's admin password is the harness's, .store_client());
      "mooncake": mooncake_master and one
      storage node (mooncake_client, which holds every page: the replicas' clients mount
      no memory of their own) on the store host, the replicas' clients bound to their
      hosts' addresses
      .start()            the network, the store on host "store", one pool daemon per host
                          (in that host), and the replicas (each in its host, on its host's
                          pool, every one on the same tier)
      .url(replica) / .host_of(replica) / .history_dir / .cluster (the replicas' Cluster)
      .tier_url(host)     the store's URL as a replica on that host uses it
      .tier_secret        the replicas' tenant's tier secret (kvpool.tier.record.TierAuth; every
                          host's replicas are given it, in a 0600 file; the store never is)
      .store_client()     a Redis client of the store with every right and no tier secret (the
                          store's operator: what a hostile client of the store can do)
  The nemesis, each recorded in the run's history (`nemesis` events):
      .kill_store()       SIGKILL the store's storage node (redis-server; Mooncake's storage
                          node, whose pages the master still indexes)
      .restart_store()    start it again, empty (no persistence: as a restarted node is)
      .slow(host, rate)   the host's link through a token bucket (tc tbf): a slow link, or,
                          on "store", a degraded storage node
      .partition(host)    the host's link down: its packets vanish
      .heal(host)         the link back, unlimited
      .arm(replica, section, spec)   a section of the replica's fault-control file
                          (kvgate.faults.connector: its negative controls)
      .reset()            faults disarmed, every replica's prefix cache and every host's pool
                          emptied, the store flushed, links healed
      .stop()             replicas, pools, the store, then the network; raises OrphanError
                          if a namespace or link survived
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvgate.harness.client.http import reset_prefix_cache
from kvgate.harness.system.cluster import DEFAULT_CHUNK, Cluster, OrphanError, ReplicaSpec
from kvgate.harness.system.netns import Network
from kvgate.harness.system.pool import DEFAULT_TENANT, PoolProcess
from kvgate.harness.system.stores import MooncakeMaster, MooncakeNode, RedisServer, mooncake_env
from kvpool.tier.interface import redact_url

STORE = "store"
STORES = ("redis", "mooncake")
_MOONCAKE_FLUSH = """
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup(sys.argv[1], sys.argv[2], 0, 16 << 20, "tcp", "", sys.argv[3])
if rc != 0:
    sys.exit(f"setup: {rc}")
s.remove_all()
s.close()
"""
# More replicas than cores: an idle engine's OpenMP threads must sleep, not spin, or the
# replica sharing their core computes in what is left (a cold prefill measured 0.1 to 1 s).
IDLE_ENV = (("OMP_WAIT_POLICY", "PASSIVE"), ("KMP_BLOCKTIME", "0"))


class MultiHost:
    def __init__(self, model_dir: Path, report_dir: Path, replicas: dict[str, list[str]], *,
                 page_size: int = 128 * 1024, pool_pages: int = 256, kv_bytes: int = 256 * 2**20,
                 settings: dict[str, Any] | None = None, store_maxmemory: int | None = None,
                 store: str = "redis") -> None:
        if STORE in replicas:
            raise ValueError(f"host name {STORE!r} is the store's")
        if store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {store!r}")
        self.store_kind = store
        self.master: MooncakeMaster | None = None  # Mooncake's (its storage node is .store)
        self.model_dir = Path(model_dir)
        self.report_dir = Path(report_dir)
        self.layout = replicas  # host -> its replicas' names
        self.page_size = page_size
        self.pool_pages = pool_pages
        self.kv_bytes = kv_bytes
        self.settings = dict(settings or {})
        self.store_maxmemory = store_maxmemory
        self.cluster = Cluster(model_dir, self.report_dir / "cluster", page_size=page_size, pool_pages=16)
        self.net = Network([*replicas, STORE], record=self._record)
        self.store: RedisServer | MooncakeNode | None = None  # the process that holds the pages
        self.pools: dict[str, PoolProcess] = {}
        self.tier_secret = secrets.token_hex(16)  # a credential, not a test's random choice

    def _record(self, action: str, **fields: object) -> None:
        self.cluster.nemesis(action, **fields)

    @property
    def history_dir(self) -> Path:
        return self.cluster.history_dir

    def tier_url(self, host: str) -> str:
        """The tier URL as a replica on `host` uses it."""
        if self.master is None:
            return self.store.tenant_url(DEFAULT_TENANT)
        return self.master.url_for(segment_bytes=0, buffer_bytes=32 * 2**20, local_hostname=self.net.ip(host))

    def _start_store(self) -> None:
        where = {"host": self.net.ip(STORE), "prefix": self.net.prefix(STORE)}
        if self.store_kind == "redis":
            self.store = RedisServer(self.report_dir / "store", maxmemory=self.store_maxmemory,
                                     tenants=(DEFAULT_TENANT,), **where).start()
            return
        self.master = MooncakeMaster(self.report_dir / "store", lease_ms=1000, client_ttl_s=2, **where).start()
        self.store = MooncakeNode(self.report_dir / "store", self.master, segment_bytes=512 * 2**20, **where).start()

    def store_client(self):  # noqa: ANN201 - redis.Redis
        if self.store_kind != "redis":
            raise ValueError(f"store_client is a Redis client; the store is {self.store_kind}")
        return self.store.client()

    def _secret_file(self) -> Path:
        path = self.report_dir / "tier-secrets.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({DEFAULT_TENANT: self.tier_secret}, f)
        return path

    def host_of(self, replica: str) -> str:
        return next(h for h, names in self.layout.items() if replica in names)

    def url(self, replica: str) -> str:
        return self.cluster.replicas[replica].url

    def start(self, timeout: float = 600.0) -> MultiHost:
        self.report_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.net.start()
            self._start_store()
            for host in self.layout:
                self.pools[host] = PoolProcess.start(page_size=self.page_size, num_pages=self.pool_pages,
                                                     log_path=self.report_dir / f"pool-{host}.log",
                                                     prefix=tuple(self.net.prefix(host)))
            specs = []
            secret_file = str(self._secret_file())
            for host, names in ((h, n) for h, ns in self.layout.items() for n in ns):
                pool = self.pools[host]
                extra = {"pool": pool.unix, "token": pool.token, "tier": self.tier_url(host),
                         "tier_secret_file": secret_file, **self.settings}
                env = IDLE_ENV + (tuple(mooncake_env(self.net.ip(host)).items()) if self.master else ())
                core = str(list(self.layout).index(host) % (os.cpu_count() or 1))  # a host's replicas share its core
                specs.append(ReplicaSpec(names, core=core, kv_bytes=self.kv_bytes, audit=True,
                                         faults_file=str(self.report_dir / f"faults-{names}.json"),
                                         max_num_batched_tokens=DEFAULT_CHUNK, connector_extra=tuple(extra.items()),
                                         netns=tuple(self.net.prefix(host)), host=self.net.ip(host),
                                         extra_env=env))
            self.cluster.start(specs, timeout=timeout)
            self._record("hosts_start", hosts={h: {"ip": self.net.ip(h), "replicas": n, "pool": self.pools[h].name}
                                              for h, n in self.layout.items()},
                         store={"ip": self.net.ip(STORE), "kind": self.store_kind,
                                "url": redact_url(self.tier_url(STORE))})
        except BaseException:
            self.stop()
            raise
        return self

    # -- the nemesis -------------------------------------------------------------------------
    def kill_store(self) -> None:
        self._record("store_kill", pid=self.store.proc.pid if self.store.proc else None)
        self.store.kill()

    def restart_store(self) -> None:
        self.store.start()
        self._record("store_restart", pid=self.store.proc.pid)

    def slow(self, host: str, rate: str) -> None:
        self.net.slow(host, rate)

    def partition(self, host: str) -> None:
        self.net.partition(host)

    def heal(self, host: str) -> None:
        self.net.heal(host)

    def arm(self, replica: str, section: str, spec: dict[str, Any]) -> None:
        """Arm a section of the replica's fault-control file (kvgate.faults.connector)."""
        from kvgate.faults.control import write_control

        write_control(self.cluster.faults[replica], {section: spec})
        self._record("arm", replica=replica, section=section, spec=spec)

    # -- what the scenario runner asks of a system (as of kvgate.harness.system.cluster.Cluster) ----
    @property
    def replicas(self):  # noqa: ANN201
        return self.cluster.replicas

    @property
    def faults(self):  # noqa: ANN201
        return self.cluster.faults

    def nemesis(self, action: str, **fields: object) -> None:
        self.cluster.nemesis(action, **fields)

    def pool_for(self, replica: str) -> PoolProcess | None:
        """The pool daemon of the replica's host (None while it is down)."""
        pool = self.pools.get(self.host_of(replica))
        return pool if pool is not None and pool.proc.poll() is None else None

    def crashed(self) -> list[str]:
        out = [x for x in self.cluster.crashed() if not x.startswith("pool ")]  # the cluster's own pool serves none
        out += [f"pool of {h} (exit {p.proc.returncode})" for h, p in self.pools.items() if p.proc.poll() is not None]
        return out

    def reset(self) -> None:
        for path in self.cluster.faults.values():
            path.write_text("{}")
        for host in self.net.hosts:
            self.net.heal(host)
        if self.store.proc is None:
            self.restart_store()
        self._flush()
        for pool in self.pools.values():
            with pool.client(name="reset") as c:
                pages = c.stats()["num_pages"]
                c.set_capacity(0)
                c.set_capacity(pages)
        for r in self.cluster.replicas.values():
            reset_prefix_cache(r.url)

    def _flush(self) -> None:
        """Empty the store (Mooncake: remove_all through a client of the store host's own)."""
        if self.master is None:
            self.store.client().flushall()
            return
        ip = self.net.ip(STORE)
        done = subprocess.run([*self.net.prefix(STORE), sys.executable, "-c", _MOONCAKE_FLUSH, ip, self.master.metadata,
                               f"{ip}:{self.master.rpc_port}"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **mooncake_env(ip)})
        if done.returncode:
            raise RuntimeError(f"mooncake remove_all on the store host failed: {done.stderr[-800:]}")

    def stop(self) -> None:
        errors: list[str] = []
        try:
            self.cluster.stop()
        except OrphanError as exc:
            errors.append(str(exc))
        for pool in self.pools.values():
            pool.stop()
        self.pools = {}
        for proc in (self.store, self.master):
            if proc is not None:
                proc.stop()
        self.net.stop()
        errors += [f"network leftover {x}" for x in self.net.leftovers()]
        if errors:
            raise OrphanError("; ".join(errors))

    def __enter__(self) -> MultiHost:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
