"""The network simulator shapes links to the asked rate and cleans up after itself."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.netsim import NetSim

ok, why = NetSim.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5599)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    t0 = t0 or time.monotonic(); n += len(b)
print(n, time.monotonic() - t0, flush=True)
"""
SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5599), timeout=30)
s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


@pytest.mark.parametrize("rate_mbit", [10, 100])
def test_link_rate_and_cleanup(rate_mbit):
    nbytes = int(rate_mbit * 1e6 / 8 * 1.5)  # ~1.5 s of traffic at the shaped rate
    with NetSim(2, rate_mbit, prefix=f"dlxt{rate_mbit}") as net:
        receiver = net.popen(1, [sys.executable, "-c", RECEIVER, net.address(1)], stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "ready"
        sent = net.run(0, [sys.executable, "-c", SENDER, net.address(1), str(nbytes)], timeout=60)
        assert sent.returncode == 0, sent.stderr
        got, seconds = receiver.stdout.readline().split()
        receiver.wait(10)
        mbit_s = int(got) * 8 / float(seconds) / 1e6
        assert int(got) == nbytes
        assert 0.7 * rate_mbit < mbit_s < 1.15 * rate_mbit, mbit_s
        hosts = list(net.hosts)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(h in left for h in hosts)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rate_mbit"):
        NetSim(2, 0)
