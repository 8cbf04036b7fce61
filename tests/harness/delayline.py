"""A userspace delay line between two TUN devices: latency with jitter where the kernel has no netem.

Run inside a network namespace (tests/harness/netsim.py starts one per host when ``delay_ms`` > 0)::

    ip netns exec NS python tests/harness/delayline.py --in dlxd0 --out dlxe0 --delay-ms 25 --jitter-ms 5 --seed 1

It creates (or attaches to) TUN devices ``--in`` and ``--out``, prints ``ready`` once both exist, then reads
every IP packet the kernel routes into ``--in`` and writes it to ``--out`` (where it arrives as if received
from a wire) ``delay_ms + uniform(-jitter_ms, +jitter_ms)`` later, the jitter drawn from ``random.Random(seed)``.
It runs until killed; SIGTERM (or SIGINT) ends it cleanly, dropping what it still holds.

**No reordering.** A packet's release time is ``max(previous packet's release time, arrival + sampled delay)``,
so packets leave in the order they came: TCP sees a jittered RTT but never out-of-order segments (which it would
answer with duplicate ACKs and spurious fast retransmits, as netem's jitter without a rate does). The cost: under
a steady stream whose packets are closer together than the jitter range, a packet waits for the slowest sample
before it, so bulk traffic sees delays near ``delay_ms + jitter_ms`` while sparse exchanges (an RPC, a ping-pong)
see the whole uniform spread. The packets are held in a FIFO (a deque), as their release times never decrease.

**Offloads.** The devices are opened with IFF_VNET_HDR and TUNSETOFFLOAD (CSUM, TSO4, TSO6, TSO_ECN), so TCP hands
the ``--in`` device its GSO super-packets (up to 64 KB, one per ~1 ms of the flow's pacing rate) whole: one read,
one jitter sample and one write per super-packet instead of per 1500-byte segment. The 10-byte virtio_net_hdr
before each packet (GSO type and size, checksum offsets) is passed through unchanged, and the kernel segments (or
the next device takes the super-packet as it is) after ``--out``. ``--no-offload`` turns this off (plain
per-segment packets, for comparison). Writing to a TUN device runs the receive path (routing, forwarding, the
next qdisc) in the writer's own system call, so this process's CPU time includes that kernel work.

At most ``--limit-mb`` MB are held (tail drop beyond: a delay line is no buffer); reads are batched (up to 64
packets per wake-up) and the process sleeps in ``select`` until the next packet arrives or the next release is
due, never spinning.

``--selftest`` measures instead (needs root and ``ip netns``; tests/harness/netsim.py): for each ``--rates`` value, two
hosts with that link rate and this delay/jitter (defaults 50 ms one way, 10 ms jitter), the median/min/max RTT of
small TCP exchanges, bulk TCP throughput and the delay lines' CPU use, printed as a table::

    python -m tests.harness.delayline --selftest [--rates 10 100 1000] [--delay-ms 50 --jitter-ms 10] [--seconds 8]
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
READ_SIZE = 65536 + 64  # an IPv4/IPv6 packet (GSO or not) is at most 64 KB; plus the 10-byte virtio_net_hdr
BATCH = 64  # packets read per wake-up at most


def open_tun(name: str, offload: bool = True) -> int:
    """Create (or attach to) TUN device ``name`` in this process's namespace; returns its non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), flags))
        if offload:
            fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Stop(Exception):
    pass


def _stop(signum, frame):
    raise Stop()


def run(src: int, dst: int, delay_ms: float, jitter_ms: float, seed: int, limit_bytes: int,
        clock=time.monotonic) -> dict:
    """Move packets from fd ``src`` to fd ``dst`` after their delay until Stop is raised (the signal handlers);
    returns counters."""
    rng = random.Random(seed)
    delay, jitter = delay_ms / 1000.0, jitter_ms / 1000.0
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    held_bytes = 0
    last_release = 0.0
    stats = {"packets": 0, "bytes": 0, "dropped": 0, "write_errors": 0}
    read, write, uniform, select_ = os.read, os.write, rng.uniform, select.select
    rlist = [src]
    try:
        while True:
            now = clock()
            while held and held[0][0] <= now:
                packet = held.popleft()[1]
                held_bytes -= len(packet)
                try:
                    write(dst, packet)
                except BlockingIOError:
                    stats["dropped"] += 1
                except OSError:
                    stats["write_errors"] += 1
                if not held:
                    break
                now = clock()
            timeout = max(0.0, held[0][0] - now) if held else None
            if not select_(rlist, [], [], timeout)[0]:
                continue
            now = clock()
            for _ in range(BATCH):
                try:
                    packet = read(src, READ_SIZE)
                except BlockingIOError:
                    break
                if held_bytes + len(packet) > limit_bytes:
                    stats["dropped"] += 1
                    continue
                release = now + (delay + uniform(-jitter, jitter) if jitter else delay)
                if release < last_release:
                    release = last_release  # no reordering: never before the packet ahead of it
                last_release = release
                held.append((release, packet))
                held_bytes += len(packet)
                stats["packets"] += 1
                stats["bytes"] += len(packet)
    except Stop:
        pass
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--in", dest="src", help="TUN device the kernel routes packets into (created)")
    ap.add_argument("--out", dest="dst", help="TUN device the delayed packets are written to (created)")
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--jitter-ms", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-mb", type=float, default=64.0, help="most MB held; packets beyond are dropped")
    ap.add_argument("--no-offload", action="store_true", help="no IFF_VNET_HDR/TSO: per-segment packets")
    ap.add_argument("--selftest", action="store_true", help="measure RTT and throughput through NetSim instead")
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 100, 1000], help="--selftest: link rates, Mbit/s")
    ap.add_argument("--seconds", type=float, default=8.0, help="--selftest: bulk transfer length at each rate")
    args = ap.parse_args(argv)
    if not 0 <= args.jitter_ms <= args.delay_ms:
        ap.error("need 0 <= --jitter-ms <= --delay-ms")
    if args.selftest:
        return selftest(args.rates, args.delay_ms, args.jitter_ms, args.seconds, offload=not args.no_offload)
    if not args.src or not args.dst:
        ap.error("--in and --out are required")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    src = open_tun(args.src, offload=not args.no_offload)
    dst = open_tun(args.dst, offload=not args.no_offload)
    try:
        print("ready", flush=True)
        stats = run(src, dst, args.delay_ms, args.jitter_ms, args.seed, int(args.limit_mb * 1e6))
    finally:
        os.close(src)
        os.close(dst)
    print(" ".join(f"{k}={v}" for k, v in stats.items()), flush=True)
    return 0


