"""``make demo``: a local swarm of real nodes trains on Shakespeare for a few minutes.

Shows per-node progress (outer step, loss, tokens/s, bytes sent), then writes
``runs/demo/summary.json`` and ``runs/demo/loss.png`` and prints a short summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import grpc
from rich.console import Console
from rich.live import Live
from rich.table import Table

from tests.harness.localswarm import REPO, leave_all, start_swarm, summarize

DEMO_ARGS = ["--model", "small", "--data", "builtin:shakespeare", "--inner-steps", "30",
             "--inner-lr", "2e-3", "--warmup-steps", "30", "--total-steps", "600",
             "--request-timeout", "2", "--matchmaking-time", "4", "--averaging-timeout", "30",
             "--outer-round-deadline", "120", "--announce-period", "2", "--run-id", "demo"]


def _table(nodes, started: float) -> Table:
    table = Table(title=f"dilocox demo: {len(nodes)} nodes on loopback, {time.monotonic() - started:.0f}s")
    for col in ("node", "state", "outer", "inner", "loss", "val loss", "tok/s", "util", "tau", "group", "sent MB",
                "digest"):
        table.add_column(col, justify="right")
    for n in nodes:
        try:
            s = n.status(timeout=1.0)
        except grpc.RpcError:
            table.add_row(n.name, "?", *[""] * 10)
            continue
        # util: compute time / wall time over the last rounds; tau: inner steps of the next round computed before
        # the last round's update joined (0: synchronous)
        table.add_row(n.name, s.state, str(s.outer_step), f"{s.inner_step}/{s.inner_steps}", f"{s.loss:.3f}",
                      f"{s.val_loss:.3f}", f"{s.tokens_per_second:.0f}", f"{s.compute_utilization:.0%}",
                      str(s.last_round.overlap_steps), str(s.last_round.group_size), f"{s.bytes_sent / 1e6:.1f}",
                      s.global_params_digest[:8])
    return table


def plot(nodes, path: Path, initial_losses: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in nodes:
        rows = n.metrics()
        xs, ys = [r["outer_step"] - 0.5 for r in rows], [r["loss"] for r in rows]
        if n.name in initial_losses:
            xs, ys = [0.0] + xs, [initial_losses[n.name]] + ys
        ax.plot(xs, ys, marker=".", label=f"{n.name} train (round mean; 0 = first step)")
    rows = nodes[0].metrics()
    ax.plot([r["outer_step"] for r in rows], [r["val_loss"] for r in rows], "k--", label="validation (global params)")
    ax.set_xlabel("outer step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("dilocox demo: DiLoCo on Shakespeare")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "demo")
    args, node_args = parser.parse_known_args(argv)  # the rest go to every dilocox-node, e.g. --overlap none
    console = Console()
    shutil.rmtree(args.out, ignore_errors=True)
    console.print(f"starting {args.nodes} nodes (small model, builtin:shakespeare); logs under {args.out}")
    nodes = start_swarm(args.nodes, args.out, DEMO_ARGS + node_args)
    started = time.monotonic()
    initial_losses = {}
    try:
        with Live(_table(nodes, started), console=console, refresh_per_second=1) as live:
            while time.monotonic() - started < args.minutes * 60:
                if any(n.proc.poll() is not None for n in nodes):
                    break
                time.sleep(1.0)
                live.update(_table(nodes, started))
                for n in nodes:
                    if n.name not in initial_losses:
                        try:
                            loss = n.status(timeout=1.0).initial_loss
                        except grpc.RpcError:
                            continue
                        if loss == loss:  # not NaN
                            initial_losses[n.name] = loss
    finally:
        codes = leave_all(nodes)
    summary = summarize(nodes)
    for name, loss in initial_losses.items():
        summary.setdefault(name, {})["initial_loss"] = loss
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(nodes, args.out / "loss.png", initial_losses)
    from dilocox.daemon.plot import plot_run  # the same plot dilocox-ctl plot draws of one node's run

    run_plot = plot_run(nodes[0].workdir / "ckpt", args.out / "node0.png") if nodes[0].metrics() else None
    console.print(f"\nexit codes: {codes}")
    for name, s in summary.items():
        if "outer_steps" not in s:
            continue
        initial = s.get("initial_loss", float("nan"))
        console.print(f"{name}: outer steps {s['outer_steps']}, first-step loss {initial:.3f}, "
                      f"round-mean loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}, "
                      f"val {s['first_val_loss']:.3f} -> {s['last_val_loss']:.3f}, "
                      f"{s['tokens_per_second_compute']:.0f} tok/s, compute {s['median_compute_s']:.1f}s + "
                      f"averaging {s['median_comm_s']:.1f}s per outer step, "
                      f"{s['median_bytes_sent_per_outer_step'] / 1e6:.1f} MB sent per outer step, "
                      f"compute utilization {s['compute_utilization']:.0%}")
    console.print(f"summary: {args.out / 'summary.json'}\nplot:    {args.out / 'loss.png'}"
                  + (f"\nnode 0:  {run_plot} (dilocox-ctl plot {nodes[0].workdir / 'ckpt'} -o FILE.png)"
                     if run_plot else ""))
    return 0 if summary and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
