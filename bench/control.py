"""``make bench-control``: control-plane traffic of idle nodes, on the interface counters.

N hosts in network namespaces (tests/harness/netsim.py) each run a real ``dilocox-node`` that joins the
swarm and trains a round so long (``--inner-steps`` 10^6) that none ends during the measurement:
every byte its interface sends is control traffic (membership records, DHT reads and maintenance,
state declarations of its averagers, libp2p keep-alives), none is a pseudo-gradient. Measured per
configuration over the same window, as bytes per second per node, from the hosts' tx counters in
sysfs.

    python -m bench.control --nodes 3 --seconds 60 --configs adaptive sparse
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from tests.harness.localswarm import REPO, LocalNode
from tests.harness.netsim import NetSim

CONFIGS = {
    "adaptive": ["--compression", "adaptive"],  # one averager per rank of the ladder (8, 4, 2, 1)
    "sparse": ["--compression", "sparse"],      # one matchmaking averager
}


def tx_bytes(net: NetSim, i: int) -> int:
    """Bytes host i's interface sent (everything: payloads, DHT, keep-alives)."""
    return int(net.run(i, ["cat", f"/sys/class/net/dlxh{i}/statistics/tx_bytes"]).stdout)


def rx_bytes(net: NetSim, i: int) -> int:
    """Bytes host i's interface received."""
    return int(net.run(i, ["cat", f"/sys/class/net/dlxh{i}/statistics/rx_bytes"]).stdout)


def measure(net: NetSim, name: str, extra: list[str], nodes: int, seconds: float, out: Path) -> dict:
    common = ["--model", "tiny", "--min-replicas", str(nodes), "--inner-steps", "1000000", "--status-addr",
              "127.0.0.1:0", "--run-id", f"control-{name}", *extra]
    started = []
    try:
        for i in range(nodes):
            a = common + ["--listen", f"/ip4/{net.address(i)}/tcp/0"]
            if started:
                a += ["--join", started[0].join_maddr]
            started.append(LocalNode(f"h{i}", out / name / f"h{i}", a, wrapper=net.wrapper(i)).wait_started())
        for n in started:  # bootstrap traffic (DHT join, first records) is not what we measure
            n.wait_for(lambda p: "-> TRAINING" in p.err_path.read_text(), 120, "training")  # gRPC is in the netns
        time.sleep(5)
        before = [tx_bytes(net, i) for i in range(nodes)]
        time.sleep(seconds)
        sent = [tx_bytes(net, i) - b for i, b in enumerate(before)]
    finally:
        for n in started:
            n.terminate()
    return dict(config=name, nodes=nodes, seconds=seconds, flags=extra,
                bytes_per_s_per_node=sum(sent) / nodes / seconds, per_node=[s / seconds for s in sent])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--extra", default="", help="flags added to every node, e.g. '--announce-period 2'")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "control")
    a = ap.parse_args(argv)
    ok, why = NetSim.available()
    if not ok:
        print(f"bench.control needs network namespaces: {why}", file=sys.stderr)
        return 2
    shutil.rmtree(a.out, ignore_errors=True)
    rows = []
    with NetSim(a.nodes, 100, prefix="dlxk") as net:
        for name in a.configs:
            row = measure(net, name, CONFIGS[name] + a.extra.split(), a.nodes, a.seconds, a.out)
            rows.append(row)
            print(json.dumps(row), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out.parent / "control.json").write_text(json.dumps(dict(rows=rows, args=vars(a)), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