# --- --selftest: RTT, throughput and CPU through NetSim -------------------------------------------------------

ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(64)
    if not b: break
    c.sendall(b)
"""
ECHO_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):
    t0 = time.monotonic(); s.sendall(b"x")
    assert s.recv(64) == b"x"
    print(round((time.monotonic() - t0) * 1000, 3), flush=True)
    time.sleep(float(sys.argv[4]))
"""
BULK_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; marks = []; step = 1 << 20; nxt = 0
while True:
    b = c.recv(1 << 18)
    if not b: break
    n += len(b)
    if n >= nxt: marks.append((time.monotonic(), n)); nxt += step
marks.append((time.monotonic(), n))
print(" ".join(f"{t:.6f}:{k}" for t, k in marks), flush=True)
"""
BULK_SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
end = time.monotonic() + float(sys.argv[3]); chunk = b"x" * (1 << 18)
while time.monotonic() < end: s.sendall(chunk)
s.close()
"""


def rtt_samples(net, src: int, dst: int, count: int = 30, gap_s: float = 0.01, port: int = 5601) -> list[float]:
    """Round-trip times (ms) of ``count`` one-byte TCP exchanges from host ``src`` to an echo server on ``dst``."""
    server = net.popen(dst, [sys.executable, "-c", ECHO_SERVER, net.address(dst), str(port)],
                       stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    done = net.run(src, [sys.executable, "-c", ECHO_CLIENT, net.address(dst), str(port), str(count), str(gap_s)],
                   timeout=60)
    assert done.returncode == 0, done.stderr
    server.wait(10)
    return [float(x) for x in done.stdout.split()]


def bulk_mbit(net, src: int, dst: int, seconds: float, port: int = 5602) -> tuple[float, float]:
    """Bulk TCP for ``seconds`` from host ``src`` to ``dst``: (Mbit/s over the whole transfer from its first
    byte, Mbit/s over its second half, past slow start)."""
    receiver = net.popen(dst, [sys.executable, "-c", BULK_RECEIVER, net.address(dst), str(port)],
                         stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "ready"
    sent = net.run(src, [sys.executable, "-c", BULK_SENDER, net.address(dst), str(port), str(seconds)],
                   timeout=seconds + 60)
    assert sent.returncode == 0, sent.stderr
    marks = [(float(t), int(n)) for t, n in (m.split(":") for m in receiver.stdout.readline().split())]
    receiver.wait(10)
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    whole = (n1 - n0) * 8 / max(t1 - t0, 1e-9) / 1e6
    half = next((m for m in marks if m[0] >= (t0 + t1) / 2), marks[0])
    second = (n1 - half[1]) * 8 / max(t1 - half[0], 1e-9) / 1e6
    return whole, second


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def selftest(rates: list[float], delay_ms: float, jitter_ms: float, seconds: float, offload: bool = True) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.harness.netsim import NetSim

    for check in (NetSim.available, NetSim.delay_available):
        ok, why = check()
        if not ok:
            print(f"cannot measure here: {why}", file=sys.stderr)
            return 2
    # windows for 1000 Mbit/s x ~120 ms (15 MB in flight) and more
    big = {"net.ipv4.tcp_rmem": "4096 131072 67108864", "net.ipv4.tcp_wmem": "4096 16384 67108864"}
    print(f"one-way delay {delay_ms} ms +- {jitter_ms} ms per host egress (RTT {2 * delay_ms} ms nominal), "
          f"offload {'on' if offload else 'off'}, bulk {seconds} s")
    head = (f"{'rate':>6} | {'RTT med':>8} {'min':>7} {'max':>7} | {'bulk Mbit/s':>11} {'2nd half':>9} "
            f"| {'delay-line CPU (tx, rx host)':>28}")
    print(head)
    print("-" * len(head))
    for rate in rates:
        with NetSim(2, rate, prefix="dlxs", delay_ms=delay_ms, jitter_ms=jitter_ms, sysctls=big,
                    delay_offload=offload) as net:
            rtts = sorted(rtt_samples(net, 0, 1, count=40))
            pids = net.delay_pids()
            cpu0, wall0 = [_cpu_seconds(p) for p in pids], time.monotonic()
            whole, second = bulk_mbit(net, 0, 1, seconds)
            wall = time.monotonic() - wall0
            cpu = [(_cpu_seconds(p) - c) / wall for p, c in zip(pids, cpu0)]
        med = rtts[len(rtts) // 2]
        print(f"{rate:>6g} | {med:>8.1f} {rtts[0]:>7.1f} {rtts[-1]:>7.1f} | {whole:>11.1f} {second:>9.1f} "
              f"| {cpu[0]:>13.0%} {cpu[1]:>13.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
