"""A slow network on one machine: N hosts in network namespaces joined by a bridge, links shaped with tbf.

Host i lives in namespace ``{prefix}-h{i}`` with address 10.77.0.{i+1}/24 on a veth pair whose
other end is enslaved to bridge ``br0`` in namespace ``{prefix}-br``. Both directions of every
link are limited to ``rate_mbit`` with a token bucket (tbf) on the egress of each veth end
(host -> bridge and bridge -> host). There is no loss, and no added delay unless ``delay_ms`` is given
(below): netem is missing from some kernels (the CI machines' among them), so only tbf is used. Only
addresses inside the namespaces this object created carry traffic.

Hosts listed in ``nat`` sit behind a router of their own, as volunteers at home do: host i is then
10.78.{i}.2/24 in ``{prefix}-h{i}``, with its default route via router namespace ``{prefix}-r{i}``
(10.78.{i}.1 inside, 10.77.0.{i+1} on the bridge), which forwards and masquerades (nftables) what
leaves it. Such a host reaches every public host; nobody can connect to it, and two NAT'd hosts
cannot connect to each other. The shaped link is the router's (bridge side and router side).

Latency: ``delay_ms`` > 0 (one way, per host egress, plus ``jitter_ms`` uniform either side) adds a userspace
delay line (tests/harness/delayline.py) to every host, since netem is missing. In host i's namespace two TUN devices
``dlxd{i}`` and ``dlxe{i}`` are added and the host's own routes (its /24, the address given ``noprefixroute``;
behind a NAT also the default route) point into ``dlxd{i}``; one ``delayline.py`` process per host, started
in its namespace, reads what the host sends there and writes it into ``dlxe{i}`` after the delay, in the
order it came (no reordering: see delayline.py). A packet received on ``dlxe{i}`` is looked up in routing
table 100 (``ip rule iif dlxe{i} lookup 100``), which holds the same routes through the veth, and forwarded
(forwarding, accept_local and rp_filter=0 on ``dlxe{i}`` only: the packets carry the host's own address)::

    socket -> dlxd{i} (TUN) -> delayline.py -> dlxe{i} (TUN) -> forward, table 100 -> dlxh{i} [tbf] -> bridge
           -> dlxb{j} [tbf] -> dlxh{j} -> host j's socket

So the delay comes before the shaping (a packet delayed, then queued behind the link's rate, as behind a slow
uplink); tbf shapes both directions as without delay. What a host receives is not delayed by it (its sender's
delay line did that), so the RTT between two hosts is 2 x ``delay_ms`` (plus jitter and queueing). TCP's GSO
super-packets cross the delay line whole (IFF_VNET_HDR with TSO offloads), so one Python process carries a
1000 Mbit/s link (measured: ~950 Mbit/s of bulk TCP at ~10% of a core; ``python -m tests.harness.delayline
--selftest``). The delay lines are stopped (SIGTERM, then SIGKILL) on ``close``; ``delay_available()`` says
whether TUN devices can be made here. With ``delay_ms`` == 0 (the default) none of this is built.

Needs root and ``ip netns``; ``NetSim.available()`` says whether this machine allows it (and
``nat_available()`` whether ``nft`` is installed too).
Everything is deleted on ``close`` (also on exceptions, via the context manager).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

SUBNET = "10.77.0"
NAT_SUBNET = "10.78"  # 10.78.{i}.0/24: behind host i's router
DELAYLINE = str(Path(__file__).with_name("delayline.py"))
DELAY_TABLE = "100"  # the routing table of packets that leave a delay line


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NetSim:
    def __init__(self, n_hosts: int, rate_mbit: float, prefix: str = "dlx", burst_kbit: Optional[int] = None,
                 nat: Sequence[int] = (), host_rates: Optional[dict[int, float]] = None,
                 sysctls: Optional[dict[str, str]] = None, delay_ms: float = 0.0, jitter_ms: float = 0.0,
                 delay_seed: int = 0, delay_offload: bool = True):
        """``nat``: indices of the hosts that sit behind a NAT router each (module docstring); ``host_rates``:
        host index -> its link's rate in Mbit/s, where it differs from ``rate_mbit``; ``sysctls``: set in
        every host's namespace (e.g. net.ipv4.tcp_notsent_lowat); ``delay_ms``, ``jitter_ms``: one-way delay
        added to every host's egress, and its uniform jitter either side (module docstring; RTT between two
        hosts: 2 x ``delay_ms``), drawn with seed ``delay_seed`` + host index; ``delay_offload``: False to
        pass single segments through the delay lines instead of TCP's GSO super-packets (slower)."""
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
        if not (delay_ms >= 0 and jitter_ms >= 0):
            raise ValueError(f"delay_ms and jitter_ms must be >= 0, got {delay_ms}, {jitter_ms}")
        if jitter_ms > delay_ms:
            raise ValueError(f"jitter_ms must be <= delay_ms, got {jitter_ms} > {delay_ms}")
        self.delay_ms, self.jitter_ms = float(delay_ms), float(jitter_ms)
        self.delay_seed, self.delay_offload = delay_seed, delay_offload
        self.n_hosts, self.rate_mbit, self.prefix = n_hosts, rate_mbit, prefix
        # burst: at least one MTU-sized packet per timer tick; ~rate/250 is tbf's usual advice
        self.burst_kbit = burst_kbit  # None: from each link's rate
        self.bridge_ns = f"{prefix}-br"
        self.hosts = [f"{prefix}-h{i}" for i in range(n_hosts)]
        self.nat = sorted(set(nat))
        self.routers = {i: f"{prefix}-r{i}" for i in self.nat}
        self._procs: list[subprocess.Popen] = []
        self._delay_procs: list[subprocess.Popen] = []

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

    @staticmethod
    def delay_available() -> tuple[bool, str]:
        """(True, "") if hosts with ``delay_ms`` can be made here: namespaces and TUN devices (/dev/net/tun)."""
        ok, why = NetSim.available()
        if not ok:
            return ok, why
        if not os.path.exists("/dev/net/tun"):
            return False, "/dev/net/tun is missing (no TUN devices)"
        probe = f"dlxprobe{os.getpid()}"
        _ip("netns", "add", probe)
        try:
            done = _ip("-n", probe, "tuntap", "add", "dev", "dlxprobe", "mode", "tun", "vnet_hdr", check=False)
        finally:
            _ip("netns", "del", probe, check=False)
        if done.returncode != 0:
            return False, f"TUN devices cannot be made: {done.stderr.strip()}"
        return True, ""

    def delay_pids(self) -> list[int]:
        """The delay lines' process ids, host 0's first (empty without ``delay_ms``)."""
        return [p.pid for p in self._delay_procs]

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
            # with a delay line, the host's own route goes through it (_add_delay_line) instead
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", host_dev, *self._noprefixroute())
            _ip("-n", ns, "link", "set", host_dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._shape(ns, host_dev, i)             # host -> network
            for key, value in self.sysctls.items():
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"], check=True,
                               capture_output=True, text=True)
            self._shape(self.bridge_ns, br_dev, i)   # network -> host
            if self.delay_ms > 0:
                self._add_delay_line(i, ns, host_dev, [(f"{SUBNET}.0/24", None)])

    def _build_nat(self, i: int, ns: str) -> None:
        router, out_dev, br_dev, host_dev, in_dev = self.routers[i], f"dlxr{i}", f"dlxb{i}", f"dlxh{i}", f"dlxp{i}"
        _ip("netns", "add", router)
        _ip("netns", "add", ns)
        _ip("link", "add", out_dev, "netns", router, "type", "veth", "peer", "name", br_dev, "netns", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", br_dev, "master", "br0", "up")
        _ip("-n", router, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", out_dev)
        _ip("link", "add", host_dev, "netns", ns, "type", "veth", "peer", "name", in_dev, "netns", router)
        _ip("-n", router, "addr", "add", f"{NAT_SUBNET}.{i}.1/24", "dev", in_dev)
        _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", host_dev, *self._noprefixroute())
        for where, dev in ((router, out_dev), (router, in_dev), (router, "lo"), (ns, host_dev), (ns, "lo")):
            _ip("-n", where, "link", "set", dev, "up")
        if self.delay_ms > 0:  # the NAT'd host's egress is delayed before its router
            self._add_delay_line(i, ns, host_dev, [(f"{NAT_SUBNET}.{i}.0/24", None),
                                                   ("default", f"{NAT_SUBNET}.{i}.1")])
        else:
            _ip("-n", ns, "route", "add", "default", "via", f"{NAT_SUBNET}.{i}.1")
        for cmd in (["sysctl", "-qw", "net.ipv4.ip_forward=1"], ["nft", "add", "table", "ip", "nat"],
                    ["nft", "add chain ip nat post { type nat hook postrouting priority 100 ; }"],
                    ["nft", "add", "rule", "ip", "nat", "post", "oifname", out_dev, "masquerade"]):
            subprocess.run(["ip", "netns", "exec", router, *cmd], check=True, capture_output=True, text=True)
        self._shape(router, out_dev, i)          # router -> network
        self._shape(self.bridge_ns, br_dev, i)   # network -> router

    def _noprefixroute(self) -> list[str]:
        return ["noprefixroute"] if self.delay_ms > 0 else []

    def _add_delay_line(self, i: int, ns: str, host_dev: str, routes: list[tuple[str, Optional[str]]]) -> None:
        """Host i's egress through a delay line (module docstring): ``routes`` (destination, gateway or None)
        point into TUN ``dlxd{i}`` in the main table and out of ``host_dev`` in table 100, for what leaves
        ``dlxe{i}``."""
        tun_in, tun_out, addr = f"dlxd{i}", f"dlxe{i}", self.address(i)
        argv = [sys.executable, DELAYLINE, "--in", tun_in, "--out", tun_out, "--delay-ms", repr(self.delay_ms),
                "--jitter-ms", repr(self.jitter_ms), "--seed", str(self.delay_seed + i)]
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv, *([] if self.delay_offload else ["--no-offload"])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._delay_procs.append(proc)
        ready = select.select([proc.stdout], [], [], 15)[0] and proc.stdout.readline().strip() == "ready"
        if not ready:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate(timeout=10)
            raise RuntimeError(f"host {i}'s delay line did not start: {err.strip()[-2000:]}")
        for key in ("forwarding=1", "accept_local=1", "rp_filter=0"):  # it sends the host's own address onwards
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.{tun_out}.{key}"],
                           check=True, capture_output=True, text=True)
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"], check=True,
                       capture_output=True, text=True)
        for dev in (tun_in, tun_out):  # no IPv6 chatter (router solicitations, MLD) into the delay line
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1"],
                           capture_output=True, text=True)
            _ip("-n", ns, "link", "set", dev, "txqueuelen", "1000", "up")
        for dest, via in routes:
            _ip("-n", ns, "route", "add", dest, "dev", tun_in, "src", addr)
            _ip("-n", ns, "route", "add", dest, *(["via", via] if via else []), "dev", host_dev,
                "table", DELAY_TABLE)
        _ip("-n", ns, "rule", "add", "iif", tun_out, "lookup", DELAY_TABLE, "pref", DELAY_TABLE)

    def _stop_delay_lines(self) -> None:
        for proc in self._delay_procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._delay_procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self._delay_procs.clear()

    def namespace(self, i: int) -> str:
        """Host i's network namespace: where a forked node enters (``LocalNode(..., forked=True, netns=...)``)."""
        return self.hosts[i]

    def wrapper(self, i: int) -> list[str]:
        """Command prefix that runs a program inside host i."""
        return ["ip", "netns", "exec", self.hosts[i]]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host i (own process group; killed on close)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[i], *argv], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def sent_bytes(self) -> dict[int, int]:
        """host -> bytes its interface has sent, for every host on the bridge (not behind a NAT router), in one
        read: the bridge-side end of a host's veth pair receives exactly what the host's end sends."""
        links = json.loads(_ip("-n", self.bridge_ns, "-s", "-j", "link", "show").stdout)
        by_name = {link["ifname"]: link["stats64"]["rx"]["bytes"] for link in links}
        return {i: by_name[f"dlxb{i}"] for i in range(len(self.hosts)) if f"dlxb{i}" in by_name}

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
        self._stop_delay_lines()
        existing = _ip("netns", "list", check=False).stdout.split()
        for ns in [*self.hosts, *self.routers.values(), self.bridge_ns]:
            if ns in existing:
                _ip("netns", "del", ns, check=False)
