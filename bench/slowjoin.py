"""A joiner whose state download is slower than a round (daemon/transfer.py, dilocox/catchup.py).

Three public nodes on tbf-shaped links (tests/harness/netsim.py) train a model 4x the tiny preset with the
default sparse rounds. Two start together on 100 Mbit/s links; once they have averaged a few rounds
a third joins on a slower link, with ``--client-mode`` (a slow DHT member stalls everyone's DHT
requests while its link is full: docs/operations.md). At 2 Mbit/s its state download (theta +
momentum, 3.7 MB) takes about two of the swarm's rounds, so the state it lands with is outdated:
the joiner replays the updates applied meanwhile (catch-up) and joins the next round it can reach.
``--compare`` runs the same swarm with ``--catch-up-steps 0``, where
the joiner can only download again, side by side.

Reported: the joiner's state downloads (count, seconds each), the swarm's median round time, the
outer steps and bytes it caught up, how many outer steps after its download landed it first
averaged in a group of 3, and whether every node holds equal parameters at every step from its
first round on.

    python -m bench.slowjoin [--rate-mbit 2] [--compare] [--out runs/bench/slowjoin.json]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import tempfile
from pathlib import Path
from typing import Sequence

from bench.deadlines import MODEL_4X_TINY
from tests.harness.localswarm import LocalNode, steps_of, wait_all, write_json
from tests.harness.netsim import NetSim

# timeouts a 2-core machine keeps with three nodes, one of them starting (1 s request timeouts are missed there)
ARGS = ["--status-addr", "127.0.0.1:0", "--run-id", "slowjoin", "--inner-steps", "60", "--announce-period", "1",
        "--warmup-steps", "5", "--total-steps", "4000", "--eval-batches", "1", "--request-timeout", "2",
        "--matchmaking-time", "4", "--averaging-timeout", "15", "--outer-round-deadline", "60"]
SWARM_MBIT = 100  # the swarm's links; the joiner's is ``rate_mbit``
DOWNLOADED = re.compile(r"downloaded the state of outer step (\d+) from \S+ in ([\d.]+) s \((\d+) bytes\)")
CAUGHT_UP = re.compile(r"caught up from outer step (\d+) to (\d+) by replaying (\d+) applied updates \((\d+) bytes\)")


def run(workdir: Path, rate_mbit: float = 2.0, catch_up: bool = True, warm_rounds: int = 4,
        timeout_s: float = 240, prefix: str = "dlxsj", joiner_args: Sequence[str] = ("--client-mode",)) -> dict:
    """Run the swarm and the slow joiner; returns the figures (module docstring). A joiner that has not
    averaged within ``timeout_s`` is reported in ``timed_out``; a node that exits raises RuntimeError."""
    model = workdir / "model.json"
    model.write_text(json.dumps(MODEL_4X_TINY))
    # --bandwidth-mbps: the state's transfer time at our link bounds the download's timeout
    extra = ["--model", str(model)] + ([] if catch_up else ["--catch-up-steps", "0"])
    nodes: list[LocalNode] = []
    timed_out = None
    started_after = 0
    with NetSim(3, SWARM_MBIT, prefix=prefix, host_rates={2: rate_mbit}) as net:
        def start(i: int, more: list[str]) -> LocalNode:
            return LocalNode(f"n{i}", workdir / f"n{i}", ARGS + extra + more +
                             ["--listen", f"/ip4/{net.address(i)}/tcp/0"], wrapper=net.wrapper(i)).wait_started()

        try:
            nodes.append(start(0, ["--min-replicas", "2"]))
            nodes.append(start(1, ["--min-replicas", "2", "--join", nodes[0].join_maddr]))
            wait_all(nodes, lambda: all(len(n.metrics()) >= warm_rounds for n in nodes), timeout_s,
                     f"{warm_rounds} rounds each")
            started_after = max(max(steps_of(n)) for n in nodes)
            # --bandwidth-mbps: our link's rate, so the download's timeout allows the state's transfer time
            joiner = start(2, ["--join", nodes[0].join_maddr, "--bandwidth-mbps", str(rate_mbit / 2)] +
                           list(joiner_args))
            nodes.append(joiner)
            try:
                wait_all(nodes, lambda: any(r["outcome"] == "applied" and r["group_size"] == 3
                                            for r in joiner.metrics()), timeout_s, "an averaged round of the joiner")
                last = max(steps_of(joiner))  # one more round of everyone, to compare parameters
                wait_all(nodes, lambda: all(max(steps_of(n), default=0) > last for n in nodes), 60, "one more round")
            except TimeoutError as e:
                timed_out = str(e).splitlines()[0]
        finally:
            logs = {n.name: n.err_path.read_text() for n in nodes}
            rows = {n.name: n.metrics() for n in nodes}
            for n in nodes:
                n.terminate(signal.SIGKILL)
    log = logs.get("n2", "")
    downloads = [dict(outer_step=int(m[1]), seconds=float(m[2]), bytes=int(m[3])) for m in DOWNLOADED.finditer(log)]
    caught = [dict(from_step=int(m[1]), to_step=int(m[2]), updates=int(m[3]), bytes=int(m[4]))
              for m in CAUGHT_UP.finditer(log)]
    mine = rows.get("n2", [])
    first_round = mine[0]["outer_step"] if mine else None
    averaged = [r["outer_step"] for r in mine if r["outcome"] == "applied" and r["group_size"] == 3]
    # the swarm's outer step when the download landed: where the first catch-up went (or the state's own)
    landed = caught[0]["to_step"] if caught else (downloads[-1]["outer_step"] if downloads else None)
    times = [r["time"] for r in rows["n0"] if r["outer_step"] > started_after]
    round_s = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 2 else None
    by_step: dict[int, set] = {}
    for name, rs in rows.items():
        for r in rs:
            by_step.setdefault(r["outer_step"], set()).add(r["digest"])
    return dict(
        rate_mbit=rate_mbit, catch_up=catch_up, timed_out=timed_out, joiner_started_after_step=started_after,
        downloads=downloads, caught_up=caught, swarm_round_s=round_s,
        joiner_first_round=first_round, joiner_rounds=len(mine),
        joiner_averaged_in_round=(averaged[0] - first_round + 1) if averaged else None,
        rounds_from_download_to_average=(averaged[0] - landed) if averaged and landed is not None else None,
        equal_digests_from_join=all(len(by_step[s]) == 1 for s in by_step if first_round and s >= first_round),
        resyncs=log.count("re-syncing from peers"),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate-mbit", type=float, default=2.0)
    p.add_argument("--compare", action="store_true", help="also run with --catch-up-steps 0")
    p.add_argument("--timeout", type=float, default=240, help="seconds for the joiner to average")
    p.add_argument("--out", type=Path, default=Path("runs/bench/slowjoin.json"))
    a = p.parse_args(argv)
    ok, why = NetSim.available()
    if not ok:
        raise SystemExit(f"bench.slowjoin needs network namespaces: {why}")
    results = []
    for catch_up in ([True, False] if a.compare else [True]):
        with tempfile.TemporaryDirectory(prefix="dilocox-slowjoin-") as tmp:
            r = run(Path(tmp), a.rate_mbit, catch_up, timeout_s=a.timeout)
        results.append(r)
        secs = ", ".join(f"{d['seconds']:.1f}" for d in r["downloads"])
        print(f"catch-up {'on ' if catch_up else 'off'}: {len(r['downloads'])} state download(s) ({secs} s; the "
              f"swarm's rounds took {r['swarm_round_s'] or float('nan'):.1f} s), caught up "
              f"{sum(c['updates'] for c in r['caught_up'])} outer steps in "
              f"{sum(c['bytes'] for c in r['caught_up'])} bytes; averaged in its round "
              f"{r['joiner_averaged_in_round']}; equal digests {r['equal_digests_from_join']}"
              + (f"; TIMED OUT: {r['timed_out']}" if r["timed_out"] else ""), flush=True)
    write_json(a.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
