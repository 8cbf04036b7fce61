"""``make bench``: vanilla AllReduce vs DiLoCo vs DiLoCoX on shaped links.

Two hosts in network namespaces (tests/harness/netsim.py), both directions of each link limited with tbf
to 10, 100 and 1000 Mbit/s. On the same data, model (``small`` preset), lr schedule and token
budget per replica (outer_steps x H inner steps of batch x seq tokens):
  (a) ddp        torch DDP over gloo, all-reduce every step (bench/ddp.py)
  (b) diloco     DiLoCo, synchronous, fp32            (--overlap none --compression none)
  (c) diloco16   DiLoCo, 16-bit codes (as OpenDiLoCo) (--overlap none --compression fp16)
  (d) dilocox    one-step delay + adaptive low rank   (--overlap delayed --compression adaptive), the
                 default until 2026-11
  (e) default    the daemon's defaults: synchronous rounds matched during their last inner steps,
                 sparse contributions (top-128 of 4096, Rice-coded indices, 2-bit, error feedback
                 decay 0.9, outer SGD ramped 2.5 -> 4.5) all-gathered and combined by CenteredClip
  (f) adaptive   the same with --overlap adaptive: round t's exchange runs while round t+1 computes and
                 its update joins the local parameters as soon as it is in (docs/algorithms.md)
Per run: tokens/s per replica (steady state), compute utilization, bytes on the wire per token
(tx bytes of the hosts' interfaces, read from sysfs inside the namespaces: everything, DHT
included), validation loss of the final parameters, and the speedup of (d) over (a).
DDP at the slow rates runs for ``--ddp-seconds`` only (its loss at equal tokens is the same math
at every rate, so it comes from the full run at the fastest rate).
Results: runs/bench/compare.{json,csv,png} and a printed table with a projection to the paper's
setting.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.control import rx_bytes, tx_bytes
from tests.harness.localswarm import REPO, LocalNode, node_env
from tests.harness.netsim import NetSim

VARIANTS = {
    "b_diloco_fp32": ["--overlap", "none", "--compression", "none"],
    "c_diloco_fp16": ["--overlap", "none", "--compression", "fp16"],
    "d_dilocox": ["--overlap", "delayed", "--compression", "adaptive"],
    "e_default": [],
    "f_adaptive": ["--overlap", "adaptive"],
}
PHASES = ("encode_s", "group_s", "gather_s", "aggregate_s", "apply_s", "exchange_s", "wait_s", "overlap_steps")


def run_ddp(net: NetSim, args, steps: int, max_seconds: float) -> dict:
    before = [tx_bytes(net, i) for i in range(2)]
    cmd = [sys.executable, "-m", "bench.ddp", "--world", "2", "--master", f"{net.address(0)}:29511",
           "--steps", str(steps), "--total-steps", str(args.outer_steps * args.inner_steps),
           "--max-seconds", str(max_seconds), "--inner-lr", args.inner_lr]
    # gloo would resolve the hostname to loopback: pin each rank to its namespace's link
    procs = [net.popen(i, cmd + ["--rank", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                       env=dict(node_env(), GLOO_SOCKET_IFNAME=f"dlxh{i}")) for i in range(2)]
    try:
        outs = [p.communicate(timeout=max_seconds + 1200) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError("ddp timed out") from None
    if any(p.returncode for p in procs):
        raise RuntimeError(f"ddp failed: {[o[1].decode()[-2000:] for o in outs]}")
    res = [json.loads(o[0].decode().strip().splitlines()[-1]) for o in outs]
    sent = sum(tx_bytes(net, i) - b for i, b in enumerate(before))
    r0 = res[0]
    return dict(tokens=r0["tokens"], tokens_per_s=r0["tokens"] / r0["wall_s"],
                compute_utilization=min(1.0, r0["compute_s_per_step"] * r0["steps"] / r0["wall_s"]),
                bytes_per_token=sent / sum(r["tokens"] for r in res), val_loss=r0["val_loss"],
                steps=r0["steps"], full=r0["steps"] >= steps)


def run_swarm(net: NetSim, args, name: str, extra: list[str], out: Path, nodes: int = 2,
              workload: str = "", forked: bool = False) -> dict:
    """One swarm of ``nodes`` real dilocox-node processes, host i in namespace i, until max_outer_steps.
    ``workload``: an emulated one (--workload synthetic:PARAMS:STEP_S) instead of the ``small`` model.
    ``forked``: the nodes are forked from one shared image (tests/harness/forked.py) into their namespaces instead of
    each started as an interpreter under ``ip netns exec`` (same daemon and bytes, a fraction of the memory).
    Returns utilization, bytes on the hosts' interfaces (tx and rx, per node and round), the median time
    of each round phase (PHASES), the delay overlapped rounds ran with, and each node's peak memory."""
    model = ["--workload", workload] if workload else ["--model", "small"]
    common = [*model, "--inner-steps", str(args.inner_steps), "--inner-lr", args.inner_lr,
              "--warmup-steps", "20", "--total-steps", str(args.outer_steps * args.inner_steps),
              "--max-outer-steps", str(args.outer_steps), "--min-replicas", str(nodes), "--request-timeout", "2",
              "--matchmaking-time", "4", "--averaging-timeout", "120", "--outer-round-deadline", "400",
              "--eval-batches", "8", "--eval-every", str(args.outer_steps), "--status-addr", "127.0.0.1:0",
              "--run-id", name.replace("_", "-"), *extra]
    before = [(tx_bytes(net, i), rx_bytes(net, i)) for i in range(nodes)]
    procs = []
    memory, links = PeakMemory(), LinkSampler(net)
    try:
        for i in range(nodes):
            a = common + ["--listen", f"/ip4/{net.address(i)}/tcp/0", "--data-seed", str(i)]
            if procs:
                a += ["--join", procs[0].join_maddr]
            where = dict(forked=True, netns=net.namespace(i)) if forked else dict(wrapper=net.wrapper(i))
            procs.append(LocalNode(f"h{i}", out / name / f"h{i}", a, **where).wait_started())
            memory.watch(procs[-1].proc.pid)
        codes = [n.proc.wait(args.outer_steps * 600) for n in procs]
    finally:
        memory.stop()
        links.stop()
        for n in procs:
            n.terminate()
    if codes != [0] * nodes:
        raise RuntimeError(f"{name}: exit codes {codes}\n" + "\n".join(n.log_tail() for n in procs))
    after = [(tx_bytes(net, i), rx_bytes(net, i)) for i in range(nodes)]
    sent = sum(a[0] - b[0] for a, b in zip(after, before))
    received = sum(a[1] - b[1] for a, b in zip(after, before))
    rows = procs[0].metrics()
    steady = rows[1:-1] if len(rows) > 3 else rows  # the first round warms up, the last drains
    span = steady[-1]["time"] - rows[0]["time"]
    tokens = rows[-1]["tokens_total"]
    per_round_tokens = tokens / len(rows)
    everyone = [r for n in procs for r in (n.metrics()[1:-1] if len(n.metrics()) > 3 else n.metrics())]
    phases = {k: statistics.median(r.get(k, 0.0) for r in everyone) for k in PHASES}
    all_tokens = sum(n.metrics()[-1]["tokens_total"] for n in procs)
    return dict(tokens=tokens, tokens_per_s=per_round_tokens * len(steady) / span,
                compute_utilization=min(1.0, sum(r["compute_s"] for r in steady) / span),
                utilization_per_node=[min(1.0, statistics.median(r["compute_utilization"] for r in n.metrics()[2:]
                                                                  or n.metrics())) for n in procs],
                bytes_per_token=sent / all_tokens,
                tx_bytes_per_node_round=sent / nodes / len(rows), rx_bytes_per_node_round=received / nodes / len(rows),
                steady_tx_bytes_per_node_round=links.steady_per_round([n.metrics() for n in procs]),
                steady_max_tx_bytes_per_node_round=links.steady_per_round([n.metrics() for n in procs], max),
                round_s=span / len(steady), compute_s=statistics.median(r["compute_s"] for r in steady),
                val_loss=rows[-1]["val_loss"], ranks=[r["rank"] for r in rows],
                compression_ratio=statistics.median(r["compression_ratio"] for r in rows[1:] or rows),
                payload_bytes=statistics.median(r["payload_bytes"] for r in rows[1:] or rows),
                outcomes=[r["outcome"] for r in rows], group_sizes=[r["group_size"] for r in rows],
                digests_agree=all(len({r["digest"] for r in step}) == 1 for step in zip(*(n.metrics() for n in procs))),
                val_losses=[r["val_loss"] for r in rows], phases=phases, peak_memory_bytes=memory.peaks())


