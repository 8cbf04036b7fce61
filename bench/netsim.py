"""A slow network on one machine: N hosts in network namespaces joined by a bridge, links shaped with tbf.

Host i lives in namespace ``{prefix}-h{i}`` with address 10.77.0.{i+1}/24 on a veth pair whose
other end is enslaved to bridge ``br0`` in namespace ``{prefix}-br``. Both directions of every
link are limited to ``rate_mbit`` with a token bucket (tbf) on the egress of each veth end
(host -> bridge and bridge -> host). There is no added delay or loss: netem is missing from
some kernels (the CI machines' among them), so only tbf is used. Only addresses inside the
namespaces this object created carry traffic.

Needs root and ``ip netns``; ``NetSim.available()`` says whether this machine allows it.
Everything is deleted on ``close`` (also on exceptions, via the context manager).
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Optional

SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NetSim:
    def __init__(self, n_hosts: int, rate_mbit: float, prefix: str = "dlx", burst_kbit: Optional[int] = None):
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts must be 1..200, got {n_hosts}")
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        self.n_hosts, self.rate_mbit, self.prefix = n_hosts, rate_mbit, prefix
        # burst: at least one MTU-sized packet per timer tick; ~rate/250 is tbf's usual advice
        self.burst_kbit = burst_kbit or max(32, int(rate_mbit * 1000 / 250))
        self.bridge_ns = f"{prefix}-br"
        self.hosts = [f"{prefix}-h{i}" for i in range(n_hosts)]
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

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

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

    def _shape(self, ns: str, dev: str) -> None:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                        "rate", f"{self.rate_mbit}mbit", "burst", f"{self.burst_kbit}kbit", "latency", "400ms"],
                       check=True, capture_output=True, text=True)

    def _build(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            host_dev, br_dev = f"dlxh{i}", f"dlxb{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", host_dev, "netns", ns, "type", "veth", "peer", "name", br_dev, "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", br_dev, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", host_dev)
            _ip("-n", ns, "link", "set", host_dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._shape(ns, host_dev)             # host -> network
            self._shape(self.bridge_ns, br_dev)   # network -> host

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
        for ns in [*self.hosts, self.bridge_ns]:
            if ns in existing:
                _ip("netns", "del", ns, check=False)
