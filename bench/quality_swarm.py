"""``make bench-quality-swarm``: one curve of ``make bench-quality`` confirmed with a real swarm.

R real ``dilocox-node`` processes on loopback (tests/harness/localswarm.py) train with the default
configuration, replica r with ``--seed SEED --data-seed r``, for a shorter horizon; the in-process
simulation (bench/quality.py) runs the same method, seed, replicas, H and schedule. Both record the
validation loss of theta after each outer step on the same held-out batches, so the two curves
should lie on top of each other up to what only a swarm does: joiners that skip the first inner
steps of round 1, rounds that fail or are applied alone, and the order in which floating-point sums
of different groups happen. Writes runs/bench/quality_swarm.{json,png}.

    python -m bench.quality_swarm --replicas 4 --inner-steps 30 --outer-steps 20 --seed 7
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
from pathlib import Path

from bench import quality
from tests.harness.localswarm import REPO, LocalNode, leave_all

FAST = ["--model", "tiny", "--request-timeout", "1", "--matchmaking-time", "2", "--averaging-timeout", "10",
        "--outer-round-deadline", "40", "--announce-period", "1"]


def run_swarm(method_flags: list[str], replicas: int, inner_steps: int, outer_steps: int, seed: int,
              eval_batches: int, out: Path) -> list[list[dict]]:
    """Each node's metrics rows (one per recorded round)."""
    shutil.rmtree(out, ignore_errors=True)
    common = FAST + method_flags + [
        "--inner-steps", str(inner_steps), "--max-outer-steps", str(outer_steps), "--seed", str(seed),
        "--total-steps", str(inner_steps * outer_steps), "--eval-batches", str(eval_batches),
        "--min-replicas", str(replicas), "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0",
        "--run-id", "quality-swarm"]
    nodes = [LocalNode("r0", out / "r0", common + ["--data-seed", "0"]).wait_started()]
    nodes += [LocalNode(f"r{r}", out / f"r{r}", common + ["--data-seed", str(r), "--join", nodes[0].join_maddr])
              for r in range(1, replicas)]
    try:
        for n in nodes[1:]:
            n.wait_started()
        for n in nodes:
            n.proc.wait(outer_steps * 120)
    finally:
        leave_all([n for n in nodes if n.proc.poll() is None], 60)
        for n in nodes:
            n.terminate(signal.SIGKILL)
    return [n.metrics() for n in nodes]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="default", help="a bench.quality method name, or 'default'")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--outer-steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--node-args", default="", help="more dilocox-node flags for the swarm, e.g. '--overlap "
                                                    "adaptive' (the simulation still runs --method)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "quality_swarm")
    a = ap.parse_args(argv)
    method = quality.METHODS[quality.DEFAULT if a.method == "default" else a.method]
    flags = ([] if a.method == "default" else quality.daemon_flags(method)) + a.node_args.split()
    sim = quality.run(method, a.seed, a.replicas, a.inner_steps, a.outer_steps, "tiny", 1, a.eval_batches,
                      "builtin:shakespeare")
    rows = run_swarm(flags, a.replicas, a.inner_steps, a.outer_steps, a.seed, a.eval_batches, a.out)
    sim_by_step = {p["outer_step"]: p["val_loss"] for p in sim["curve"]}
    swarm_by_step: dict[int, list[float]] = {}
    for node_rows in rows:
        for r in node_rows:
            if r["outcome"] in ("applied", "resynced"):
                swarm_by_step.setdefault(r["outer_step"], []).append(r["val_loss"])
    steps = sorted(set(sim_by_step) & set(swarm_by_step))
    pairs = [dict(outer_step=t, simulation=sim_by_step[t], swarm_min=min(swarm_by_step[t]),
                  swarm_max=max(swarm_by_step[t]), nodes=len(swarm_by_step[t])) for t in steps]
    gap = max((abs(p["swarm_max"] - p["simulation"]) / p["simulation"] for p in pairs), default=float("nan"))
    final = pairs[-1] if pairs else {}
    outcomes = sorted({r["outcome"] for node_rows in rows for r in node_rows})
    taus = [r.get("overlap_steps", 0) for node_rows in rows for r in node_rows]
    summary = dict(method=method.name, node_args=a.node_args, replicas=a.replicas, inner_steps=a.inner_steps,
                   outer_steps=a.outer_steps, seed=a.seed, max_relative_gap=gap, final=final, outcomes=outcomes,
                   overlap_steps=sorted(set(taus)), steps=pairs)
    path = a.out.with_suffix(".json")
    path.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=1))
    _plot(pairs, method.name, a.out.with_suffix(".png"))


def _plot(pairs: list[dict], name: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["outer_step"] for p in pairs]
    ax.plot(xs, [p["simulation"] for p in pairs], "o-", label="in-process simulation (bench/quality.py)")
    ax.fill_between(xs, [p["swarm_min"] for p in pairs], [p["swarm_max"] for p in pairs], alpha=0.4, color="C1",
                    label="real swarm (min..max over nodes)")
    ax.set_xlabel("outer step")
    ax.set_ylabel("validation loss of theta (nats/byte)")
    ax.set_title(f"{name}: simulation vs real swarm")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