class LinkSampler:
    """Samples every host's interface tx counter (``NetSim.sent_bytes``) every 0.5 s on a thread, so the bytes
    of steady rounds can be told from start-up's (the DHT join, the wait for the other replicas)."""

    def __init__(self, net: NetSim):
        self._net, self._samples, self._stop = net, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            try:
                self._samples.append((time.time(), self._net.sent_bytes()))
            except Exception:  # the namespaces are going away
                return
            if self._stop.wait(0.5):
                return

    def steady_per_round(self, metrics: list[list[dict]], reduce=statistics.fmean) -> float:
        """``steady_bytes_per_round`` of the samples taken so far."""
        return steady_bytes_per_round(list(self._samples), metrics, reduce)


def sent_at(samples: list[tuple[float, dict[int, int]]], host: int, t: float) -> float:
    """Host ``host``'s tx counter at wall time ``t`` (seconds since the epoch), linearly interpolated between
    ``samples`` ((time, host -> bytes), in time order). Raises ValueError outside them."""
    pts = [(ts, sent[host]) for ts, sent in samples if host in sent]
    if not pts or not pts[0][0] <= t <= pts[-1][0]:
        raise ValueError(f"no samples around t={t:.1f} for host {host}")
    for (t0, b0), (t1, b1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return b0 + (b1 - b0) * (t - t0) / max(t1 - t0, 1e-9)
    return pts[-1][1]


def steady_bytes_per_round(samples: list[tuple[float, dict[int, int]]], metrics: list[list[dict]],
                           reduce=statistics.fmean) -> float:
    """Bytes each host sent per round from the end of its first round to the end of its last (``metrics``: each
    host's metrics.jsonl rows, in host order; their ``time`` is a round's end), over the hosts sampled (a host
    behind a NAT router is not), reduced by ``reduce`` (the mean; ``max``: the busiest host); NaN if none ran 2
    rounds."""
    sampled = set().union(*(sent for _, sent in samples)) if samples else set()
    per_host = [(sent_at(samples, host, rows[-1]["time"]) - sent_at(samples, host, rows[0]["time"])) / (len(rows) - 1)
                for host, rows in enumerate(metrics) if len(rows) >= 2 and host in sampled]
    return reduce(per_host) if per_host else float("nan")


class PeakMemory:
    """Samples, every 0.5 s on a thread, the proportional set size (PSS: shared pages split among sharers) of
    each watched process and its descendants; ``peaks()`` is each tree's largest sum seen."""

    def __init__(self):
        self._roots: list[int] = []
        self._peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> None:
        self._roots.append(pid)

    def peaks(self) -> list[int]:
        return [self._peak.get(pid, 0) for pid in self._roots]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for root in list(self._roots):
                self._peak[root] = max(self._peak.get(root, 0), sum(_pss(p) for p in _tree(root)))


def _tree(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid] + [q for k in kids for q in _tree(int(k))]


def _rollup(pid: int) -> dict[str, int]:
    """The process's /proc/PID/smaps_rollup sizes in bytes by field (Rss, Pss, Anonymous, ...); {} once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    except OSError:
        return {}
    return {name: int(value.split()[0]) * 1024 for name, value in (line.split(":", 1) for line in lines)}


def _pss(pid: int) -> int:
    return _rollup(pid).get("Pss", 0)


SPREAD_KEYS = ("tokens_per_s", "compute_utilization", "bytes_per_token", "bytes_per_token_reduction_vs_ddp")


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (run, rate): the median of its repeats, with ``spread`` {metric: [min, max]} and ``repeats``."""
    out = []
    for key in dict.fromkeys((r["run"], r["rate_mbit"]) for r in rows):
        group = [r for r in rows if (r["run"], r["rate_mbit"]) == key]
        row = dict(group[0], repeats=len(group), spread={})
        for k in SPREAD_KEYS:
            values = [r[k] for r in group if k in r]
            if values:
                row[k] = statistics.median(values)
                row["spread"][k] = [min(values), max(values)]
        out.append(row)
    return out


def projection(ratio: float, tokens_per_gpu_s: float, gpus_per_replica: int, h: int) -> dict:
    """Paper setting: 107B parameters, 1 Gbit/s between replicas, fp32 pseudo-gradients/gradients.

    Per outer step a replica computes H steps of ``batch_tokens`` and the swarm moves one model's
    worth of fp32 (ring all-reduce ~ 2x the model per node) per step for AllReduce, or once per H
    steps divided by ``ratio`` for DiLoCoX, hidden behind compute by the one-step delay.
    """
    params, link = 107e9, 1e9 / 8
    batch_tokens = 4 * 1024 * 1024 / 16  # tokens per step per replica (assumption: 4M global, 16 replicas)
    compute_s = batch_tokens / (tokens_per_gpu_s * gpus_per_replica)
    allreduce_s = 2 * 4 * params / link / gpus_per_replica  # each GPU of a replica holds 1/M of the model
    ddp_step = compute_s + allreduce_s
    dilocox_step = max(compute_s, allreduce_s / ratio / h)
    return dict(params=params, link_gbps=1, tokens_per_gpu_s=tokens_per_gpu_s, gpus_per_replica=gpus_per_replica,
                inner_steps=h, compression_ratio=ratio, compute_s_per_step=compute_s,
                allreduce_s_per_step=allreduce_s, speedup=ddp_step / dilocox_step, paper_speedup=357)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    rates = sorted({r["rate_mbit"] for r in rows})
    names = [n for n in ["a_ddp", *VARIANTS] if any(r["run"] == n for r in rows)]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        sel = {r["rate_mbit"]: r for r in rows if r["run"] == name}
        xs = [i + k * width for i in range(len(rates))]

        def bars(ax, key):  # the median, with the range of the repeats as an error bar
            mid = [sel[x][key] if x in sel else 0 for x in rates]
            lo = [m - sel[x].get("spread", {}).get(key, [m, m])[0] if x in sel else 0 for x, m in zip(rates, mid)]
            hi = [sel[x].get("spread", {}).get(key, [m, m])[1] - m if x in sel else 0 for x, m in zip(rates, mid)]
            ax.bar(xs, mid, width, yerr=[lo, hi], capsize=3, label=name)

        bars(axes[0], "tokens_per_s")
        bars(axes[1], "bytes_per_token")
        bars(axes[2], "compute_utilization")
        axes[3].bar(xs, [sel[x].get("val_loss_equal_tokens", sel[x]["val_loss"]) if x in sel else 0 for x in rates],
                    width, label=name)
    for ax, title in zip(axes, ["tokens/s per replica", "bytes on the wire per token (log)",
                                "compute utilization (whiskers: range of --repeats)",
                                "validation loss at equal tokens (quality)"]):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rates))], [f"{r:g} Mbit/s" for r in rates])
        ax.set_title(title)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rates", type=float, nargs="+", default=[10, 100, 1000])
    p.add_argument("--runs", nargs="+", default=["a_ddp", *VARIANTS], choices=["a_ddp", *VARIANTS])
    p.add_argument("--outer-steps", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--inner-lr", default="2e-3")
    p.add_argument("--ddp-seconds", type=float, default=60, help="DDP wall-time cap below the fastest rate")
    p.add_argument("--ddp-capped", action="store_true",
                   help="cap DDP at --ddp-seconds at every rate, the fastest too (bytes/token and tokens/s only; "
                        "DDP's loss at equal tokens is then not measured)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each swarm variant per rate; the table then shows median [min, max]")
    p.add_argument("--dilocox-args", default="", help="extra dilocox-node flags for (d), e.g. '--rank-max 32'")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench")
    args = p.parse_args(argv)
    ok, why = NetSim.available()
    if not ok:
        print(f"make bench needs network namespaces: {why}", file=sys.stderr)
        return 2
    shutil.rmtree(args.out / "compare", ignore_errors=True)
    (args.out / "compare").mkdir(parents=True)
    rows = []
    for rate in sorted(args.rates, reverse=True):
        with NetSim(2, rate, prefix="dlxc") as net:
            for name in args.runs:
                started = time.monotonic()
                if name == "a_ddp":
                    full = rate == max(args.rates) and not args.ddp_capped
                    res = run_ddp(net, args, args.outer_steps * args.inner_steps, 0 if full else args.ddp_seconds)
                    res.update(run=name, rate_mbit=rate, bench_s=time.monotonic() - started, repeat=0)
                    rows.append(res)
                    print(json.dumps(res), flush=True)
                    continue
                extra = VARIANTS[name] + (args.dilocox_args.split() if name == "d_dilocox" else [])
                for rep in range(args.repeats):  # same data and seeds: the spread is the network's and the CPU's
                    started = time.monotonic()
                    where = args.out / "compare" / f"{rate:g}" / (f"repeat{rep}" if args.repeats > 1 else "")
                    res = run_swarm(net, args, name, extra, where)
                    res.update(run=name, rate_mbit=rate, bench_s=time.monotonic() - started, repeat=rep)
                    rows.append(res)
                    print(json.dumps({k: v for k, v in res.items() if k not in ("val_losses",)}), flush=True)
                    (args.out / "compare.json").write_text(json.dumps(dict(rows=rows), indent=2))
    full_ddp = next((r for r in rows if r["run"] == "a_ddp" and r.get("full")), None)
    for r in rows:
        if r["run"] == "a_ddp":  # a capped DDP run stopped early: its own loss is not at equal tokens
            r["val_loss_equal_tokens"] = full_ddp["val_loss"] if full_ddp else float("nan")
        else:
            r["val_loss_equal_tokens"] = r["val_loss"]
        ddp = next((x for x in rows if x["run"] == "a_ddp" and x["rate_mbit"] == r["rate_mbit"]), None)
        if ddp:
            r["speedup_vs_ddp"] = r["tokens_per_s"] / ddp["tokens_per_s"]
            r["bytes_per_token_reduction_vs_ddp"] = ddp["bytes_per_token"] / r["bytes_per_token"]
    table = summarize(rows)
    d = [r for r in rows if r["run"] == "e_default"] or [r for r in rows if r["run"] == "d_dilocox"]
    proj = projection(statistics.median(r["compression_ratio"] for r in d), 400.0, 8, args.inner_steps) if d else {}
    (args.out / "compare.json").write_text(json.dumps(dict(rows=rows, table=table, projection=proj, args=vars(args)),
                                                      indent=2, default=str))
    with open(args.out / "compare.csv", "w", newline="") as f:
        keys = ["run", "rate_mbit", "tokens", "tokens_per_s", "compute_utilization", "bytes_per_token",
                "val_loss_equal_tokens", "speedup_vs_ddp", "bytes_per_token_reduction_vs_ddp", "compression_ratio"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    plot(table, args.out / "compare.png")
    print(f"\n{'run':>14} {'Mbit/s':>7} {'tok/s':>7} {'util':>5} {'B/token':>10} {'val loss':>8} "
          f"{'speedup':>7} {'B/tok red.':>10} {'ratio':>6}")
    for r in table:
        print(f"{r['run']:>14} {r['rate_mbit']:>7g} {r['tokens_per_s']:>7.0f} {r['compute_utilization']:>5.0%} "
              f"{r['bytes_per_token']:>10.1f} {r['val_loss_equal_tokens']:>8.4f} {r.get('speedup_vs_ddp', 0):>7.2f} "
              f"{r.get('bytes_per_token_reduction_vs_ddp', 0):>10.0f} {r.get('compression_ratio', 1):>6.1f}")
    if args.repeats > 1:
        print(f"\nspread over {args.repeats} runs (median [min, max]):")
        for r in table:
            if r["repeats"] > 1:
                print(f"{r['run']:>14} {r['rate_mbit']:>7g} " + "  ".join(
                    f"{k} {r[k]:.4g} [{r['spread'][k][0]:.4g}, {r['spread'][k][1]:.4g}]" for k in SPREAD_KEYS))
    if proj:
        print(f"\nprojection to 107B @ 1 Gbit/s (assumed {proj['tokens_per_gpu_s']:g} tokens/s per GPU, "
              f"{proj['gpus_per_replica']} GPUs per replica, H={proj['inner_steps']}, measured compression "
              f"{proj['compression_ratio']:.1f}x): speedup {proj['speedup']:.0f}x over AllReduce (paper: 357x)")
    print(f"results: {args.out}/compare.json, compare.csv, compare.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
