"""The pool daemon's command: `kvpool serve` (console script) or `python -m kvpool serve`
(kvpool.cli puts it beside `kvpool keeper`; main() here serves alone).

  kvpool serve [--name N] [--run-dir D] [--page-size 128KiB] [--capacity 1GiB | --pages N]
               [--tcp HOST:PORT | none] [--no-unix] [--tenant NAME=TOKEN ...] [--token-file F]
               [admission, load-limit, queue and TTL options]
      runs a pool daemon in the foreground (SIGTERM / SIGINT: a clean stop that removes
      its shared memory); its run directory's address.json says where it listens.
  serve_parser(parser)   adds the serve options to an argparse parser (a wrapper that runs
                         the same daemon with other parts, e.g. a known-bad catalog for a
                         negative control, reuses them)
  config_from_args(args) the PoolConfig those options describe
  tenants_from_args, read_token_file, parse_quotas, parse_size
                         the tenant, token-file, quota and size flags (kvpool keeper takes them too)
With no tenant given, one tenant 'default' is created and its token written (mode 0600)
to the run directory's tokens.json (created or checked first, with every directory above it:
kvpool.pool.private_dir). A bad size or tenant, or a run directory another user can change, is a
usage error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import stat
import sys
from pathlib import Path

from kvpool.pool.catalog import AdmissionPolicy, LoadLimits
from kvpool.pool.private_dir import ensure_private_dir
from kvpool.pool.config import PoolConfig, default_run_dir
from kvpool.pool.daemon import InsecureRunDir, main_serve

_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text: str) -> int:
    """'128KiB', '1GiB', '64k', '4096' -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in _UNITS:
            return int(float(t[:-1]) * _UNITS[t[-1]])
        return int(t)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 128KiB, 1GiB, 4096)") from exc


def read_token_file(token_file: Path, command: str = "kvpool serve", flag: str = "--token-file") -> dict[str, str]:
    """A JSON object tenant -> token; a file that cannot be read or is not one is a usage error
    (exit 2, naming the file)."""
    try:
        tokens = json.loads(token_file.read_text())
    except (OSError, ValueError) as exc:
        print(f"{command}: {flag} {token_file}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if not isinstance(tokens, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v
                                               for k, v in tokens.items()):
        print(f"{command}: {flag} {token_file}: not a JSON object of tenant names to tokens", file=sys.stderr)
        raise SystemExit(2)
    return tokens


