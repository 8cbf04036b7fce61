"""A joiner's start-up, phase by phase, with the CPU time each process spent on it (``make bench-startup``).

One node starts a swarm (``--workload synthetic:1M:0.25`` by default: EMULATED, compute is a sleep), then
``--joiners`` nodes join it one after the other, each alone beside it, so what is measured is the start-up's
own work on an idle machine, not a crowd's contention (bench/swarm_size.py measures joiners at 32 nodes). Half
of the joiners start with a kept identity file (``--identity``, made before they start: hivemind checks that
no live peer holds it, with a second p2pd), the other half without one (a key made for this start: no check,
peers/swarm.py), alternating, so the check's cost is measured side by side in one run.

Per joiner, from its start: the time it logged ``joined DHT``, the state SYNCING and the state TRAINING, and the
CPU seconds of its processes (main, hivemind's DHT and averager, p2pd; each with its exited children, such as
the check's p2pd) at SYNCING. Printed as medians [min, max] per kind of joiner; JSON to ``--out``.

    python -m bench.startup --joiners 6 --out runs/bench/startup
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import time
from pathlib import Path

import psutil
from dilocox.peers.identity import load_or_create_identity

from bench.node_cpu import processes
from bench.swarm_size import BASE, log_time
from tests.harness.localswarm import LocalNode

MARKS = {"dht": "joined DHT", "syncing": "-> SYNCING", "training": "-> TRAINING"}


def marks(node: LocalNode, started: float) -> dict[str, float]:
    """Seconds from ``started`` (epoch) to the first line of the node's log of each of MARKS."""
    found = {key: log_time(node, re.escape(text)) for key, text in MARKS.items()}
    return {key: t - started for key, t in found.items() if t is not None}


def cpu_by_kind(node: LocalNode) -> dict[str, float]:
    """CPU seconds (user + system, with exited children) of the node's processes by kind (bench/node_cpu.py)."""
    out = {}
    for kind, p in processes(node):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        out[kind] = out.get(kind, 0.0) + t.user + t.system + t.children_user + t.children_system
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]" if values else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--joiners", type=int, default=6)
    ap.add_argument("--workload", default="synthetic:1M:0.25")
    ap.add_argument("--inner-steps", type=int, default=40)
    ap.add_argument("--launch", choices=["forked", "interpreter"], default="forked")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/startup"))
    a = ap.parse_args(argv)
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    forked = a.launch == "forked"
    args = BASE + ["--workload", a.workload, "--inner-steps", str(a.inner_steps), "--run-id", "startup"]
    first = LocalNode("n00", a.out / "n00", args + ["--min-replicas", "1"], forked=forked).wait_started()
    rows = []
    try:
        first.wait_for(lambda n: n.status().outer_step >= 1, 180, "the first node's first outer step")
        for i in range(1, a.joiners + 1):
            kept = i % 2 == 1
            extra = ["--join", first.join_maddr]
            if kept:  # a kept key, as an operator's --identity file after its first start
                load_or_create_identity(a.out / f"n{i:02d}.key")
                extra += ["--identity", str(a.out / f"n{i:02d}.key")]
            started = time.time()
            node = LocalNode(f"n{i:02d}", a.out / f"n{i:02d}", args + extra, forked=forked)
            node.wait_for(lambda n: n.poll_started() and n.status().state in ("SYNCING", "TRAINING"), 120,
                          "SYNCING")
            cpu = cpu_by_kind(node)
            node.wait_for(lambda n: n.status().state == "TRAINING", 120, "TRAINING")
            row = dict(joiner=node.name, identity="kept" if kept else "new", **marks(node, started),
                       cpu_s=cpu, cpu_total_s=sum(cpu.values()))
            rows.append(row)
            print(json.dumps(row), flush=True)
            node.terminate()
    finally:
        first.terminate()
    print(f"\n{a.joiners} joiners against a 1-node swarm, {a.launch} launch, {a.workload} (EMULATED)")
    print("seconds from start; CPU seconds at SYNCING; median [min, max]\n")
    cols = ["dht", "syncing", "training"]
    kinds = ["main", "dht", "averager", "p2pd"]
    print(" | ".join(["identity", "n"] + [f"to {c}" for c in cols] + [f"cpu {k}" for k in kinds] + ["cpu total"]))
    summary = {}
    for kind in ("kept", "new"):
        rs = [r for r in rows if r["identity"] == kind]
        cells = [spread([r[c] for r in rs if c in r]) for c in cols] + \
            [spread([r["cpu_s"].get(k, 0.0) for r in rs]) for k in kinds] + [spread([r["cpu_total_s"] for r in rs])]
        summary[kind] = cells
        print(" | ".join([kind, str(len(rs))] + cells))
    (a.out / "startup.json").write_text(json.dumps(dict(rows=rows, summary=summary, launch=a.launch,
                                                         workload=a.workload), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
