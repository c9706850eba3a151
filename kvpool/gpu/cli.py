"""The GPU keeper's command: `kvpool keeper` (console script) or `python -m kvpool keeper`: one
GpuKeeper and its KeeperServer for one GPU, in the foreground.

  kvpool keeper [--gpu N] [--backing vmm | memfd] [--name N] [--run-dir D]
                [--page-size 64KiB] [--capacity 1GiB | --pages N] [--quota TENANT=PAGES ...]
                [--tenant NAME=TOKEN ...] [--token-file F]
                [--host-pool unix:PATH | tcp:HOST:PORT] [--host-tenant NAME=TOKEN ...] [--host-token-file F]
                [watermark, TTL, maintenance and session options]
      allocates each tenant's buffer on GPU N (`vmm`: CUDA's VMM, exported as POSIX descriptors;
      `memfd`: host memory behind the same protocol, for hosts without CUDA and the tests), serves
      the attach socket (gpu-attach.sock) and the control socket (gpu-keeper.sock) in its run
      directory, and, once both serve, writes the run directory's keeper-address.json atomically
      (a temporary file renamed over it): the control socket, the attach socket, the pid, a fresh
      instance id (the keeper's, 32 hex digits: the one its hello and its buffers carry), the
      GPU, the backing, the device's UUID, the page size and each tenant's pages, the host pool.
      The run directory (default $XDG_RUNTIME_DIR/kvgate-gpu-keeper-N, else
      /tmp/kvgate-$UID/kvgate-gpu-keeper-N) is created or checked with every directory above it
      as the pool's is (kvpool.pool.private_dir). Tenants and tokens as `kvpool serve` takes them
      (with none, tenant 'default' and a token written to the run directory's tokens.json). With
      --host-pool, each tenant demotes to that pool as a PoolClient of the same tenant, with the
      token --host-tenant / --host-token-file give it (by default its keeper token).

  keeper_parser(parser)      adds the options to an argparse parser.
  config_from_args(args)     the KeeperCommandConfig those options describe (KeeperUsage if
                             they do not add up).
  KeeperProcess(config)      the keeper of one run: .start() (the run directory checked and
                             locked, what a killed keeper left removed, buffers allocated, host
                             pool clients connected, both sockets served, the address file
                             written), .stop(), .run() (start, serve until SIGTERM / SIGINT, stop).
  read_keeper_address(run_dir)  the address file, parsed (kvpool.gpu.tier_client, where a
                             replica's TierLink reads it).

One keeper per run directory: the run directory's keeper.lock is held (flock) for the life of the
process, so a second keeper there is refused while the first lives, and a killed one's lock goes
with it. A restarted keeper starts with an empty tier and a new instance id: nothing of a killed
instance is trusted by a client (kvpool.gpu.tier_client.TierLink).

Stop (SIGTERM, SIGINT): the address file goes first (no client reconnects to an instance that is
ending), then the control plane (every session ends: a producer's open reservations are
quarantined as at any disconnect, and with the instance they are never committed, freed or
reused: the tier's bookkeeping ends with it), then the keeper (its heartbeat set to 0 in every
state segment, so a client still mapped judges it stale at once; the attach socket closed; the
keeper's handles of the buffers dropped: the memory lives on in the replicas that mapped it until
they unmap), then the lock (the file stays: removing it would let two keepers lock two files). Exit 0; a summary on stderr.

Exit codes: 2 for what the flags say wrong (a bad size, tenant, quota, watermark, address or
token file; a run directory another user can change; a keeper already running there), 3 for
what the host does not give (no CUDA device or no VMM export for --backing vmm; a host pool that
cannot be reached or refuses a token). Each with one line on stderr naming the flag or the cause.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from kvpool.client.backend import parse_address
from kvpool.client.pool_client import PoolClient
from kvpool.errors import InvalidRequest, PoolError, PoolTimeout, TransportError
from kvpool.gpu.config import TransferError
from kvpool.gpu.keeper import Allocation, GpuKeeper, memfd_allocation, vmm_allocator
from kvpool.gpu.keeper_server import KeeperServer
from kvpool.gpu.tier import GpuTierConfig
from kvpool.gpu.tier_client import ADDRESS_FILE, KeeperAddress, read_keeper_address
from kvpool.pool.catalog import AdmissionPolicy, LoadLimits
from kvpool.pool.cli import parse_quotas, parse_size, read_token_file, tenants_from_args
from kvpool.pool.config import default_run_dir
from kvpool.pool.daemon import InsecureRunDir, pid_alive
from kvpool.pool.private_dir import ensure_private_dir

log = logging.getLogger("kvpool.gpu.cli")

COMMAND = "kvpool keeper"
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
LOCK_FILE = "keeper.lock"
BACKINGS = ("vmm", "memfd")

class KeeperUsage(InvalidRequest):
    """The keeper's flags do not add up (exit 2)."""


