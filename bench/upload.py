"""``make bench-upload``: a node's upload per round on its network interface, all-gather against reduce-scatter,
on an EMULATED workload.

k hosts in network namespaces (tests/harness/netsim.py) joined at ``--rate`` Mbit/s each way run real ``dilocox-node``
processes on ``--workload synthetic:PARAMS:STEP_S`` (sleep-based compute: true payload sizes, no quality) for
``--outer-steps`` rounds, started together, once per scheme:

- ``sparse``: the default, each member's contribution all-gathered ((k - 1) payloads up per member);
- ``shared``: ``--compression shared``, one index set per round and the values reduce-scattered on it
  (peers/reducescatter.py).

Reported per k and scheme: the bytes each host's interface sent per node and round (everything: libp2p framing,
the DHT, matchmaking), in steady rounds (from the end of a node's first round to the end of its last, from tx
counters sampled every 0.5 s) and over the whole run (start-up included: the DHT join and the wait for all
replicas, some seconds of membership reads), in units of the default codec's payload for the workload (the
same denominator for both schemes; a shared member's own payload, its values on P and its proposal, is about
half of it), beside the transport's own count (``bytes_sent`` in metrics.jsonl, median over node-rounds after
the first) and whether every node ended with one theta.

    python -m bench.upload --nodes 8 16 --outer-steps 5

Nodes are forked from one shared image into their namespaces (``--launch forked``, tests/harness/forked.py: the same
daemon, so the same bytes; a fraction of the memory, which lets 32 hosts fit in 24 GB) or started as
one interpreter each under ``ip netns exec`` (``--launch interpreter``).

Results: runs/bench/upload.{json,png} and a printed table. ``--plot-from A/upload.json B/upload.json`` runs
nothing and draws one table and PNG from earlier runs (docs/img/upload-shared.png). Where rows of one k and
scheme were run at two or more payload sizes, the table adds their split into a part that grows with the payload
and a fixed part (``payload_fit``: membership records, matchmaking, per-call framing), and the payload from
which the fit puts a node's upload at or under 3x.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from bench.compare import run_swarm
from bench.swarm_size import default_payload_bytes
from tests.harness.localswarm import REPO
from tests.harness.netsim import NetSim

SCHEMES = {"sparse": ["--compression", "sparse"], "shared": ["--compression", "shared"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--workload", default="synthetic:4M:0.25")
    p.add_argument("--rate", type=float, default=1000.0, help="Mbit/s each way per host")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--outer-steps", type=int, default=5)
    p.add_argument("--launch", choices=("forked", "interpreter"), default="forked",
                   help="forked: every node forked from one shared image into its namespace (tests/harness/forked.py)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    p.add_argument("--plot-from", type=Path, nargs="+", metavar="UPLOAD_JSON",
                   help="run nothing: one table and PNG under --out from the rows of earlier runs' upload.json")
    a = p.parse_args(argv)
    a.inner_lr = "1e-3"
    if a.plot_from:
        try:
            rows = merged_rows(a.plot_from)
        except ValueError as e:
            print(f"--plot-from: {e}", file=sys.stderr)
            return 2
        _write(rows, a)
        print(table(rows))
        return 0
    ok, why = NetSim.available()
    if not ok:
        print(f"make bench-upload needs network namespaces: {why}", file=sys.stderr)
        return 2
    payload = default_payload_bytes(a.workload)
    rows = []
    for k in a.nodes:
        with NetSim(k, a.rate, prefix="dlxu") as net:
            for scheme in a.schemes:
                began = time.monotonic()
                res = run_swarm(net, a, f"upload_{k}_{scheme}", SCHEMES[scheme], a.out / "upload" / f"k{k}", k,
                                a.workload, forked=a.launch == "forked")
                folder = a.out / "upload" / f"k{k}" / f"upload_{k}_{scheme}"
                transport = _transport_sent(folder)
                rows.append(dict(nodes=k, scheme=scheme, workload=a.workload, rate_mbit=a.rate,
                                 default_payload_bytes=payload, tx_bytes_per_node_round=res["tx_bytes_per_node_round"],
                                 steady_tx_bytes_per_node_round=res["steady_tx_bytes_per_node_round"],
                                 steady_max_tx_bytes_per_node_round=res["steady_max_tx_bytes_per_node_round"],
                                 rx_bytes_per_node_round=res["rx_bytes_per_node_round"],
                                 transport_sent_bytes=transport, round_s=res["round_s"],
                                 group_sizes=res["group_sizes"], outcomes=res["outcomes"],
                                 digests_agree=res["digests_agree"], membership=membership_ops(folder),
                                 launch=a.launch, peak_memory_bytes=res["peak_memory_bytes"],
                                 bench_s=time.monotonic() - began))
                print(_line(rows[-1]), flush=True)
                _write(rows, a)
    print(table(rows))
    return 0


def merged_rows(paths: list[Path]) -> list[dict]:
    """The rows of several runs' upload.json, in order; a later run's row for the same (k, workload, scheme)
    replaces an earlier one. Raises ValueError naming a file that is not an upload.json of emulated runs."""
    rows: dict = {}
    for path in paths:
        try:
            data = json.loads(path.read_text())
            found = data["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a bench.upload result ({e})") from None
        if not data.get("emulated"):
            raise ValueError(f"{path}: not marked as an emulated workload")
        for r in found:
            rows[(r["nodes"], r["workload"], r["scheme"])] = r
    return sorted(rows.values(), key=lambda r: (r["workload"], r["scheme"], r["nodes"]))


def _node_rows(folder: Path) -> list[list[dict]]:
    """Each node's metrics.jsonl rows under ``folder`` (one list per node, in round order)."""
    return [[json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            for f in folder.glob("h*/**/metrics.jsonl")]


def _transport_sent(folder: Path) -> float:
    """The median ``bytes_sent`` of the nodes' rounds after their first (metrics.jsonl under ``folder``)."""
    sent = []
    for rows in _node_rows(folder):
        sent += [r["bytes_sent"] for r in rows[1:]]
    return statistics.median(sent) if sent else float("nan")


def membership_ops(folder: Path) -> dict:
    """Mean DHT operations on the membership keys per node-round after each node's first round (the cumulative
    ``membership`` counts of metrics.jsonl rows, peers/swarm.py ``Swarm.traffic``); {} without them."""
    total, rounds = {}, 0
    for rows in _node_rows(folder):
        counts = [r["membership"] for r in rows[1:] if "membership" in r]
        for before, after in zip(counts, counts[1:]):
            rounds += 1
            for name, n in after.items():
                total[name] = total.get(name, 0) + n - before.get(name, 0)
    return {name: n / rounds for name, n in total.items()} if rounds else {}


def payload_fit(rows: list[dict], target: float = 3.0) -> list[dict]:
    """Per (k, scheme) with rows at two or more payload sizes p (bytes, ``default_payload_bytes``): the least-squares
    line through their steady interface tx per node-round, tx = slope * p + fixed. ``slope`` (bytes sent per byte
    of payload: the transport's ratio and what grows with it, TCP/IP headers among them) and ``fixed`` (bytes per
    node-round whatever the payload: membership reads and publishes, matchmaking, each call's framing) come
    back with ``payload_at_target``, the payload p from which tx / p <= ``target`` (fixed / (target - slope);
    None where slope >= target: no payload meets it), and ``payloads`` (the sizes fitted). A model of two terms
    fitted to as many points as runs: with two runs it passes through both, so it interpolates between them and
    extrapolates only as far as the two terms hold."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["nodes"], r["scheme"]), {})[r["default_payload_bytes"]] = \
            r["steady_tx_bytes_per_node_round"]
    fits = []
    for (k, scheme), points in sorted(groups.items()):
        if len(points) < 2:
            continue
        ps, txs = list(points), list(points.values())
        pm, tm = statistics.fmean(ps), statistics.fmean(txs)
        slope = sum((p - pm) * (t - tm) for p, t in zip(ps, txs)) / sum((p - pm) ** 2 for p in ps)
        fixed = tm - slope * pm
        at = fixed / (target - slope) if slope < target else None
        fits.append(dict(nodes=k, scheme=scheme, slope=slope, fixed_bytes=fixed, target=target,
                         payload_at_target=max(at, 0.0) if at is not None else None, payloads=sorted(ps)))
    return fits


def _fit_table(fits: list[dict]) -> str:
    if not fits:
        return ""
    lines = ["", "Fitted over payload sizes (tx = slope x payload + fixed, steady rounds; bench.upload.payload_fit):",
             "", "| k | scheme | payloads fitted | slope (x payload) | fixed per node-round | 3x from a payload of |",
             "|---" * 6 + "|"]
    for f in fits:
        at = f["payload_at_target"]
        lines.append(f"| {f['nodes']} | {f['scheme']} | {', '.join(f'{p / 1e3:.0f} KB' for p in f['payloads'])} | "
                     f"{f['slope']:.2f} | {f['fixed_bytes'] / 1e3:.0f} KB | "
                     f"{'never (slope >= 3)' if at is None else f'{at / 1e3:.0f} KB'} |")
    return "\n".join(lines) + "\n"


def _ops(r: dict) -> str:
    m = r.get("membership") or {}
    return f"{m['reads']:.1f} / {m['publishes']:.1f} ({m['searches']:.2f})" if m else "-"


def _callers(r: dict) -> str:
    """The membership reads per node-round by the function that made them (``reads_by:`` counts), most first."""
    m = r.get("membership") or {}
    by = sorted(((k.split(":", 1)[1], v) for k, v in m.items() if k.startswith("reads_by:")), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {n:.2f}" for name, n in by if n >= 0.005)


def _line(r: dict) -> str:
    p = r["default_payload_bytes"]
    return (f"k={r['nodes']:>3} {r['scheme']:>6}: tx {r['steady_tx_bytes_per_node_round'] / 1e6:.2f} MB/node/round "
            f"in steady rounds ({r['steady_tx_bytes_per_node_round'] / p:.2f}x the default payload, the busiest "
            f"node {r.get('steady_max_tx_bytes_per_node_round', math.nan) / p:.2f}x; "
            f"{r['tx_bytes_per_node_round'] / p:.2f}x with start-up), transport "
            f"{r['transport_sent_bytes'] / p:.2f}x, round {r['round_s']:.1f}s, groups {r['group_sizes']}, "
            f"digests agree {r['digests_agree']}, membership reads / publishes (searches) per node-round {_ops(r)}"
            + (f"; reads by caller: {_callers(r)}" if _callers(r) else ""))


def table(rows: list[dict]) -> str:
    lines = ["EMULATED workload (sleep-based compute, true payload sizes); hosts in network namespaces; x = per node "
             "and round / the default codec's payload for the workload's values.", "",
             "| k | values | scheme | interface tx / steady round | x payload | busiest node (x) "
             "| x payload, start-up included | transport sent (x payload) | round s | groups | one theta "
             "| membership reads / publishes (searches) per node-round |", "|---" * 12 + "|"]
    for r in rows:
        p = r["default_payload_bytes"]
        groups = ", ".join(f"{g}" for g in sorted(set(r["group_sizes"])))
        steady = r["steady_tx_bytes_per_node_round"]
        lines.append(f"| {r['nodes']} | {r['workload'].split(':')[1]} | {r['scheme']} | "
                     f"{steady / 1e6:.3f} MB | {steady / p:.2f} | "
                     f"{r.get('steady_max_tx_bytes_per_node_round', math.nan) / p:.2f} | "
                     f"{r['tx_bytes_per_node_round'] / p:.2f} | "
                     f"{r['transport_sent_bytes'] / p:.2f} | {r['round_s']:.1f} | {groups} | {r['digests_agree']} | "
                     f"{_ops(r)} |")
    callers = [f"- k = {r['nodes']}, {r['workload'].split(':')[1]} values, {r['scheme']}: {_callers(r)}"
               for r in rows if _callers(r)]
    if callers:
        lines += ["", "Membership reads per node-round by caller (steady rounds; Swarm.traffic's reads_by):", *callers]
    return "\n".join(lines) + "\n" + _fit_table(payload_fit(rows))


def _write(rows: list[dict], a) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "upload.json").write_text(json.dumps(dict(rows=rows, emulated=True, fits=payload_fit(rows),
                                                       args={k: str(v) for k, v in vars(a).items()}), indent=1))
    (a.out / "upload.md").write_text(table(rows))
    plot(rows, a.out / "upload.png")
    if payload_fit(rows):
        plot_fit(rows, a.out / "upload-payloads.png")


def plot(rows: list[dict], path: Path) -> None:
    """Interface tx per node and round / the default payload against k, a line per scheme and workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for n, (workload, scheme) in enumerate(dict.fromkeys((r["workload"], r["scheme"]) for r in rows)):
        sel = sorted((r for r in rows if (r["workload"], r["scheme"]) == (workload, scheme)), key=lambda r: r["nodes"])
        ks = [r["nodes"] for r in sel]
        style = "o-" if scheme == "sparse" else "s-"
        ax.plot(ks, [r["steady_tx_bytes_per_node_round"] / r["default_payload_bytes"] for r in sel], style,
                c=f"C{n}", label=f"{scheme}, {workload.split(':')[1]} values: interface, steady rounds")
        ax.plot(ks, [r["transport_sent_bytes"] / r["default_payload_bytes"] for r in sel], style[0] + ":",
                c=f"C{n}", alpha=0.5, label=f"{scheme}, {workload.split(':')[1]} values: transport")
    ax.axhline(3, ls="--", c="gray", label="3 x payload (issue 29's target)")
    ax.set(xlabel="nodes (one group)", ylabel="sent per node and round / default payload",
           title="Upload, EMULATED workload, hosts in network namespaces")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fit(rows: list[dict], path: Path) -> None:
    """Interface tx per node and round / the payload against the payload (bytes), a colour per k: the measured
    rows as points, the ``payload_fit`` line (slope + fixed / payload) through them and on to 4 MB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for n, f in enumerate(payload_fit(rows)):
        sel = [r for r in rows if (r["nodes"], r["scheme"]) == (f["nodes"], f["scheme"])]
        ax.plot([r["default_payload_bytes"] / 1e3 for r in sel],
                [r["steady_tx_bytes_per_node_round"] / r["default_payload_bytes"] for r in sel], "o", c=f"C{n}",
                label=f"k = {f['nodes']} ({f['scheme']}): measured")
        lo = min(f["payloads"])
        xs = [lo * (4e6 / lo) ** (i / 50) for i in range(51)]
        ax.plot([x / 1e3 for x in xs], [f["slope"] + f["fixed_bytes"] / x for x in xs], "-", c=f"C{n}", alpha=0.6,
                label=f"k = {f['nodes']}: {f['slope']:.2f} + {f['fixed_bytes'] / 1e3:.0f} KB / payload")
    ax.axhline(3, ls="--", c="gray", label="3 x payload (issue 29's target)")
    ax.set(xlabel="payload per node (KB, the default codec's)", ylabel="sent per node and round / payload",
           title="Upload against payload size (EMULATED workload, namespaces)")
    ax.set_xscale("log")
    ticks = [t for t in (100, 200, 500, 1000, 2000, 4000) if min(f["payloads"][0] for f in payload_fit(rows)) / 2e3
             <= t]
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
