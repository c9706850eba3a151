"""Hosts on one machine: each a Linux network namespace with an address of its own, joined
to a bridge in the harness's namespace by a veth pair. A process started in a host (a
pool daemon, a vLLM replica, a store's server) sees only that host's interfaces; hosts
reach each other, and the harness reaches all of them, through the bridge. Shared memory
and the file system stay shared (a host's pool daemon is still reached by its Unix
socket), so what separates hosts is the network, which is what the faults act on.

  Network(hosts, run_dir).start()
        a bridge and one namespace per host (names carry a run token: concurrent runs do
        not collide); the subnet is a free 10.x.y.0/24
  net.ip(host)          the host's address
  net.prefix(host)      the argv prefix that runs a command in the host (ip netns exec ...)
  net.slow(host, rate)  the host's link limited to `rate` (tc tbf, e.g. "8mbit") both ways:
                        a slow link, or a degraded storage node
  net.partition(host)   the host's link down: its packets vanish, connections to it hang
                        until their own timeouts (a partition, not a refusal)
  net.heal(host)        the link back up, unlimited
  net.stop()            every namespace and link removed (the processes in them must be
                        stopped first); safe to call twice
  netns_unavailable()   None where namespaces can be made here, else why not (tests skip)

Every action is written to the run's history (`nemesis` events) by the caller's recorder.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable


class NetworkError(RuntimeError):
    """A namespace, link or qdisc could not be set up or changed (the command's stderr)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise NetworkError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def netns_unavailable() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed (make servers installs it)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"kvgprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if done.returncode:
        return f"cannot create a network namespace here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(250)}.0/24")
        if f" {'.'.join(str(net.network_address).split('.')[:3])}." not in used:
            return net
    raise NetworkError("no free 10.x.y.0/24 subnet")


class Network:
    def __init__(self, hosts: list[str] | tuple[str, ...], record: Callable[..., None] | None = None):
        if len(set(hosts)) != len(hosts) or not hosts or len(hosts) > 200:
            raise ValueError(f"hosts must be distinct names, 1 to 200 of them: {hosts}")
        self.hosts = list(hosts)
        self.token = secrets.token_hex(3)
        self.bridge = f"kvb{self.token}"
        self.subnet: ipaddress.IPv4Network | None = None
        self._record = record or (lambda action, **fields: None)
        self._made: list[str] = []  # namespaces made so far
        self._links: list[str] = []  # root-side veth ends made so far
        self.started = False

    def ns(self, host: str) -> str:
        return f"kvgate-{self.token}-{host}"

    def _peer(self, host: str) -> str:  # the host's link, its end at the bridge (15 bytes at most)
        return f"kv{self.token}{self.hosts.index(host):02d}"

    def ip(self, host: str) -> str:
        return str(self.subnet.network_address + 1 + self.hosts.index(host))

    @property
    def gateway(self) -> str:  # the bridge's (the harness's) address on the hosts' subnet
        return str(self.subnet.network_address + 254)

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def run(self, host: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([*self.prefix(host), *args], capture_output=True, text=True, timeout=30)
        if check and done.returncode:
            raise NetworkError(f"{host}: {' '.join(args)}: {done.stderr.strip()}")
        return done

    def start(self) -> Network:
        self.subnet = _free_subnet()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._links.append(self.bridge)
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                ns, peer = self.ns(host), self._peer(host)
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._links.append(peer)
                _ip("link", "set", peer, "master", self.bridge)
                _ip("link", "set", peer, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        except BaseException:
            self.stop()
            raise
        self.started = True
        self._record("network_start", hosts={h: self.ip(h) for h in self.hosts}, bridge=self.bridge)
        return self

    # -- faults on a host's link --------------------------------------------------------------
    def slow(self, host: str, rate: str = "8mbit", burst: str = "32kb", latency_ms: int = 200) -> None:
        """Both directions of the host's link through a token bucket of `rate`."""
        for where in (["tc"], [*self.prefix(host), "tc"]):
            dev = self._peer(host) if where == ["tc"] else "eth0"
            done = subprocess.run([*where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                                   "burst", burst, "latency", f"{latency_ms}ms"],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode:
                raise NetworkError(f"tc tbf on {host}'s {dev}: {done.stderr.strip()}")
        self._record("link_slow", host=host, rate=rate)

    def partition(self, host: str) -> None:
        _ip("link", "set", self._peer(host), "down")
        self._record("link_partition", host=host)

    def heal(self, host: str) -> None:
        _ip("link", "set", self._peer(host), "up")
        for where, dev in ((["tc"], self._peer(host)), ([*self.prefix(host), "tc"], "eth0")):
            subprocess.run([*where, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
        self._record("link_heal", host=host)

    def stop(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        for link in reversed(self._links):  # a veth goes with its namespace's end; the bridge stays
            _ip("link", "del", link, check=False)
        self._made, self._links = [], []
        if self.started:
            self._record("network_stop", bridge=self.bridge)
        self.started = False

    def leftovers(self) -> list[str]:
        """Namespaces or links of this network that still exist (stop() must leave none)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        links = _ip("-o", "link").stdout
        return [n for n in (self.ns(h) for h in self.hosts) if n in names] + \
            [x for x in (self.bridge, *(self._peer(h) for h in self.hosts)) if f": {x}" in links or f": {x}@" in links]

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

