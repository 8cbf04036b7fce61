"""Upload per member and round, all-gather against reduce-scatter on a shared index set, as the group grows
(``make bench-reducescatter``).

For each group size k (``--groups``, default 8, 16 and 32): k real hivemind peers on loopback in this
process (a DHT and a ContributionServer each: the daemon's transport), and ``--rounds`` rounds of each
scheme on the same pseudo-gradients:

* **all-gather** (the daemon's sparse round, peers/allgather.py): each member offers its default sparse
  contribution (top-128 of each 4096, 2-bit values, Rice-coded indices) and fetches every other's;
* **reduce-scatter rB** (peers/reducescatter.py): proposals by range to their reducers, each range's union
  gathered, values by range to their reducers, results gathered (``--topk`` positions per chunk in the
  union, ``--bits``; one row per ``--result-bits`` B).

Measured: the payload bytes each member served under the round's keys once every member finished
(``ContributionServer.served_bytes``; application bytes, not interface counters: no p2p framing, no DHT
traffic), in units of that member's own default contribution (the all-gather's payload), median over
members and rounds with min and max; and each round's wall time (seconds; k peers share this machine's
cores, so it measures contention more than links).

**Emulated workload**: pseudo-gradients are synthetic, m_r = g + noise_r with g shared by the round and
unit-normal g and noise (``--values`` values): replicas of one model agree in part; how much changes how
far the proposals overlap, so the union's size (and the index bytes) are an estimate. No training here:
quality is measured in bench/quality.py (methods ``shared-union-*``). Results: a printed table,
runs/bench/reducescatter.{json,csv} and a PNG (``--out``).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import threading
import time
from pathlib import Path

import torch
from dilocox.peers.averaging import RoundFailed
from dilocox.peers.reducescatter import RangeRound, ReduceScatter

from dilocox.shared_index import ReducerFeedback, SharedIndexConfig, SharedIndexMember
from dilocox.sparse import SparseCodec, SparseConfig
from tests.harness.localswarm import peers_on_loopback

OUT = Path("runs/bench")
DEFAULT = SparseConfig(topk=128, bits=2, beta=0.9, rice=True)  # the daemon's contribution


def _threads(fn, items) -> None:
    threads = [threading.Thread(target=fn, args=item) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_group(k: int, args) -> list[dict]:
    """``args.rounds`` rounds of each scheme with k peers; one row per member and round."""
    cfgs = {f"reduce-scatter r{b}": SharedIndexConfig(topk=args.topk, bits=args.bits, result_bits=b,
                                                      selection="union") for b in args.result_bits}
    rows = []
    with peers_on_loopback(k, f"bench_reducescatter_{k}", offer_wait_s=30.0, keep=4 * k + 4) as peers:
        group = [p for p, _, _ in peers]
        codecs = {p: SparseCodec([(args.values,)], DEFAULT) for p in group}
        members = {(name, p): SharedIndexMember(args.values, cfg) for name, cfg in cfgs.items() for p in group}
        feedbacks = {(name, p): ReducerFeedback(args.values) for name in cfgs for p in group}
        for r in range(args.rounds):
            g = torch.Generator().manual_seed(1000 * k + r)
            shared = torch.randn(args.values, generator=g)
            deltas = {p: shared + torch.randn(args.values, generator=g) for p in group}
            payloads = {p: codecs[p].encode([deltas[p]]) for p in group}
            walls, failures = {}, {}

            def all_gather(p, server):
                server.offer(f"ag/{r}", payloads[p])
                t0 = time.monotonic()
                _, failed = server.fetch({q: (None, len(payloads[q])) for q in group if q != p}, f"ag/{r}", 120.0)
                walls[("all-gather", p)] = time.monotonic() - t0
                if failed:
                    failures[("all-gather", p)] = failed

            def reduce_scatter(name, p, server):
                m = members[(name, p)].accumulate([deltas[p]])
                t0 = time.monotonic()
                try:
                    ReduceScatter(server, p, 120.0).run(RangeRound(group, f"{name}/{r}", members[(name, p)], m,
                                                                   {q: 1.0 for q in group}, feedbacks[(name, p)]))
                except RoundFailed as e:
                    failures[(name, p)] = str(e)
                walls[(name, p)] = time.monotonic() - t0

            _threads(all_gather, [(p, s) for p, s, _ in peers])
            for name in cfgs:
                _threads(reduce_scatter, [(name, p, s) for p, s, _ in peers])
            time.sleep(0.5)  # late fetches of our result are counted by the server: let them land
            for p, s, _ in peers:
                keys = {"all-gather": [f"ag/{r}"]} | {
                    name: [f"{name}/{r}/u", f"{name}/{r}/r"] + [f"{name}/{r}/{x}{j}" for j in range(k) for x in "pv"]
                    for name in cfgs}
                for scheme, ks in keys.items():
                    parts = {part: sum(s.served_bytes(x) for x in ks if x.split("/")[-1][0] == part)
                             for part in "puvr"}  # proposals, unions, values, results
                    rows.append(dict(k=k, round=r, scheme=scheme, peer=p, payload_bytes=len(payloads[p]),
                                     upload_bytes=sum(s.served_bytes(x) for x in ks), wall_s=walls[(scheme, p)],
                                     proposals_bytes=parts["p"], unions_bytes=parts["u"], values_bytes=parts["v"],
                                     results_bytes=parts["r"],
                                     failed=str(failures.get((scheme, p), ""))))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    for k in sorted({r["k"] for r in rows}):
        for scheme in schemes:
            mine = [r for r in rows if r["k"] == k and r["scheme"] == scheme and not r["failed"]]
            if not mine:
                out.append(dict(k=k, scheme=scheme, ok=0))
                continue
            ratio = [r["upload_bytes"] / r["payload_bytes"] for r in mine]
            parts = {f"{part}_x": statistics.median(r[f"{part}_bytes"] / r["payload_bytes"] for r in mine)
                     for part in ("proposals", "unions", "values", "results")} if scheme != "all-gather" else {}
            out.append(dict(k=k, scheme=scheme, ok=len(mine), failed=sum(
                1 for r in rows if r["k"] == k and r["scheme"] == scheme and r["failed"]),
                upload_x=statistics.median(ratio), upload_min=min(ratio), upload_max=max(ratio),
                upload_bytes=statistics.median(r["upload_bytes"] for r in mine),
                payload_bytes=statistics.median(r["payload_bytes"] for r in mine),
                wall_s=statistics.median(r["wall_s"] for r in mine), **parts))
    return out


def plot(summary: list[dict], path: Path, values: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for scheme, colour in zip(dict.fromkeys(s["scheme"] for s in summary), ("tab:red", "tab:blue", "tab:green",
                                                                           "tab:purple")):
        pts = [s for s in summary if s["scheme"] == scheme and s.get("ok")]
        ks = [s["k"] for s in pts]
        ys = [s["upload_x"] for s in pts]
        yerr = [[y - s["upload_min"] for y, s in zip(ys, pts)], [s["upload_max"] - y for y, s in zip(ys, pts)]]
        ax.errorbar(ks, ys, yerr=yerr, marker="o", color=colour, capsize=3, label=scheme)
    ax.axhline(3, color="grey", ls="--", lw=0.8, label="target: 3x own payload")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("group size k")
    ax.set_ylabel("upload per member and round (x own payload)")
    ax.set_title(f"real P2P on loopback, synthetic pseudo-gradients ({values / 1e6:.1f} M values)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--values", type=int, default=1 << 21)
    ap.add_argument("--topk", type=int, default=256, help="positions per 4096-value chunk in the union")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--result-bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--out", type=Path, default=OUT / "reducescatter")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for k in args.groups:
        t0 = time.monotonic()
        rows += run_group(k, args)
        print(f"k={k}: {time.monotonic() - t0:.0f} s", flush=True)
    summary = summarize(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(settings=vars(args) | dict(out=str(args.out)),
                                                             summary=summary, rows=rows), indent=1))
    with args.out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({key for s in summary for key in s}))
        w.writeheader()
        w.writerows(summary)
    plot(summary, args.out.with_suffix(".png"), args.values)
    print("| k | scheme | upload, median [min, max] (x own payload) | of which proposals / unions / values / results | "
          "upload (bytes) | round wall (s) | failed |")
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        if s.get("ok"):
            split = " / ".join(f"{s[f'{x}_x']:.2f}" for x in ("proposals", "unions", "values", "results")) \
                if "values_x" in s else "—"
            print(f"| {s['k']} | {s['scheme']} | {s['upload_x']:.2f} [{s['upload_min']:.2f}, {s['upload_max']:.2f}] | "
                  f"{split} | {s['upload_bytes']:,.0f} | {s['wall_s']:.1f} | {s['failed']} |")
        else:
            print(f"| {s['k']} | {s['scheme']} | all failed | | | | |")


if __name__ == "__main__":
    main()
