"""``make bench-traffic``: what a node sends in each round, on the interface counters, against time.

Two hosts in network namespaces (tests/harness/netsim.py) at ``--rate`` Mbit/s run real ``dilocox-node``s
with the default sparse rounds (the ``small`` model, H = 50, as ``make bench``) for ``--rounds``
outer steps. The harness reads both hosts' tx counters from sysfs every ``--interval`` seconds and
each node's round ends from its ``metrics.jsonl``. Per node and round it reports the bytes sent
(from one round's end to the next) beside the round's payload, and it draws the tx rate of both
hosts against time with the rounds' averaging phases marked: traffic that is neither the payload
nor idle control shows up as a shape in the plot (this is how hivemind's matchmaking reads, ~1 MB
a round, were found: docs/protocol.md, "Paced matchmaking reads").

    python -m bench.traffic --rate 10 --rounds 4

Results: runs/bench/traffic.{json,png} and a printed table.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from bench.control import tx_bytes
from tests.harness.localswarm import REPO, LocalNode
from tests.harness.netsim import NetSim

AVERAGING = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*state TRAINING -> AVERAGING")


def averaging_starts(stderr: str) -> list[float]:
    """Unix times at which a node's log says it entered AVERAGING (logging's asctime: local time, as here)."""
    out = []
    for line in stderr.splitlines():
        m = AVERAGING.match(line)
        if m:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def bytes_per_round(samples: list[tuple[float, int]], ends: list[float]) -> list[int]:
    """Bytes sent between consecutive round ends: ``samples`` are (unix time, tx counter) in time order,
    ``ends`` the rounds' end times; the counter at a time is the last sample at or before it. One value
    per pair of consecutive ends (the first round, with start-up, is not counted)."""
    def at(t: float) -> int:
        before = [c for s, c in samples if s <= t]
        return before[-1] if before else samples[0][1]

    return [at(b) - at(a) for a, b in zip(ends, ends[1:])]


def run(args) -> dict:
    out = args.out / "traffic"
    shutil.rmtree(out, ignore_errors=True)
    common = ["--model", "small", "--inner-steps", "50", "--inner-lr", "2e-3", "--warmup-steps", "20",
              "--total-steps", str(50 * args.rounds), "--max-outer-steps", str(args.rounds), "--min-replicas", "2",
              "--request-timeout", "2", "--matchmaking-time", "4", "--averaging-timeout", "120",
              "--outer-round-deadline", "400", "--eval-batches", "8", "--eval-every", str(args.rounds),
              "--status-addr", "127.0.0.1:0", "--run-id", "traffic"]
    samples: list[list] = [[], []]
    with NetSim(2, args.rate, prefix="dlxt") as net:
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                now = time.time()
                for i in range(2):
                    samples[i].append((now, tx_bytes(net, i)))
                stop.wait(args.interval)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        nodes = []
        try:
            for i in range(2):
                a = common + ["--listen", f"/ip4/{net.address(i)}/tcp/0", "--data-seed", str(i)]
                if nodes:
                    a += ["--join", nodes[0].join_maddr]
                nodes.append(LocalNode(f"h{i}", out / f"h{i}", a, wrapper=net.wrapper(i)).wait_started())
            codes = [n.proc.wait(args.rounds * 600) for n in nodes]
        finally:
            stop.set()
            sampler.join()
            for n in nodes:
                n.terminate()
    if codes != [0, 0]:
        raise RuntimeError(f"exit codes {codes}\n{nodes[0].log_tail()}\n{nodes[1].log_tail()}")
    hosts = []
    for i, n in enumerate(nodes):
        rows = n.metrics()
        sent = bytes_per_round(samples[i], [r["time"] for r in rows])
        payload = [r["payload_bytes"] for r in rows[1:]]
        hosts.append(dict(host=i, bytes_per_round=sent, payload_bytes=payload,
                          averaging=averaging_starts(n.err_path.read_text()), round_ends=[r["time"] for r in rows],
                          outcomes=[r["outcome"] for r in rows], samples=samples[i]))
    sent = [b for h in hosts for b in h["bytes_per_round"]]
    payload = [b for h in hosts for b in h["payload_bytes"]]
    return dict(rate_mbit=args.rate, rounds=args.rounds, interval_s=args.interval, hosts=hosts,
                median_bytes_per_round=statistics.median(sent), median_payload_bytes=statistics.median(payload))


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(h["samples"][0][0] for h in res["hosts"])
    fig, ax = plt.subplots(figsize=(12, 4))
    for h in res["hosts"]:
        s = h["samples"]
        ax.plot([b[0] - t0 for b in s[1:]], [(b[1] - a[1]) / (b[0] - a[0]) / 1e3 for a, b in zip(s, s[1:])],
                label=f"host {h['host']} tx", lw=1)
        for k, (a, e) in enumerate(zip(h["averaging"], h["round_ends"])):
            ax.axvspan(a - t0, e - t0, color=f"C{h['host']}", alpha=0.15, label="averaging" if k == 0 else None)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("s")
    ax.set_ylabel("KB/s sent")
    ax.set_title(f"tx per host at {res['rate_mbit']:g} Mbit/s; median {res['median_bytes_per_round'] / 1e3:.0f} KB "
                 f"per node-round, payload {res['median_payload_bytes'] / 1e3:.0f} KB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=10.0, help="link rate in Mbit/s")
    ap.add_argument("--rounds", type=int, default=4, help="outer steps (the first, with start-up, is not counted)")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between counter reads")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    args = ap.parse_args(argv)
    ok, why = NetSim.available()
    if not ok:
        print(f"bench-traffic needs network namespaces: {why}", file=sys.stderr)
        return 2
    res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "traffic.json").write_text(json.dumps(res, indent=1))
    plot(res, args.out / "traffic.png")
    print(f"{'host':>4} {'round':>5} {'sent (B)':>10} {'payload (B)':>11} {'ratio':>6}")
    for h in res["hosts"]:
        for k, (s, p) in enumerate(zip(h["bytes_per_round"], h["payload_bytes"]), start=2):
            print(f"{h['host']:>4} {k:>5} {s:>10,} {p:>11,} {s / p:>6.2f}")
    print(f"median per node-round: {res['median_bytes_per_round']:,.0f} B sent, "
          f"{res['median_payload_bytes']:,.0f} B payload")
    print(f"results: {args.out}/traffic.json, traffic.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
