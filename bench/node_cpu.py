"""CPU and memory of one node's processes in a swarm of N, on the EMULATED workload (``make bench-node-cpu``).

A node is four processes: the main one, hivemind's DHT and averager (forked from it) and p2pd. This starts N
nodes on loopback (``--workload synthetic:1M:0.25``: compute is a sleep, so what is measured is the swarm's
own work: DHT reads and writes, matchmaking, the all-gather, aggregation), waits until every node has applied
a round, then measures over ``--window`` seconds each process's CPU time (psutil) and, at the end, its PSS
(/proc/PID/smaps_rollup). With ``--profile`` it also samples node n01's main and DHT processes with py-spy
and prints their busiest frames. No quality is claimed from it.

Output: a table of CPU cores per node (median over nodes, and the sum over the swarm), PSS and private memory
per process kind, plus the rounds' outcomes and median duration; JSON to ``--out``. ``--launch forked`` forks the
nodes from one shared image (tests/harness/forked.py) and adds the forkserver's PSS, shared equally, as "image share".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

from bench.compare import _pss, _rollup, _tree
from bench.swarm_size import BASE, stop_all
from tests.harness.forked import image_holders
from tests.harness.localswarm import JOINT, LocalNode, wait_all

IDLE_FRAMES = ("_watchdog", "DHT.run", "select", "socket.accept", "Connection._recv", "sleep")


def processes(node: LocalNode) -> list[tuple[str, psutil.Process]]:
    """The node's live processes with their kind: main, dht, averager (hivemind forks the DHT first), p2pd."""
    out, forked = [], 0
    for pid in _tree(node.proc.pid):
        try:
            p = psutil.Process(pid)
            kind = "p2pd" if "p2pd" in p.name() else "main" if pid == node.proc.pid else \
                ("dht", "averager")[min(forked, 1)] if "python" in p.name() else p.name()
        except psutil.Error:
            continue
        forked += kind in ("dht", "averager")
        out.append((kind, p))
    return out


def kinds(node: LocalNode) -> dict[str, tuple[int, float]]:
    """Process kind (main, dht, averager, p2pd) -> (pid, CPU seconds so far) of its first process."""
    found: dict[str, tuple[int, float]] = {}
    for kind, p in processes(node):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        found.setdefault(kind, (p.pid, t.user + t.system))
    return found


def _private(pid: int) -> int:
    """Bytes of the process's pages no other process maps (Private_Clean + Private_Dirty), 0 once it is gone."""
    fields = _rollup(pid)
    return fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)


def busiest_frames(raw: Path, top: int = 12) -> list[tuple[float, str]]:
    """Share of non-idle py-spy samples (``-f raw``) that pass through each frame."""
    counts, busy = Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]
        if any(idle in frames[-1] for idle in IDLE_FRAMES) or "wait" in frames[-1]:
            continue
        busy += int(n)
        for f in set(frames):
            counts[f] += int(n)
    return [(round(100 * c / max(1, busy), 1), f) for f, c in counts.most_common(top)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=12)
    p.add_argument("--window", type=float, default=60.0, help="seconds of measurement after the first round")
    p.add_argument("--workload", default="synthetic:1M:0.25")
    p.add_argument("--inner-steps", type=int, default=40)
    p.add_argument("--announce-period", default="2", help="seconds; 2 (more DHT work than the default 5) is what "
                   "docs/operations.md's table used")
    p.add_argument("--profile", action="store_true", help="py-spy node n01's main and DHT processes")
    p.add_argument("--launch", choices=("interpreter", "forked"), default="interpreter",
                   help="forked: every node forked from one shared image (tests/harness/forked.py)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/node-cpu"))
    a = p.parse_args(argv)
    args = BASE + ["--workload", a.workload, "--inner-steps", str(a.inner_steps), "--run-id", "cpu",
                   "--min-replicas", str(a.nodes), "--announce-period", a.announce_period]
    forked = a.launch == "forked"
    boot = LocalNode("n00", a.out / "n00", args, forked=forked).wait_started()
    nodes = [boot] + [LocalNode(f"n{i:02d}", a.out / f"n{i:02d}", args + ["--join", boot.join_maddr], forked=forked)
                      for i in range(1, a.nodes)]
    began = time.monotonic()
    try:
        wait_all(nodes, lambda: all(x.poll_started() for x in nodes), 900, "every node's start")
        wait_all(nodes, lambda: all(any(r["outcome"] in JOINT for r in x.metrics()) for x in nodes), 900,
                 "an applied round on every node")
        first_round_s = time.monotonic() - began
        before = [kinds(x) for x in nodes]
        spies = []
        if a.profile:
            spies = [(k, subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-d",
                                           str(max(1, int(a.window) - 5)), "-r", "50", "-f", "raw", "-o",
                                           str(a.out / f"py-spy-{k}.txt"), "-p", str(before[1][k][0])],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                     for k in ("main", "dht")]
        time.sleep(a.window)
        after = [kinds(x) for x in nodes]
        pss = {k: statistics.median(_pss(d[k][0]) for d in after if k in d) for k in after[0]}
        private = {k: statistics.median(_private(d[k][0]) for d in after if k in d) for k in after[0]}
        pss["image share"] = sum(map(_pss, image_holders([x.proc for x in nodes]))) / len(nodes)
        rows = [r for x in nodes for r in x.metrics()]
        for _, spy in spies:
            spy.wait(60)
    finally:
        stop_all([x for x in nodes if x.proc.poll() is None])
    cpu = {}
    for k in sorted(before[0]):
        rates = [(b[k][1] - a0[k][1]) / a.window for a0, b in zip(before, after) if k in a0 and k in b]
        cpu[k] = dict(median_cores=round(statistics.median(rates), 4), swarm_cores=round(sum(rates), 3),
                      pss_mb=round(pss.get(k, 0) / 1e6, 1), private_mb=round(private.get(k, 0) / 1e6, 1))
    cpu["image share"] = dict(median_cores=0.0, swarm_cores=0.0, pss_mb=round(pss["image share"] / 1e6, 1),
                              private_mb=0.0)
    result = dict(nodes=a.nodes, launch=a.launch, window_s=a.window, first_round_s=round(first_round_s, 1), cpu=cpu,
                  outcomes=dict(Counter(r["outcome"] for r in rows)),
                  round_s=statistics.median([r["duration_s"] for r in rows if r["outcome"] == "applied"] or [0]),
                  profile={k: busiest_frames(a.out / f"py-spy-{k}.txt") for k, _ in spies})
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "node-cpu.json").write_text(json.dumps(result, indent=1))
    print(f"EMULATED workload ({a.workload}, H = {a.inner_steps}); {a.nodes} nodes on loopback, 2 cores, launched "
          f"{a.launch}; {a.window:.0f} s after every node's first round (at {first_round_s:.0f} s)")
    print("| process | CPU cores per node (median) | CPU cores, whole swarm | PSS per node (median) | private |")
    print("|---|---|---|---|---|")
    for k, c in cpu.items():
        print(f"| {k} | {c['median_cores']:.3f} | {c['swarm_cores']:.2f} | {c['pss_mb']:.0f} MB | "
              f"{c['private_mb']:.0f} MB |")
    print(f"node (sum): {sum(c['pss_mb'] for c in cpu.values()):.0f} MB PSS")
    print(f"rounds: {result['outcomes']}, median round {result['round_s']:.1f} s")
    for k, frames in result["profile"].items():
        print(f"busiest frames of n01's {k} process (share of busy samples):")
        for share, f in frames:
            print(f"  {share:5.1f}% {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
