"""Randomised fault schedule on a loopback swarm (``make bench-faults``): churn statistics.

Each trial (seeded) starts 3 nodes (tiny model, int8, delayed overlap, checkpoint every round),
then applies ``--events`` faults at random intervals: SIGKILL of a random node (not the
bootstrap), SIGTERM leave, a new joiner, or the restart of a killed node from its checkpoint.
After the last event the swarm runs two more rounds. Counted over all trials:
  rounds (outer steps applied by some group), node_rounds, stalls (a round that blocked training
  on communication for longer than averaging_timeout), longest_stall_s, resyncs (log lines
  "re-syncing from peers"), skipped (rounds a group refused: partial or disagreeing results),
  splits (outer steps with two different group-applied digests: hivemind matchmaking formed two
  groups), lone_results (a group-applied digest no other node holds: would be a partial average),
  unclean_leaves (SIGTERM exits != 0), converged (trials whose live nodes end on one digest).
Results: runs/bench/faults.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

from bench.localswarm import LocalNode, group_applied

ARGS = ["--model", "tiny", "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0",
        "--request-timeout", "1", "--matchmaking-time", "2", "--averaging-timeout", "8",
        "--outer-round-deadline", "30", "--announce-period", "1", "--inner-steps", "20",
        "--warmup-steps", "10", "--total-steps", "4000", "--eval-batches", "1",
        "--compression", "int8", "--checkpoint-every", "1"]
AVERAGING_TIMEOUT = 8.0


def _live(nodes):
    return [n for n in nodes if n.proc.poll() is None]


def trial(seed: int, events: int, workdir: Path) -> dict:
    rng = random.Random(seed)
    shutil.rmtree(workdir, ignore_errors=True)  # old checkpoints would be resumed
    args = ARGS + ["--run-id", f"faults{seed}"]
    boot = LocalNode("n0", workdir / "n0", args + ["--min-replicas", "3"]).wait_started()
    join = ["--join", boot.join_maddr]
    nodes = [boot] + [LocalNode(f"n{i}", workdir / f"n{i}", args + join + ["--min-replicas", "3"]) for i in (1, 2)]
    for n in nodes[1:]:
        n.wait_started()
    killed, log, unclean = [], [], 0
    try:
        boot.wait_for(lambda p: p.status().outer_step >= 2, 120, "outer step 2")
        for _ in range(events):
            time.sleep(rng.uniform(3.0, 9.0))
            victims = [n for n in _live(nodes) if n is not boot]
            choices = ["join"] + (["kill", "leave"] if len(victims) >= 2 else []) + (["restart"] if killed else [])
            event = rng.choice(choices)
            if event == "kill":
                victim = rng.choice(victims)
                victim.terminate(signal.SIGKILL)
                killed.append(victim)
            elif event == "leave":
                victim = rng.choice(victims)
                unclean += victim.terminate(signal.SIGTERM, timeout=60) != 0
            elif event == "join":
                name = f"n{len(nodes)}"
                nodes.append(LocalNode(name, workdir / name, args + join).wait_started())
            else:
                old = killed.pop(0)
                old.err_path.rename(old.err_path.with_name(f"stderr.{len(log)}"))  # keep its first life's log
                nodes.append(LocalNode(old.name, old.workdir, args + join).wait_started())
            log.append((round(time.monotonic(), 1), event))
        target = boot.status().outer_step + 2
        for n in _live(nodes):
            n.wait_for(lambda p: p.status().outer_step >= target, 180, f"outer step {target}")
        time.sleep(2.0)
        return _count(nodes, log, unclean, target)
    finally:
        for n in nodes:
            n.terminate(signal.SIGKILL)


def _count(nodes, log, unclean, target) -> dict:
    by_dir = {n.workdir: n for n in nodes}  # a restarted node shares its metrics file with its first life
    rows = {d: list({r["outer_step"]: r for r in n.metrics()}.values()) for d, n in by_dir.items()}
    held = group_applied(list(by_dir.values()), upto=target)
    digests_at = Counter(step for step, _ in held)
    all_rows = [r for rs in rows.values() for r in rs]
    live = [n for n in nodes if n.proc.poll() is None]
    finals = {n.status().outer_step: set() for n in live}
    for n in live:
        s = n.status()
        finals[s.outer_step].add(s.global_params_digest)
    top = max(finals)
    return dict(
        events=[e for _, e in log],
        rounds=len({r["outer_step"] for r in all_rows if r["outcome"] in ("applied", "solo", "applied_alone")}),
        node_rounds=len(all_rows), stalls=sum(r["wait_s"] > AVERAGING_TIMEOUT for r in all_rows),
        longest_stall_s=round(max((r["wait_s"] for r in all_rows), default=0.0), 2),
        resyncs=sum(f.read_text().count("re-syncing from peers") for d in by_dir for f in d.glob("stderr*")),
        skipped=sum(r["outcome"] == "skipped" for r in all_rows),
        splits=sum(n > 1 for n in digests_at.values()),
        lone_results=sum(c == 1 for c in held.values()),
        unclean_leaves=unclean, converged=len(finals[top]) == 1, live_nodes=len(live))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--events", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    out = Path("runs/bench")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for t in range(a.trials):
        r = trial(a.seed + t, a.events, out / f"faults-{a.seed + t}")
        results.append(r)
        print(json.dumps(r), flush=True)
    keys = ["rounds", "node_rounds", "stalls", "resyncs", "skipped", "splits", "lone_results", "unclean_leaves"]
    total = {k: sum(r[k] for r in results) for k in keys}
    total.update(trials=len(results), events=sum(len(r["events"]) for r in results),
                 longest_stall_s=max(r["longest_stall_s"] for r in results),
                 converged=sum(r["converged"] for r in results))
    print("TOTAL " + json.dumps(total), flush=True)
    (out / "faults.json").write_text(json.dumps(dict(args=vars(a), trials=results, total=total), indent=2))


if __name__ == "__main__":
    main()