def tenants_from_args(pairs: list[str], token_file: Path | None, run_dir: Path,
                      command: str = "kvpool serve") -> dict[str, str]:
    """The tenants of --tenant NAME=TOKEN and --token-file; with none, one tenant 'default' whose
    token is written (0600) to the run directory's tokens.json (the run directory checked first)."""
    tenants: dict[str, str] = {}
    if token_file is not None:
        tenants.update(read_token_file(token_file, command))
    for pair in pairs:
        name, sep, token = pair.partition("=")
        if not sep or not name or not token:
            print(f"{command}: --tenant takes NAME=TOKEN, got {pair!r}", file=sys.stderr)
            raise SystemExit(2)
        tenants[name] = token
    if not tenants:
        try:  # the token is only as private as every directory above it
            run_dir = ensure_private_dir(run_dir, error=InsecureRunDir)
        except InsecureRunDir as exc:
            print(f"{command}: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc
        path = run_dir / "tokens.json"
        tenants = {"default": secrets.token_hex(16)}
        try:  # created once: a restart (or a second instance refused later) keeps its clients' token
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            tenants = _existing_tokens(path, command)
            print(f"{command}: no tenant given; the tokens of {path} are kept", file=sys.stderr)
            return tenants
        with os.fdopen(fd, "w") as f:
            json.dump(tenants, f)
        print(f"{command}: no tenant given; token of tenant 'default' written to {path}", file=sys.stderr)
    return tenants


def _existing_tokens(path: Path, command: str) -> dict[str, str]:
    """The tokens an earlier start wrote to the (private) run directory: a regular file of this
    user's, readable by nobody else, holding a JSON object of tenants to tokens; else exit 2
    naming the file (never overwritten: an operator removes it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        print(f"{command}: {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            print(f"{command}: {path}: not a private file of this user (mode {oct(st.st_mode & 0o777)}, "
                  f"uid {st.st_uid}): remove it or name the tenants", file=sys.stderr)
            raise SystemExit(2)
    return read_token_file(path, command, flag="tokens file")


def serve_parser(serve: argparse.ArgumentParser) -> argparse.ArgumentParser:
    serve.add_argument("--name", default="kvgate-pool", help="the pool's name (run dir, segment labels)")
    serve.add_argument("--run-dir", type=Path, default=None, help="pid file, socket and address.json")
    serve.add_argument("--page-size", type=parse_size, default="64KiB", help="bytes per page (one KV block)")
    serve.add_argument("--capacity", type=parse_size, default="256MiB",
                       help="pages of all tenants' segments together (rounded down to whole pages)")
    serve.add_argument("--pages", type=int, default=0, help="number of pages (overrides --capacity)")
    serve.add_argument("--tcp", default="127.0.0.1:0", help="HOST:PORT to listen on, or 'none'")
    serve.add_argument("--no-unix", action="store_true", help="do not listen on a Unix socket")
    serve.add_argument("--tenant", action="append", default=[], metavar="NAME=TOKEN")
    serve.add_argument("--token-file", type=Path, default=None, help="JSON object tenant -> token")
    serve.add_argument("--min-blocks", type=int, default=1, help="admission: shortest publish")
    serve.add_argument("--second-hit", action="store_true", help="admission: publish a block on its second offer")
    serve.add_argument("--max-loads-per-client", type=int, default=0, help="concurrent leases per client (0: no limit)")
    serve.add_argument("--max-loads", type=int, default=0, help="concurrent leases in all (0: no limit)")
    serve.add_argument("--max-clients", type=int, default=256)
    serve.add_argument("--max-queue", type=int, default=64)
    serve.add_argument("--reservation-ttl", type=float, default=30.0, help="seconds before an open publish is reclaimed")
    serve.add_argument("--lease-ttl", type=float, default=60.0, help="seconds before an unreleased lease expires")
    serve.add_argument("--reservation-max", type=float, default=3600.0,
                       help="seconds a publish may stay open however often its client renews it")
    serve.add_argument("--lease-max", type=float, default=3600.0,
                       help="seconds a lease may be held however often its client renews it")
    serve.add_argument("--max-lookup-wait", type=float, default=2.0,
                       help="seconds a lookup may wait for a publish in flight, at most (whatever the client asks)")
    serve.add_argument("--admin", action="append", default=[], metavar="TENANT",
                       help="a tenant allowed the pool-wide operations (capacity, stats, metrics); by default the "
                            "only tenant of a single-tenant pool")
    serve.add_argument("--quota", action="append", default=[], metavar="TENANT=PAGES",
                       help="pages of a tenant's own segment; the tenants without one share the rest evenly")
    serve.add_argument("--trust-commits", action="store_true",
                       help="commit xxh3-128 pages without re-hashing them (their loaders verify every page; "
                            "the scrub re-takes them at rest), as kv-sketch-1 pages always are")
    serve.add_argument("--scrub-interval", type=float, default=0.05,
                       help="seconds between the scrub's rounds (each tenant segment, each round: the fresh "
                            "pages, then the pass at rest)")
    serve.add_argument("--scrub-fresh-pages", type=int, default=16,
                       help="per round: commits taken on trust, first scrub (default 320 pages/s)")
    serve.add_argument("--scrub-rest-rate", type=parse_size, default="8MiB",
                       help="bytes per second of the cyclic pass at rest over every committed page of every "
                            "digest kind, per tenant segment (at least one page a round)")
    serve.add_argument("--scrub-rest-pages", type=int, default=None,
                       help="per round: pages of the pass at rest (overrides --scrub-rest-rate); 0: no pass")
    serve.add_argument("--heartbeat-s", type=float, default=0.02,
                       help="seconds between the daemon's heartbeats in each segment (same-host clients probe its "
                            "index without a round trip only while the heartbeat is fresh); 0: none")
    serve.add_argument("--metrics", default="", metavar="HOST:PORT",
                       help="serve the pool's Prometheus metrics over HTTP (GET /metrics) there; port 0 picks one "
                            "(address.json says which)")
    serve.add_argument("--dumpable", action="store_true",
                       help="leave the daemon ptrace-able and its /proc/PID/fd open to its own user (debugging; "
                            "by default it is not, so that no tenant's client can take another's segment from it)")
    serve.add_argument("--hello-timeout", type=float, default=5.0,
                       help="seconds a connection may take to authenticate before it is closed")
    serve.add_argument("--max-hello-frame", type=int, default=4096,
                       help="largest frame accepted before a successful hello (bytes)")
    serve.add_argument("--max-unauthenticated", type=int, default=64,
                       help="connections awaiting their hello, at most (a new one closes the oldest)")
    return serve


def config_from_args(args: argparse.Namespace) -> PoolConfig:
    run_dir = args.run_dir or default_run_dir(args.name)
    host, port = None, 0
    if args.tcp != "none":
        host, _, p = args.tcp.rpartition(":")
        port = int(p)
    page_size = args.page_size
    num_pages = args.pages if args.pages else max(1, args.capacity // page_size)
    return PoolConfig(
        name=args.name, page_size=page_size, num_pages=num_pages, run_dir=run_dir,
        unix_socket=not args.no_unix, tcp_host=host, tcp_port=port,
        tenants=tenants_from_args(args.tenant, args.token_file, run_dir),
        max_clients=args.max_clients, max_queue=args.max_queue,
        admission=AdmissionPolicy(min_blocks=args.min_blocks, second_hit=args.second_hit),
        limits=LoadLimits(per_client=args.max_loads_per_client, total=args.max_loads),
        reservation_ttl_s=args.reservation_ttl, lease_ttl_s=args.lease_ttl,
        reservation_max_s=args.reservation_max, lease_max_s=args.lease_max, max_lookup_wait_s=args.max_lookup_wait,
        hello_timeout_s=args.hello_timeout, max_hello_frame=args.max_hello_frame,
        max_unauthenticated=args.max_unauthenticated, admins=frozenset(args.admin), quotas=parse_quotas(args.quota),
        verify_commits=not args.trust_commits, heartbeat_s=args.heartbeat_s, metrics_addr=args.metrics,
        scrub_interval_s=args.scrub_interval, scrub_pages_per_round=args.scrub_fresh_pages,
        scrub_rest_pages_per_round=args.scrub_rest_pages, scrub_rest_bytes_per_s=args.scrub_rest_rate,
    )


def parse_quotas(pairs: list[str], command: str = "kvpool serve") -> dict[str, int]:
    quotas: dict[str, int] = {}
    for pair in pairs:
        name, sep, pages = pair.partition("=")
        if not sep or not name or not pages.isdigit():
            print(f"{command}: --quota {pair!r} is not TENANT=PAGES", file=sys.stderr)
            raise SystemExit(2)
        quotas[name] = int(pages)
    return quotas


def serve(args: argparse.Namespace, catalog_factory=None) -> int:  # noqa: ANN001 - a Catalog class
    config = config_from_args(args)
    print(f"kvpool: serving {config.name!r}: {config.num_pages} pages of {config.page_size} bytes "
          f"({config.num_pages * config.page_size / 2**20:.1f} MiB), run dir {config.run_dir}", file=sys.stderr,
          flush=True)
    return main_serve(config, catalog_factory=catalog_factory, dumpable=args.dumpable)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="kvpool: a shared host-memory pool of KV blocks")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub.add_parser("serve", help="run a pool daemon in the foreground"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
