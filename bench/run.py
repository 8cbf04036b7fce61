"""``make bench``: throughput and communication of real local swarms (small model, loopback).

For 2 and 3 replicas on loopback, synchronous (overlap none) and DiLoCoX one-step delay
(overlap delayed), run a fixed number of outer steps and report per node: tokens/s during inner
steps, seconds per outer step in compute, in averaging and blocked on averaging, compute
utilization, bytes sent per outer step, and loss before/after. Results: runs/bench/swarm.{json,csv,png}.
All nodes share this machine's cores, so tokens/s per node falls as replicas are added.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
from pathlib import Path

from tests.harness.localswarm import REPO, leave_all, start_swarm, summarize

BENCH_ARGS = ["--model", "small", "--inner-steps", "20", "--inner-lr", "2e-3", "--warmup-steps", "20",
              "--total-steps", "400", "--request-timeout", "2", "--matchmaking-time", "4",
              "--averaging-timeout", "30", "--outer-round-deadline", "120", "--announce-period", "2"]


def run_swarm(n: int, outer_steps: int, out: Path, overlap: str) -> dict:
    nodes = start_swarm(n, out / f"swarm{n}-{overlap}", BENCH_ARGS + [
        "--run-id", f"bench{n}{overlap}", "--max-outer-steps", str(outer_steps), "--overlap", overlap])
    for node in nodes:
        node.proc.wait(timeout=outer_steps * 200)
    codes = leave_all(nodes)
    return dict(replicas=n, overlap=overlap, exit_codes=codes, nodes=summarize(nodes))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, compute, comm, first_val, last_val = [], [], [], [], []
    for r in results:
        for name, s in r["nodes"].items():
            labels.append(f"{r['replicas']}x {r['overlap']} {name}")
            compute.append(s["median_compute_s"])
            comm.append(s["median_wait_s"])
            first_val.append(s["first_val_loss"])
            last_val.append(s["last_val_loss"])
    fig, (ax, qx) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax.bar(labels, compute, label="inner steps (compute)")
    ax.bar(labels, comm, bottom=compute, label="blocked on averaging (matchmaking + all-reduce)")
    ax.set_ylabel("seconds per outer step (median)")
    ax.set_title("DiLoCo rounds on loopback, small model, H=20")
    ax.legend()
    # the quality panel: validation loss of theta after the first and the last outer step, per node
    xs = range(len(labels))
    qx.bar([x - 0.2 for x in xs], first_val, width=0.4, label="after the first outer step")
    qx.bar([x + 0.2 for x in xs], last_val, width=0.4, label="after the last outer step")
    qx.set_xticks(list(xs), labels)
    qx.set_ylabel("validation loss (nats/byte)")
    qx.set_title("quality")
    qx.legend()
    for a in (ax, qx):
        plt.setp(a.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--outer-steps", type=int, default=4)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--overlap", nargs="+", default=["none", "delayed"], choices=["none", "delayed"])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    results = [run_swarm(n, args.outer_steps, args.out, o) for n in args.replicas for o in args.overlap]
    (args.out / "swarm.json").write_text(json.dumps(results, indent=2))
    with open(args.out / "swarm.csv", "w", newline="") as f:
        writer = None
        for r in results:
            for name, s in r["nodes"].items():
                row = dict(replicas=r["replicas"], overlap=r["overlap"], node=name,
                           **{k: v for k, v in s.items() if k != "group_sizes"})
                writer = writer or csv.DictWriter(f, fieldnames=list(row))
                if f.tell() == 0:
                    writer.writeheader()
                writer.writerow(row)
    plot(results, args.out / "swarm.png")
    print(f"{'replicas':>8} {'overlap':>8} {'node':>6} {'tok/s':>8} {'compute_s':>9} {'comm_s':>7} {'wait_s':>7} "
          f"{'util':>5} {'MB sent/step':>12} {'loss':>14}")
    for r in results:
        for name, s in r["nodes"].items():
            print(f"{r['replicas']:>8} {r['overlap']:>8} {name:>6} {s['tokens_per_second_compute']:>8.0f} "
                  f"{s['median_compute_s']:>9.1f} {s['median_comm_s']:>7.1f} {s['median_wait_s']:>7.1f} "
                  f"{s['compute_utilization']:>5.0%} {s['median_bytes_sent_per_outer_step'] / 1e6:>12.2f} "
                  f"{s['first_loss']:>6.3f}->{s['last_loss']:.3f}")
    print(f"results: {args.out}/swarm.json, swarm.csv, swarm.png")
    return 0 if all(all(c == 0 for c in r["exit_codes"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
