"""``make bench-overlap``: synchronous against overlapped rounds at real payload sizes, on an EMULATED workload.

The model is ``--workload synthetic:PARAMS:STEP_S`` (dilocox/synthetic.py): PARAMS fp32 values whose inner
step sleeps STEP_S seconds and writes a deterministic dense update, so the sparse codec, the all-gather, the
robust aggregation, the outer step and the digests run at the true sizes of 25 M to 250 M parameter models
on 2 cores. Compute is emulated (sleep): utilization and round phases are real, quality is not measured.

Hosts live in network namespaces (tests/harness/netsim.py) joined by links of 10, 100 and 1000 Mbit/s each way with
50 ms of one-way delay and +-10 ms jitter on every host's egress (100 ms RTT; a userspace delay line,
tests/harness/delayline.py, as this kernel has no netem). Per configuration (PARAMS, nodes) and rate, two runs of the
daemon's defaults: ``sync`` (--overlap none) and ``adaptive`` (--overlap adaptive). Reported per run, from the
nodes' metrics.jsonl and the interfaces' counters: compute utilization, seconds per round, bytes sent and
received per node and round, the median time of each round phase (encode, group = matchmaking and metadata,
gather = downloads, aggregate = decode + validate + CenteredClip, apply, exchange = from the end of the inner
steps to a complete result, wait = the training thread blocked), the delay tau adaptive rounds ran with, and
each node's peak memory (PSS of its process tree) and bytes per parameter.

    python -m bench.overlap_scale --outer-steps 4                  # the grid below (~60 min on 2 cores)
    python -m bench.overlap_scale --configs 25M:4 --rates 100 --outer-steps 4   # one cell
    python -m bench.overlap_scale --configs 100M:4:2 --outer-steps 4 --keep     # redo a row, keep the rest

Results: runs/bench/overlap-scale.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from bench.compare import PHASES, run_swarm
from dilocox.synthetic import parse_spec
from tests.harness.localswarm import REPO
from tests.harness.netsim import NetSim

MODES = {"sync": ["--overlap", "none"], "adaptive": ["--overlap", "adaptive"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 4 nodes of 100M values share 2 cores: their encodes, aggregations, outer steps and digests take ~40 CPU-seconds
    # at each round's end, so those rounds are longer (emulated steps of 2 s)
    p.add_argument("--configs", nargs="+", default=["25M:4:1", "100M:4:2", "250M:2:2"],
                   help="PARAMS:NODES[:STEP_S] (STEP_S default --step-s)")
    p.add_argument("--rates", type=float, nargs="+", default=[1000, 100, 10])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--step-s", type=float, default=1.0, help="emulated seconds per inner step")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--outer-steps", type=int, default=6)
    p.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay per host egress (RTT: twice)")
    p.add_argument("--jitter-ms", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    p.add_argument("--keep", action="store_true",
                   help="keep the other cells of OUT/overlap-scale.json (grow the grid over several runs)")
    a = p.parse_args(argv)
    a.inner_lr = "1e-3"
    ok, why = NetSim.delay_available()
    if not ok:
        print(f"make bench-overlap needs network namespaces and TUN devices: {why}", file=sys.stderr)
        return 2
    rows = []
    if a.keep and (a.out / "overlap-scale.json").exists():  # cells of an earlier run this one does not redo
        redo = {(c, float(r)) for c in a.configs for r in a.rates}
        rows = [r for r in json.loads((a.out / "overlap-scale.json").read_text())["rows"]
                if (r["config"], float(r["rate_mbit"])) not in redo]
    for config in a.configs:
        params, nodes, *step = config.split(":")
        spec = f"synthetic:{params}:{float(step[0]) if step else a.step_s:g}"
        n_values, _ = parse_spec(spec)
        for rate in a.rates:
            with NetSim(int(nodes), rate, prefix="dlxo", delay_ms=a.delay_ms, jitter_ms=a.jitter_ms) as net:
                for mode in a.modes:
                    started = time.monotonic()
                    res = run_swarm(net, a, f"ovl_{params}_{mode}", MODES[mode],
                                    a.out / "overlap-scale" / f"{params}-{rate:g}", int(nodes), spec)
                    res.update(params=n_values, config=config, nodes=int(nodes), rate_mbit=rate, mode=mode,
                               workload=spec, bench_s=time.monotonic() - started,
                               peak_bytes_per_param=[m / n_values for m in res["peak_memory_bytes"]])
                    rows.append(res)
                    print(_line(res), flush=True)
                    _write(rows, a)
    _write(rows, a)
    print(f"results: {a.out}/overlap-scale.json, .csv, .png")
    return 0


def _line(r: dict) -> str:
    ph = r["phases"]
    return (f"{r['config']:>8} {r['rate_mbit']:>6g} Mbit/s {r['mode']:>8}: util {r['compute_utilization']:.0%} "
            f"round {r['round_s']:.1f}s tx {r['tx_bytes_per_node_round'] / 1e6:.1f} MB rx "
            f"{r['rx_bytes_per_node_round'] / 1e6:.1f} MB/node/round; " +
            " ".join(f"{k[:-2] if k.endswith('_s') else k} {ph[k]:.2f}" for k in PHASES) +
            f"; peak {max(r['peak_bytes_per_param']):.0f} B/param; digests agree {r['digests_agree']}")


def _write(rows: list[dict], a) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "overlap-scale.json").write_text(json.dumps(dict(rows=rows, args={k: str(v) for k, v in vars(a).items()},
                                                             emulated=True), indent=1))
    keys = ["config", "rate_mbit", "mode", "compute_utilization", "round_s", "compute_s", "tx_bytes_per_node_round",
            "rx_bytes_per_node_round", "payload_bytes", *PHASES, "peak_bytes_per_param", "digests_agree"]
    with open(a.out / "overlap-scale.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, **r["phases"], "peak_bytes_per_param": round(max(r["peak_bytes_per_param"]), 1)})
    _plot(rows, a.out / "overlap-scale.png")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    seen: set = set()
    for k, config in enumerate(dict.fromkeys(r["config"] for r in rows)):
        for mode, style in (("sync", "--"), ("adaptive", "-")):
            sel = sorted((r for r in rows if r["config"] == config and r["mode"] == mode), key=lambda r: r["rate_mbit"])
            if sel:
                params, nodes, *step = config.split(":")
                label = f"{params} values x {nodes} nodes, {step[0] if step else '1'} s steps, {mode}"
                rates = [r["rate_mbit"] for r in sel]
                for ax, ys in ((axes[0], [100 * r["compute_utilization"] for r in sel]),
                               (axes[1], [r["phases"]["exchange_s"] for r in sel])):
                    ax.plot(rates, ys, style, marker="o", color=f"C{k}", label=label)
                    bad = [(x, y) for x, y, r in zip(rates, ys, sel) if not r["digests_agree"]]
                    if bad:  # theta differed between nodes: the round split (see the table)
                        ax.plot(*zip(*bad), "x", color="red", markersize=11, mew=2,
                                label="digests differ" if ax is axes[0] and "split" not in seen else None)
                        seen.add("split")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("link rate each way (Mbit/s), 100 ms RTT")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("compute utilization (%)")
    axes[0].axhline(95, color="grey", lw=0.8)
    axes[1].set_ylabel("exchange after the inner steps (s, median)")
    axes[0].set_title("EMULATED workload: utilization, synchronous vs adaptive overlap")
    axes[1].set_title("communication the round's end must hide")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
