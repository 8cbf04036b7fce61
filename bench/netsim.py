"""A slow network on one machine: N hosts in network namespaces joined by a bridge, links shaped with tbf.

Host i lives in namespace ``{prefix}-h{i}`` with address 10.77.0.{i+1}/24 on a veth pair whose
other end is enslaved to bridge ``br0`` in namespace ``{prefix}-br``. Both directions of every
link are limited to ``rate_mbit`` with a token bucket (tbf) on the egress of each veth end
(host -> bridge and bridge -> host). There is no added delay or loss: netem is missing from
some kernels (the CI machines' among them), so only tbf is used. Only addresses inside the
namespaces this object created carry traffic.

Hosts listed in ``nat`` sit behind a router of their own, as volunteers at home do: host i is then
10.78.{i}.2/24 in ``{prefix}-h{i}``, with its default route via router namespace ``{prefix}-r{i}``
(10.78.{i}.1 inside, 10.77.0.{i+1} on the bridge), which forwards and masquerades (nftables) what
leaves it. Such a host reaches every public host; nobody can connect to it, and two NAT'd hosts
cannot connect to each other. The shaped link is the router's (bridge side and router side).

Needs root and ``ip netns``; ``NetSim.available()`` says whether this machine allows it (and
``nat_available()`` whether ``nft`` is installed too).
Everything is deleted on ``close`` (also on exceptions, via the context manager).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Optional, Sequence

SUBNET = "10.77.0"
NAT_SUBNET = "10.78"  # 10.78.{i}.0/24: behind host i's router


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NetSim:
    def __init__(self, n_hosts: int, rate_mbit: float, prefix: str = "dlx", burst_kbit: Optional[int] = None,
                 nat: Sequence[int] = (), host_rates: Optional[dict[int, float]] = None,
                 sysctls: Optional[dict[str, str]] = None):
        """``nat``: indices of the hosts that sit behind a NAT router each (module docstring); ``host_rates``:
        host index -> its link's rate in Mbit/s, where it differs from ``rate_mbit``; ``sysctls``: set in
        every host's namespace (e.g. net.ipv4.tcp_notsent_lowat)."""
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts must be 1..200, got {n_hosts}")
        if any(not 0 <= i < n_hosts for i in nat):
            raise ValueError(f"nat: host indices must be in 0..{n_hosts - 1}, got {list(nat)}")
        self.host_rates, self.sysctls = dict(host_rates or {}), dict(sysctls or {})
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        if any(r <= 0 for r in self.host_rates.values()):
            raise ValueError(f"host_rates must be positive, got {self.host_rates}")
        if any(not 0 <= i < n_hosts for i in self.host_rates):
            raise ValueError(f"host_rates: host indices must be in 0..{n_hosts - 1}, got {list(self.host_rates)}")
        self.n_hosts, self.rate_mbit, self.prefix = n_hosts, rate_mbit, prefix
        # burst: at least one MTU-sized packet per timer tick; ~rate/250 is tbf's usual advice
        self.burst_kbit = burst_kbit  # None: from each link's rate
        self.bridge_ns = f"{prefix}-br"
        self.hosts = [f"{prefix}-h{i}" for i in range(n_hosts)]
        self.nat = sorted(set(nat))
        self.routers = {i: f"{prefix}-r{i}" for i in self.nat}
        self._procs: list[subprocess.Popen] = []

    @staticmethod
    def available() -> tuple[bool, str]:
        """(True, "") if namespaces can be created here, else (False, reason)."""
        if os.geteuid() != 0:
            return False, "network namespaces need root"
        probe = f"dlxprobe{os.getpid()}"
        try:
            done = _ip("netns", "add", probe, check=False)
        except FileNotFoundError:
            return False, "iproute2 (ip) is not installed"
        if done.returncode != 0:
            return False, f"'ip netns add' is not permitted: {done.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return True, ""

    @staticmethod
    def nat_available() -> tuple[bool, str]:
        """(True, "") if NAT'd hosts can be made here: namespaces and nftables's ``nft``."""
        ok, why = NetSim.available()
        if ok and shutil.which("nft") is None:
            return False, "nftables (nft) is not installed"
        return ok, why

    def address(self, i: int) -> str:
        """Host i's own address (a private one behind its router for a NAT'd host)."""
        return f"{NAT_SUBNET}.{i}.2" if i in self.routers else f"{SUBNET}.{i + 1}"

    def __enter__(self) -> "NetSim":
        self.close()  # leftovers of a crashed run with the same prefix
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _shape(self, ns: str, dev: str, i: int, op: str = "add") -> None:
        """tbf on ``dev`` at host i's rate (``op``: tc's add, or change in place)."""
        rate = self.host_rates.get(i, self.rate_mbit)
        burst = self.burst_kbit or max(32, int(rate * 1000 / 250))
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", op, "dev", dev, "root", "tbf",
                        "rate", f"{rate}mbit", "burst", f"{burst}kbit", "latency", "400ms"],
                       check=True, capture_output=True, text=True)

    def set_rate(self, i: int, rate_mbit: float) -> None:
        """Change host i's link rate, both directions, while it carries traffic (tc's ``change`` of its tbf:
        queued packets stay; a volunteer's uplink that another program starts to share)."""
        if not 0 <= i < self.n_hosts:
            raise ValueError(f"host index must be in 0..{self.n_hosts - 1}, got {i}")
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        self.host_rates[i] = rate_mbit
        near = (self.routers[i], f"dlxr{i}") if i in self.routers else (self.hosts[i], f"dlxh{i}")
        for ns, dev in (near, (self.bridge_ns, f"dlxb{i}")):
            self._shape(ns, dev, i, op="change")

    def _build(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            if i in self.routers:
                self._build_nat(i, ns)
                continue
            host_dev, br_dev = f"dlxh{i}", f"dlxb{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", host_dev, "netns", ns, "type", "veth", "peer", "name", br_dev, "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", br_dev, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", host_dev)
            _ip("-n", ns, "link", "set", host_dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._shape(ns, host_dev, i)             # host -> network
            for key, value in self.sysctls.items():
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"], check=True,
                               capture_output=True, text=True)
            self._shape(self.bridge_ns, br_dev, i)   # network -> host

    def _build_nat(self, i: int, ns: str) -> None:
        router, out_dev, br_dev, host_dev, in_dev = self.routers[i], f"dlxr{i}", f"dlxb{i}", f"dlxh{i}", f"dlxp{i}"
        _ip("netns", "add", router)
        _ip("netns", "add", ns)
        _ip("link", "add", out_dev, "netns", router, "type", "veth", "peer", "name", br_dev, "netns", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", br_dev, "master", "br0", "up")
        _ip("-n", router, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", out_dev)
        _ip("link", "add", host_dev, "netns", ns, "type", "veth", "peer", "name", in_dev, "netns", router)
        _ip("-n", router, "addr", "add", f"{NAT_SUBNET}.{i}.1/24", "dev", in_dev)
        _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", host_dev)
        for where, dev in ((router, out_dev), (router, in_dev), (router, "lo"), (ns, host_dev), (ns, "lo")):
            _ip("-n", where, "link", "set", dev, "up")
        _ip("-n", ns, "route", "add", "default", "via", f"{NAT_SUBNET}.{i}.1")
        for cmd in (["sysctl", "-qw", "net.ipv4.ip_forward=1"], ["nft", "add", "table", "ip", "nat"],
                    ["nft", "add chain ip nat post { type nat hook postrouting priority 100 ; }"],
                    ["nft", "add", "rule", "ip", "nat", "post", "oifname", out_dev, "masquerade"]):
            subprocess.run(["ip", "netns", "exec", router, *cmd], check=True, capture_output=True, text=True)
        self._shape(router, out_dev, i)          # router -> network
        self._shape(self.bridge_ns, br_dev, i)   # network -> router

    def wrapper(self, i: int) -> list[str]:
        """Command prefix that runs a program inside host i."""
        return ["ip", "netns", "exec", self.hosts[i]]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host i (own process group; killed on close)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[i], *argv], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.hosts[i], *argv], capture_output=True, text=True,
                              timeout=timeout)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self._procs.clear()
        existing = _ip("netns", "list", check=False).stdout.split()
        for ns in [*self.hosts, *self.routers.values(), self.bridge_ns]:
            if ns in existing:
                _ip("netns", "del", ns, check=False)
