"""The deadlines nodes choose from their measurements, at 1000, 100 and 10 Mbit/s.

Three public nodes on tbf-shaped links (tests/harness/netsim.py) train a model 4x the tiny preset with the
default sparse rounds and default timeouts; per rate it reports the deadlines the nodes chose after
measuring (peers/deadlines.py: downloads, matchmaking, group wait), their measured rate, and the
rounds each node applied in a full group or lost. ``--fixed`` also runs each rate with
``--no-adaptive-deadlines`` (the fixed flags of before), side by side.

    python -m bench.deadlines [--rates 1000 100 10] [--rounds 8] [--fixed] [--out runs/bench/deadlines.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

from tests.harness.localswarm import LocalNode, wait_all, write_json
from tests.harness.netsim import NetSim

MODEL_4X_TINY = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                     seq_len=64, batch_size=8)
ARGS = ["--status-addr", "127.0.0.1:0", "--run-id", "deadlines", "--inner-steps", "20", "--announce-period", "1",
        "--warmup-steps", "5", "--total-steps", "4000", "--eval-batches", "1", "--min-replicas", "3"]


def run_rate(workdir: Path, rate_mbit: float, rounds: int, adaptive: bool, timeout_s: float = 400) -> dict:
    model = workdir / "model.json"
    model.write_text(json.dumps(MODEL_4X_TINY))
    extra = ["--model", str(model)] + ([] if adaptive else ["--no-adaptive-deadlines"])
    nodes: list[LocalNode] = []
    started = time.monotonic()
    with NetSim(3, rate_mbit, prefix="dlxdl") as net:
        try:
            for i in range(3):
                join = ["--join", nodes[0].join_maddr] if nodes else []
                nodes.append(LocalNode(f"n{i}", workdir / f"n{i}", ARGS + extra + join + [
                    "--listen", f"/ip4/{net.address(i)}/tcp/0"], wrapper=net.wrapper(i)).wait_started())
            try:
                wait_all(nodes, lambda: all(len(n.metrics()) >= rounds for n in nodes), timeout_s, f"{rounds} rounds")
            except TimeoutError:
                pass  # reported as lost rounds
            rows = {n.name: n.metrics() for n in nodes}
        finally:
            for n in nodes:
                n.terminate(signal.SIGKILL)
    measured = [r for rs in rows.values() for r in rs if r.get("link_mbps", 0) > 0]
    return dict(
        rate_mbit=rate_mbit, adaptive=adaptive, wall_s=round(time.monotonic() - started, 1),
        rounds={name: len(rs) for name, rs in rows.items()},
        full_group_rounds={name: sum(r["outcome"] == "applied" and r["group_size"] == 3 for r in rs)
                           for name, rs in rows.items()},
        lost_rounds={name: sum(r["outcome"] != "applied" or r["group_size"] < 3 for r in rs)
                     for name, rs in rows.items()},
        payload_bytes=statistics.median(r["payload_bytes"] for rs in rows.values() for r in rs) if measured else 0,
        download_deadline_s=dict(
            first=[rs[0]["download_deadline_s"] for rs in rows.values() if rs],
            median_measured=statistics.median(r["download_deadline_s"] for r in measured) if measured else None),
        matchmaking_s=dict(first=[rs[0].get("matchmaking_s") for rs in rows.values() if rs],
                           median_measured=statistics.median(r.get("matchmaking_s", 0) for r in measured)
                           if measured else None),
        group_wait_s=dict(first=[rs[0].get("group_wait_s") for rs in rows.values() if rs],
                          median_measured=statistics.median(r.get("group_wait_s", 0) for r in measured)
                          if measured else None),
        link_mbps_median=statistics.median(r["link_mbps"] for r in measured) if measured else None,
        median_download_s=statistics.median(r["allreduce_s"] for rs in rows.values() for r in rs) if measured else None,
        max_wait_s=max((r["wait_s"] for rs in rows.values() for r in rs), default=None),
        median_wait_s=statistics.median(r["wait_s"] for rs in rows.values() for r in rs) if measured else None,
        median_round_s=statistics.median(b - a for rs in rows.values() for a, b in
                                         zip([r["time"] for r in rs], [r["time"] for r in rs][1:]))
        if measured else None,
        median_utilization=statistics.median(r["compute_utilization"] for rs in rows.values() for r in rs[1:])
        if measured else None,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[1000, 100, 10])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--fixed", action="store_true", help="also run every rate with --no-adaptive-deadlines")
    p.add_argument("--out", type=Path, default=Path("runs/bench/deadlines.json"))
    a = p.parse_args(argv)
    ok, why = NetSim.available()
    if not ok:
        raise SystemExit(f"bench.deadlines needs network namespaces: {why}")
    results = []
    for rate in a.rates:
        for adaptive in ([True, False] if a.fixed else [True]):
            with tempfile.TemporaryDirectory(prefix="dilocox-deadlines-") as tmp:
                r = run_rate(Path(tmp), rate, a.rounds, adaptive)
            results.append(r)
            print(f"{rate:>6g} Mbit/s {'measured' if adaptive else 'fixed   '}: download deadline "
                  f"{r['download_deadline_s']['median_measured']} s, matchmaking "
                  f"{r['matchmaking_s']['median_measured']} s, group wait {r['group_wait_s']['median_measured']} s "
                  f"(link {r['link_mbps_median']} Mbit/s, payload "
                  f"{r['payload_bytes']} B), full-group rounds {r['full_group_rounds']}, lost {r['lost_rounds']}, "
                  f"max wait {r['max_wait_s']:.1f} s, median wait {r['median_wait_s']} s, median time between "
                  f"rounds {r['median_round_s']} s, median compute utilization {r['median_utilization']}", flush=True)
    write_json(a.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