class KeeperAlreadyRunning(PoolError):
    """Another keeper holds the run directory's lock (exit 2)."""


class KeeperUnavailable(PoolError):
    """The host does not give what the flags ask for: no CUDA device or VMM export, a host pool
    that cannot be reached or refuses a token (exit 3)."""


@dataclasses.dataclass(frozen=True)
class KeeperCommandConfig:
    gpu: int
    backing: str
    name: str
    run_dir: Path
    tier: GpuTierConfig
    tokens: dict[str, str]
    host_pool: str | None
    host_tokens: dict[str, str]
    maintenance_s: float = 0.2
    hello_timeout_s: float = 5.0
    max_clients: int = 256
    ticket_ttl_s: float = 5.0
    handout_timeout_s: float = 5.0


def _pairs(pairs: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not value:
            raise KeeperUsage(f"{flag} takes NAME=TOKEN, got {pair!r}")
        out[name] = value
    return out


def _positive(kind: type, what: str) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{what}: not a number: {text!r}") from exc
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return value
    return parse


def keeper_parser(keeper: argparse.ArgumentParser) -> argparse.ArgumentParser:
    keeper.add_argument("--gpu", type=int, default=0, help="the GPU's index (CUDA's device ordinal)")
    keeper.add_argument("--backing", choices=BACKINGS, default="vmm",
                        help="vmm: device memory (CUDA VMM, exported as POSIX descriptors); memfd: host memory "
                             "behind the same protocol (hosts without CUDA, tests)")
    keeper.add_argument("--name", default=None, help="the keeper's name (run dir, buffer labels); default "
                                                     "kvgate-gpu-keeper-GPU")
    keeper.add_argument("--run-dir", type=Path, default=None,
                        help="sockets, keeper.lock and keeper-address.json (one keeper per run dir)")
    keeper.add_argument("--page-size", type=parse_size, default="64KiB", help="bytes per page (one KV block)")
    keeper.add_argument("--capacity", type=parse_size, default="256MiB",
                        help="bytes of all tenants' buffers together (rounded down to whole pages)")
    keeper.add_argument("--pages", type=int, default=0, help="number of pages in all (overrides --capacity)")
    keeper.add_argument("--quota", action="append", default=[], metavar="TENANT=PAGES",
                        help="pages of a tenant's own buffer; the tenants without one share the rest evenly")
    keeper.add_argument("--tenant", action="append", default=[], metavar="NAME=TOKEN")
    keeper.add_argument("--token-file", type=Path, default=None, help="JSON object tenant -> token")
    keeper.add_argument("--host-pool", default=None, metavar="unix:PATH|tcp:HOST:PORT",
                        help="the host pool the tier demotes to (none: no demotion)")
    keeper.add_argument("--host-tenant", action="append", default=[], metavar="NAME=TOKEN",
                        help="a tenant's token at the host pool (default: its keeper token)")
    keeper.add_argument("--host-token-file", type=Path, default=None,
                        help="JSON object tenant -> token at the host pool")
    keeper.add_argument("--low-free", type=float, default=0.05, help="demote below this fraction of free pages")
    keeper.add_argument("--high-free", type=float, default=0.15, help="... until this fraction is free")
    keeper.add_argument("--reservation-ttl", type=_positive(float, "--reservation-ttl"), default=30.0,
                        help="seconds before an open publish is reclaimed")
    keeper.add_argument("--lease-ttl", type=_positive(float, "--lease-ttl"), default=60.0,
                        help="seconds before an unreleased lease expires")
    keeper.add_argument("--reservation-max", type=_positive(float, "--reservation-max"), default=3600.0,
                        help="seconds a publish may stay open however often its client renews it")
    keeper.add_argument("--lease-max", type=_positive(float, "--lease-max"), default=3600.0,
                        help="seconds a lease may be held however often its client renews it")
    keeper.add_argument("--min-blocks", type=int, default=1, help="admission: shortest publish")
    keeper.add_argument("--max-loads-per-client", type=int, default=0, help="concurrent leases per client (0: none)")
    keeper.add_argument("--max-loads", type=int, default=0, help="concurrent leases in all (0: no limit)")
    keeper.add_argument("--maintenance-s", type=_positive(float, "--maintenance-s"), default=0.2,
                        help="seconds between maintenance rounds (reaps, TTLs, demotion)")
    keeper.add_argument("--hello-timeout", type=_positive(float, "--hello-timeout"), default=5.0,
                        help="seconds a connection may take to authenticate")
    keeper.add_argument("--max-clients", type=_positive(int, "--max-clients"), default=256)
    keeper.add_argument("--ticket-ttl", type=_positive(float, "--ticket-ttl"), default=5.0,
                        help="seconds a hello's attach ticket stays valid")
    return keeper


def _tenant_pages(total: int, tenants: list[str], quotas: dict[str, int]) -> dict[str, int]:
    unknown = sorted(set(quotas) - set(tenants))
    if unknown:
        raise KeeperUsage(f"--quota names tenants the keeper does not have: {unknown}")
    if any(q <= 0 for q in quotas.values()):
        raise KeeperUsage(f"--quota must give positive page counts: {quotas}")
    others = [t for t in tenants if t not in quotas]
    rest = total - sum(quotas.values())
    share = rest // len(others) if others else 0
    if rest < 0 or (others and share < 1):
        raise KeeperUsage(f"{total} pages leave {rest} for the {len(others)} tenants without a quota: less than "
                          f"one page each")
    return {t: quotas.get(t, share) for t in tenants}


def config_from_args(args: argparse.Namespace) -> KeeperCommandConfig:
    """KeeperUsage (or SystemExit(2) for a token file or tenant pair, as `kvpool serve` has it)."""
    if args.gpu < 0:
        raise KeeperUsage(f"--gpu must be a device index >= 0, got {args.gpu}")
    name = args.name or f"kvgate-gpu-keeper-{args.gpu}"
    run_dir = args.run_dir or default_run_dir(name)
    if args.page_size <= 0 or args.page_size % 4096:
        raise KeeperUsage(f"--page-size must be a positive multiple of 4 KiB, got {args.page_size}")
    if args.pages < 0:
        raise KeeperUsage(f"--pages must be >= 0, got {args.pages}")
    total = args.pages if args.pages else args.capacity // args.page_size
    if total < 1:
        raise KeeperUsage(f"--capacity {args.capacity} holds no page of {args.page_size} bytes")
    tokens = tenants_from_args(args.tenant, args.token_file, run_dir, COMMAND)
    pages = _tenant_pages(total, sorted(tokens), parse_quotas(args.quota, COMMAND))
    host_tokens: dict[str, str] = {}
    if args.host_pool is not None:
        try:
            parse_address(args.host_pool)
        except InvalidRequest as exc:
            raise KeeperUsage(f"--host-pool: {exc.message}") from exc
        host_tokens = dict(tokens)
        if args.host_token_file is not None:
            host_tokens.update(read_token_file(args.host_token_file, COMMAND, "--host-token-file"))
        host_tokens.update(_pairs(args.host_tenant, "--host-tenant"))
        unknown = sorted(set(host_tokens) - set(tokens))
        if unknown:
            raise KeeperUsage(f"--host-tenant / --host-token-file name tenants the keeper does not have: {unknown}")
    elif args.host_tenant or args.host_token_file is not None:
        raise KeeperUsage("--host-tenant / --host-token-file without --host-pool")
    for flag, value in (("--min-blocks", args.min_blocks), ("--max-loads-per-client", args.max_loads_per_client),
                        ("--max-loads", args.max_loads)):
        if value < 0 or (flag == "--min-blocks" and value < 1):
            raise KeeperUsage(f"{flag} out of range: {value}")
    for flag, most, ttl_flag, ttl in (("--reservation-max", args.reservation_max, "--reservation-ttl",
                                       args.reservation_ttl), ("--lease-max", args.lease_max, "--lease-ttl",
                                                               args.lease_ttl)):
        if most < ttl:  # a grant could never be renewed: its first deadline already passes its maximum age
            raise KeeperUsage(f"{flag} {most} is shorter than {ttl_flag} {ttl}")
    try:
        tier = GpuTierConfig(page_size=args.page_size, pages=pages, low_free=args.low_free, high_free=args.high_free,
                             admission=AdmissionPolicy(min_blocks=args.min_blocks),
                             limits=LoadLimits(per_client=args.max_loads_per_client, total=args.max_loads),
                             reservation_ttl_s=args.reservation_ttl, lease_ttl_s=args.lease_ttl,
                             reservation_max_s=args.reservation_max, lease_max_s=args.lease_max)
    except InvalidRequest as exc:
        raise KeeperUsage(f"--low-free / --high-free: {exc.message}") from exc
    return KeeperCommandConfig(
        gpu=args.gpu, backing=args.backing, name=name, run_dir=Path(run_dir), tier=tier, tokens=tokens,
        host_pool=args.host_pool, host_tokens=host_tokens, maintenance_s=args.maintenance_s,
        hello_timeout_s=args.hello_timeout, max_clients=args.max_clients, ticket_ttl_s=args.ticket_ttl)


class KeeperProcess:
    """One keeper's run (see the module docstring). Not reentrant: start once, stop once."""

    def __init__(self, config: KeeperCommandConfig,
                 allocate: Callable[[str, int], Allocation] | None = None):
        self.config = config
        self._allocate = allocate
        self.run_dir = config.run_dir
        self.keeper: GpuKeeper | None = None
        self.server: KeeperServer | None = None
        self.hosts: dict[str, PoolClient] = {}
        self.recovery_note = ""
        self._lock_fd: int | None = None
        self._stop = threading.Event()

    # -- start ------------------------------------------------------------------------------
    def _lock(self) -> None:
        """keeper.lock, held (flock) for the life of this process: a second keeper in this run
        dir is refused while this one lives; a killed one's lock went with it."""
        path = self.run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise KeeperAlreadyRunning(f"a keeper (pid {holder or '?'}) already serves {self.run_dir} (it holds "
                                       f"{path})") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _clear_leftovers(self) -> None:
        """What a killed keeper left: its address file (naming a dead instance) and sockets."""
        notes = []
        address = self.run_dir / ADDRESS_FILE
        if address.exists():
            try:
                old = read_keeper_address(self.run_dir)
                alive = pid_alive(old.pid)
                notes.append(f"the previous keeper (pid {old.pid}, instance {old.instance.hex()}) did not stop "
                             f"cleanly{' (its pid is alive: another process now)' if alive else ''}")
            except TransportError as exc:
                notes.append(f"an unreadable address file was left ({exc.message})")
            address.unlink()
        stale = [n for n in ("gpu-keeper.sock", "gpu-attach.sock", ADDRESS_FILE + ".tmp") if (self.run_dir / n).exists()]
        for n in stale:
            (self.run_dir / n).unlink()
        if stale:
            notes.append(f"removed its stale {', '.join(stale)}")
        if notes:
            self.recovery_note = "; ".join(notes) + "; starting with an empty tier under a new instance id"
            log.warning("%s: %s", COMMAND, self.recovery_note)

    def _allocator(self) -> Callable[[str, int], Allocation]:
        if self._allocate is not None:
            return self._allocate
        if self.config.backing == "memfd":
            return memfd_allocation
        try:
            return vmm_allocator(self.config.gpu)
        except TransferError as exc:  # VmmUnavailable, VmmError
            raise KeeperUnavailable(f"--backing vmm on GPU {self.config.gpu}: {exc}") from exc

    def _connect_hosts(self) -> None:
        cfg = self.config
        for tenant, token in sorted(cfg.host_tokens.items()):
            try:
                self.hosts[tenant] = PoolClient(cfg.host_pool, tenant, token, name=f"{cfg.name}:demoter")
            except (TransportError, PoolTimeout) as exc:
                raise KeeperUnavailable(f"--host-pool {cfg.host_pool}: cannot reach it: {exc}") from exc
            except PoolError as exc:  # Unauthenticated, above all
                raise KeeperUnavailable(f"--host-pool {cfg.host_pool}: tenant {tenant!r} refused: {exc}") from exc

    def start(self) -> KeeperProcess:
        cfg = self.config
        self.run_dir = ensure_private_dir(cfg.run_dir, error=InsecureRunDir)
        self._lock()
        try:
            self._clear_leftovers()
            allocate = self._allocator()
            self._connect_hosts()
            try:
                self.keeper = GpuKeeper(cfg.tier, self.run_dir, allocate, name=cfg.name, ticket_ttl_s=cfg.ticket_ttl_s,
                                        handout_timeout_s=cfg.handout_timeout_s)
            except TransferError as exc:
                raise KeeperUnavailable(f"cannot allocate the tier on GPU {cfg.gpu}: {exc}") from exc
            self.keeper.start()
            self.server = KeeperServer(self.keeper, cfg.tokens, hosts=self.hosts, maintenance_s=cfg.maintenance_s,
                                       hello_timeout_s=cfg.hello_timeout_s, max_clients=cfg.max_clients).start()
            self._write_address()
        except BaseException:
            self.stop()
            raise
        return self

    def address(self) -> KeeperAddress:
        k = self.keeper
        some = next(iter(k.buffers.values()))
        return KeeperAddress(socket=str(self.server.path), attach=str(k.attach_path), pid=os.getpid(),
                             instance=k.instance, gpu=self.config.gpu, backing=self.config.backing,
                             device_uuid=some.device_uuid, page_size=self.config.tier.page_size,
                             tenant_pages=dict(self.config.tier.pages), host_pool=self.config.host_pool,
                             recovery_note=self.recovery_note)

    def _write_address(self) -> None:
        """Atomically: a reader sees the previous file (or none) or this one, never a part."""
        tmp = self.run_dir / (ADDRESS_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.address().to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.run_dir / ADDRESS_FILE)

    # -- stop -------------------------------------------------------------------------------
    def stop(self) -> dict[str, int]:
        """The module docstring's order. Returns what it ended: sessions, quarantined clients."""
        out = {"sessions": 0, "quarantined_clients": 0}
        if self._lock_fd is None:
            return out
        (self.run_dir / ADDRESS_FILE).unlink(missing_ok=True)
        try:
            try:
                if self.server is not None:
                    out["sessions"] = len(self.server.sessions)
                    server, self.server = self.server, None
                    server.stop()  # raises what its maintenance thread raised, if anything
            finally:  # the keeper stops whatever the server raised: heartbeat retired, sockets gone
                if self.keeper is not None:
                    with self.keeper.tier_lock:
                        out["quarantined_clients"] = len(self.keeper.tier.quarantined())
                    keeper, self.keeper = self.keeper, None
                    keeper.stop()
        finally:
            for host in self.hosts.values():
                host.close()
            self.hosts = {}
            os.close(self._lock_fd)  # the lock file stays (removing it would let two keepers lock two files)
            self._lock_fd = None
        return out

    # -- run --------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        """Start, serve until SIGTERM / SIGINT (or request_stop), stop. The signal handlers are
        installed before the start, so a signal during it stops the keeper once it is up."""
        previous = {sig: signal.signal(sig, lambda *_: self._stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            cfg = self.config
            print(f"{COMMAND}: serving GPU {cfg.gpu} ({cfg.backing}), instance {self.keeper.instance.hex()}: "
                  f"{cfg.tier.pages} pages of {cfg.tier.page_size} bytes, control {self.server.path}, run dir "
                  f"{self.run_dir}", file=sys.stderr, flush=True)
            while not self._stop.wait(0.5):
                pass
            ended = self.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        print(f"{COMMAND}: stopped: {ended['sessions']} sessions ended, {ended['quarantined_clients']} producers' "
              f"reservations quarantined with the instance (never committed or reused)", file=sys.stderr, flush=True)
        return 0


def main_keeper(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = config_from_args(args)
        return KeeperProcess(config).run()
    except (KeeperUsage, KeeperAlreadyRunning, InsecureRunDir) as exc:
        print(f"{COMMAND}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeeperUnavailable as exc:
        print(f"{COMMAND}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
