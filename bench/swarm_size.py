"""Swarm size: N = 8, 16, 32 nodes on loopback with joins and leaves, on the EMULATED workload.

Every node runs ``--workload synthetic:PARAMS:STEP_S`` (dilocox/synthetic.py: true payload sizes, compute
is a sleep), so 32 nodes fit on 2 cores; no quality is claimed from it. Per size N the benchmark starts
N nodes at once (the first is the bootstrap peer every other ``--join``s), waits for the first outer
step, then for ``--duration`` seconds makes ``--churn`` leaves (SIGTERM to a random non-bootstrap node;
SIGKILL to its process group with ``--leave-signal KILL``, a crash)
and as many joins (a fresh node), evenly spaced, then waits for each joiner's first joint round (at most
``--tail-rounds`` rounds after the last join, no churn meanwhile), and finally asks every node to leave. From the nodes'
metrics.jsonl and /proc it reports:

- **joint**: the share of node-rounds applied with the swarm's update: outcome ``applied``, ``adopted``
  (a split round's minority group took the majority's update, daemon/majority.py) or ``united`` (a
  split round without a majority applied the union of its groups' results), and the digest most
  nodes recorded for that outer step;
- **lost**: node-rounds a node computed that left no metrics row: the round went on without it (it came late
  to the round's groups, or others applied it first) and it neither applied nor fetched it, counted from the
  logs; **joint of all** is the joint rounds' share of the node-rounds and the lost ones together;
- **splits**: outer steps at which those rounds left two or more digests, and how many of them
  lasted beyond one round (the next step was split too);
- **round time** and **overhead** (round time minus compute, the median over node-rounds), and the
  slope of the overhead against log2 N and against N (least squares over the sizes run);
- **bytes** sent and received per node and round (the transport's counters, medians);
- **memory**: PSS of each node's process tree (main process, DHT, averagers, p2pd), sampled every
  10 s; the median over nodes of each node's largest sample. With ``--launch forked`` (the default) the nodes
  are forked from one image that holds torch, hivemind and the daemon (tests/harness/forked.py); each sample then adds
  an equal share of that forkserver's own PSS, so the per-node figures sum to the machine's total.
  ``--launch interpreter`` starts each node as its own ``python -m dilocox.daemon.cli``, as a volunteer does.

``make bench-swarm-size`` writes runs/bench/swarm-size/{swarm-size.json, table.md, swarm-size.png}.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import signal
import statistics
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

from bench.compare import _pss, _tree
from tests.harness.forked import image_holders
from tests.harness.localswarm import JOINT, LocalNode, wait_all

# the daemon's default announce period (5 s): at 32 nodes on 2 cores, records with the 6 s lifetime of a 2 s period
# expired before their late re-publication, and nodes waiting for all 32 to be live never saw them at once
BASE = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0",
        "--eval-every", "1000000", "--checkpoint-every", "1000000"]


class MemorySampler:
    """Every ``period_s``: the PSS of each watched node's process tree, plus an equal share of the PSS of the
    processes the live nodes were forked from (tests/harness/forked.py; none for nodes started as interpreters);
    ``stop()`` returns each node's largest sample by name."""

    def __init__(self, period_s: float = 10.0):
        self.nodes: list[LocalNode] = []
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            live = [n for n in list(self.nodes) if n.proc.poll() is None]
            share = sum(map(_pss, image_holders([n.proc for n in live]))) / max(1, len(live))
            for n in live:
                pss = sum(_pss(p) for p in _tree(n.proc.pid)) + share
                self.peak[n.name] = max(self.peak.get(n.name, 0), int(pss))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(30)
        return dict(self.peak)


def run_size(n: int, a, out: Path) -> dict:
    """One swarm of n nodes with churn; returns its figures (see the module docstring)."""
    rng = random.Random(n)
    args = BASE + ["--workload", a.workload, "--inner-steps", str(a.inner_steps), "--run-id", f"size{n}"] + a.extra
    first = args + ["--min-replicas", str(n)]  # the first N start together; joiners later take the swarm as it is
    forked = a.launch == "forked"
    sampler = MemorySampler()
    boot = LocalNode("n00", out / "n00", first, forked=forked).wait_started()
    nodes = [boot] + [LocalNode(f"n{i:02d}", out / f"n{i:02d}", first + ["--join", boot.join_maddr], forked=forked)
                      for i in range(1, n)]
    sampler.nodes += nodes
    began = time.monotonic()
    try:
        wait_all(nodes, lambda: all(x.poll_started() for x in nodes), 600, "every node's start")
        started_s = time.monotonic() - began
        wait_all(nodes, lambda: all(any(r["outcome"] in JOINT for r in x.metrics()) for x in nodes), 900,
                 "an applied round on every node")
        first_round_s = time.monotonic() - began
        live, joined, left, events = list(nodes[1:]), n, [], []
        t0 = time.monotonic()
        for k in range(2 * a.churn):
            at = t0 + (k + 1) * a.duration / (2 * a.churn + 1)
            time.sleep(max(0.0, at - time.monotonic()))
            if k % 2 == 0:
                victim = live.pop(rng.randrange(len(live)))
                if a.leave_at == "averaging":
                    wait_until_averaging(victim, a.leave_delay)
                code = victim.terminate(getattr(signal, f"SIG{a.leave_signal}"), timeout=60)
                left.append(victim)
                events.append(dict(t=round(time.monotonic() - t0, 1), event="leave", node=victim.name, exit=code))
            else:
                fresh = LocalNode(f"n{joined:02d}", out / f"n{joined:02d}", args + ["--join", boot.join_maddr],
                                  forked=forked)
                joined += 1
                nodes.append(fresh)
                live.append(fresh)
                sampler.nodes.append(fresh)
                events.append(dict(t=round(time.monotonic() - t0, 1), event="join", node=fresh.name))
        time.sleep(max(0.0, t0 + a.duration - time.monotonic()))
        tail_s = wait_for_joiners(nodes, nodes[n:], a.tail_rounds)
    finally:
        codes = stop_all([x for x in nodes if x.proc.poll() is None])
        peaks = sampler.stop()
    found = figures(nodes, peaks)
    return dict(nodes=n, launch=a.launch, started_s=round(started_s, 1), first_round_s=round(first_round_s, 1),
                exit_codes=codes, events=events, tail_s=round(tail_s, 1),
                joins=join_latency(nodes[n:], found["round_s"]), **found)


def wait_until_averaging(node: LocalNode, delay_s: float, timeout_s: float = 180.0) -> bool:
    """Return ``delay_s`` seconds after ``node``'s status first says AVERAGING (polled every 0.1 s; its group
    may be forming or formed), or after ``timeout_s`` without it (False)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if node.status(timeout=2.0).state == "AVERAGING":
                time.sleep(delay_s)
                return True
        except Exception:  # noqa: BLE001 (a busy node may not answer at once: ask again)
            pass
        time.sleep(0.1)
    return False


def wait_for_joiners(nodes: list[LocalNode], joiners: list[LocalNode], tail_rounds: float) -> float:
    """After the churn: wait until every live joiner has a round applied with the swarm, at most ``tail_rounds``
    rounds (the median of ``nodes``' rounds so far) after the last join, so that a joiner started near the end is
    measured rather than counted as not joined. No leave or join happens meanwhile. Returns the seconds waited."""
    last_join = max((x.started_at for x in joiners), default=0.0)
    began = time.monotonic()
    while any(x.proc.poll() is None and not any(r["outcome"] in JOINT for r in x.metrics()) for x in joiners):
        done = [r["duration_s"] for x in nodes for r in x.metrics()[-5:] if r["outcome"] in JOINT]
        if time.time() > last_join + tail_rounds * (statistics.median(done) if done else 60.0):
            break
        time.sleep(2.0)
    return time.monotonic() - began


def stop_all(nodes: list[LocalNode], timeout_s: float = 120.0) -> list[int]:
    """SIGTERM every node at once (a node still starting has no status address to ask), then wait for each."""
    for x in nodes:
        x.proc.send_signal(signal.SIGTERM)
    return [x.terminate(signal.SIGTERM, timeout=timeout_s) for x in nodes]


def launched_at(node: LocalNode) -> float:
    """Wall time the node's process was started (LocalNode.started_at), else its first log line's."""
    if hasattr(node, "started_at"):
        return node.started_at
    return log_time(node, "")


def log_time(node: LocalNode, pattern: str) -> float | None:
    """Wall time of the first line of the node's log that matches the regular expression ``pattern``, or None."""
    for line in node.err_path.read_text().splitlines():
        if re.search(pattern, line):
            try:
                return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue  # a hivemind line: another time format
    return None


def join_latency(joiners: list[LocalNode], round_s: float) -> list[dict]:
    """For each node started during the run: seconds (and rounds of ``round_s``) from its start to its first
    round applied with the swarm (``applied``, ``adopted`` or ``united``); None if it had none. Split in two:
    ``startup_s``, from its start to its first TRAINING or AVERAGING state (interpreter, DHT, state download:
    on 2 cores shared by every node, mostly the interpreter), and the rest (the rounds it waited for)."""
    out = []
    for x in joiners:
        joint = [r["time"] for r in x.metrics() if r["outcome"] in JOINT]
        s = min(joint) - launched_at(x) if joint else None
        up = log_time(x, r"state \w+ -> (TRAINING|AVERAGING)")
        out.append(dict(node=x.name, first_joint_s=None if s is None else round(s, 1),
                        rounds=None if s is None else round(s / round_s, 2),
                        startup_s=None if up is None else round(up - launched_at(x), 1)))
    return out


def joiner_table(results: list[dict]) -> str:
    """Per joiner: start to first joint round, and how much of it was start-up (``join_latency``)."""
    lines = ["| N | joiner | start → first joint round | of which start-up (→ TRAINING) | rest | rounds |",
             "|---|---|---|---|---|---|"]
    fmt = lambda v: "—" if v is None else f"{v:.0f} s"  # noqa: E731
    for r in results:
        for j in r.get("joins", []):
            rest = None if j["first_joint_s"] is None or j.get("startup_s") is None \
                else j["first_joint_s"] - j["startup_s"]
            lines.append(f"| {r['nodes']} | {j['node']} | {fmt(j['first_joint_s'])} | {fmt(j.get('startup_s'))} | "
                         f"{fmt(rest)} | {'—' if j['rounds'] is None else j['rounds']} |")
    return "\n".join(lines) + "\n"


LOST = re.compile(r"round (\d+) (went on without us|was already completed by others)")


def lost_rounds(node: LocalNode) -> int:
    """Rounds that went on without ``node`` and left no metrics row there (``LOST`` in its log, no row of that
    outer step): computed, never applied with the swarm."""
    recorded = {r["outer_step"] for r in node.metrics()}
    return len({int(m.group(1)) for m in map(LOST.search, node.err_path.read_text().splitlines())
                if m and int(m.group(1)) not in recorded})


def figures(nodes: list[LocalNode], peaks: dict[str, int]) -> dict:
    rows = [dict(r, node=x.name) for x in nodes for r in {r["outer_step"]: r for r in x.metrics()}.values()]
    lost = [lost_rounds(x) for x in nodes]
    by_step: dict[int, Counter] = {}
    for r in rows:
        by_step.setdefault(r["outer_step"], Counter())[r["digest"]] += 1
    canon = {s: c.most_common(1)[0][0] for s, c in by_step.items()}
    joint = [r for r in rows if r["outcome"] in JOINT and r["digest"] == canon[r["outer_step"]]]
    applied_digests: dict[int, set] = {}
    for r in rows:
        if r["outcome"] in JOINT and r["group_size"] >= 2:
            applied_digests.setdefault(r["outer_step"], set()).add(r["digest"])
    split = sorted(s for s, d in applied_digests.items() if len(d) > 1)
    lasting = [s for s in split if s + 1 in split]
    outcomes = Counter(r["outcome"] for r in rows)
    med = lambda xs: statistics.median(xs) if xs else math.nan  # noqa: E731
    applied = [r for r in rows if r["outcome"] in JOINT]
    return dict(
        node_rounds=len(rows), joint_share=len(joint) / max(1, len(rows)), outcomes=dict(outcomes),
        lost_rounds=sum(lost), joint_share_all=len(joint) / max(1, len(rows) + sum(lost)),
        steps=max(by_step, default=0), split_steps=split, lasting_splits=len(lasting),
        group_sizes=dict(Counter(r["group_size"] for r in applied)),
        round_s=med([r["duration_s"] for r in applied]),
        # the slowest outer step (its median node): a stall that holds the whole swarm shows here
        slowest_round_s=max((med([r["duration_s"] for r in applied if r["outer_step"] == s])
                             for s in {r["outer_step"] for r in applied}), default=0.0),
        overhead_s=med([r["duration_s"] - r["compute_s"] for r in applied]),
        sent_bytes=med([r["bytes_sent"] for r in applied]), received_bytes=med([r["bytes_received"] for r in applied]),
        payload_bytes=med([r["payload_bytes"] for r in applied]),
        phases_s={k: med([r.get(k, math.nan) for r in applied]) for k in
                  ("encode_s", "group_s", "gather_s", "aggregate_s", "apply_s", "wait_s")},
        pss_bytes=med(list(peaks.values())), pss_max_bytes=max(peaks.values(), default=0))


def slopes(results: list[dict]) -> dict:
    """Least-squares slope of the overhead (s) against log2 N and against N, with each fit's residual."""
    def fit(xs, ys):
        mx, my = statistics.mean(xs), statistics.mean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else math.nan
        res = math.sqrt(statistics.mean([(y - (my + b * (x - mx))) ** 2 for x, y in zip(xs, ys)]))
        return round(b, 4), round(res, 3)

    pts = [(r["nodes"], r["overhead_s"]) for r in results if not math.isnan(r["overhead_s"])]
    if len(pts) < 2:
        return {}
    (bl, rl), (bn, rn) = fit([math.log2(n) for n, _ in pts], [y for _, y in pts]), fit([n for n, _ in pts],
                                                                                        [y for _, y in pts])
    return dict(per_doubling_s=bl, log_residual_s=rl, per_node_s=bn, linear_residual_s=rn)


def default_payload_bytes(workload: str) -> int:
    """The default codec's payload (the daemon's ``--compression sparse`` defaults: top-128 of 4096, 2-bit, Rice)
    for the workload's parameters, as encoded: one denominator for every compression, since a shared round's
    own payload (its values on P and its proposal) is about three quarters of it."""
    import torch
    from dilocox.daemon.config import NodeConfig

    from dilocox.sparse import SparseCodec
    from dilocox.synthetic import parse_spec, shapes_for

    shapes = shapes_for(parse_spec(workload)[0])
    codec = SparseCodec(shapes, NodeConfig().sparse_config())
    return len(codec.encode([torch.randn(s, generator=torch.Generator().manual_seed(0)) for s in shapes]))


def table(results: list[dict], a) -> str:
    launch = ("nodes forked from one shared image (tests/harness/forked.py)" if a.launch == "forked"
              else "each node its own interpreter")
    lines = [f"EMULATED workload ({a.workload}, H = {a.inner_steps}, compute is a sleep); loopback, 2 cores; "
             f"{a.churn} {'crashes (SIGKILL)' if a.leave_signal == 'KILL' else 'leaves'} "
             f"({'each while its group forms' if a.leave_at == 'averaging' else 'at any time'}) and "
             f"{a.churn} joins in {a.duration:.0f} s per size; {launch}.", "",
             "| N | node-rounds | joint | lost | joint of all | splits (lasting) | round s | slowest round s "
             "| overhead s | sent / round | received / round | sent / payload | sent / default payload | PSS / node "
             "| groups |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    default = default_payload_bytes(a.workload)
    for r in results:
        ratio = r["sent_bytes"] / r["payload_bytes"] if r["payload_bytes"] else math.nan
        groups = ", ".join(f"{k}:{v}" for k, v in sorted(r["group_sizes"].items(), key=lambda kv: -kv[1])[:4])
        lost = r.get("lost_rounds", "—")
        share_all = f"{100 * r['joint_share_all']:.1f}%" if "joint_share_all" in r else "—"
        lines.append(f"| {r['nodes']} | {r['node_rounds']} | {100 * r['joint_share']:.1f}% | {lost} | {share_all} | "
                     f"{len(r['split_steps'])} "
                     f"({r['lasting_splits']}) | {r['round_s']:.1f} | {r.get('slowest_round_s', math.nan):.1f} | "
                     f"{r['overhead_s']:.1f} | "
                     f"{r['sent_bytes'] / 1e6:.2f} MB | {r['received_bytes'] / 1e6:.2f} MB | {ratio:.1f}x | "
                     f"{r['sent_bytes'] / default:.1f}x | "
                     f"{r['pss_bytes'] / 1e6:.0f} MB | {groups} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path, a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["nodes"] for r in results]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    ax[0].plot(ns, [100 * r["joint_share"] for r in results], "o-")
    ax[0].axhline(95, ls="--", c="gray")
    ax[0].set(title="node-rounds applied with the swarm's update", xlabel="nodes", ylabel="%", ylim=(0, 101))
    ax[1].plot(ns, [r["round_s"] for r in results], "o-", label="round")
    ax[1].plot(ns, [r["overhead_s"] for r in results], "s-", label="overhead (round - compute)")
    ax[1].set(title="round time (median)", xlabel="nodes", ylabel="s")
    ax[1].legend()
    ax[2].plot(ns, [r["sent_bytes"] / 1e6 for r in results], "o-", label="sent")
    ax[2].plot(ns, [r["received_bytes"] / 1e6 for r in results], "s-", label="received")
    ax[2].plot(ns, [3 * r["payload_bytes"] / 1e6 for r in results], "--", c="gray", label="3 x own payload")
    ax[2].axhline(3 * default_payload_bytes(a.workload) / 1e6, ls=":", c="k", label="3 x default payload")
    ax[2].set(title="bytes per node and round (median)", xlabel="nodes", ylabel="MB", ylim=(0, None))
    ax[2].legend()
    for x in ax:
        x.set_xscale("log", base=2)
        x.set_xticks(ns, [str(n) for n in ns])
    fig.suptitle(f"Swarm size, EMULATED workload ({a.workload}; compute is a sleep), loopback on 2 cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32],
                   help="32 needs about 19 GB with --launch interpreter (0.6 GB per node)")
    p.add_argument("--workload", default="synthetic:1M:0.25")
    p.add_argument("--inner-steps", type=int, default=40)
    p.add_argument("--duration", type=float, default=240.0, help="seconds of churn after the first round")
    p.add_argument("--churn", type=int, default=5, help="leaves and as many joins during the run")
    p.add_argument("--tail-rounds", type=float, default=4.0,
                   help="after the churn, wait up to this many rounds from the last join for every joiner's first "
                        "joint round (0: stop at --duration, as before)")
    p.add_argument("--leave-at", choices=("any", "averaging"), default="any",
                   help="any: each leave when its time comes; averaging: the victim is SIGTERMed --leave-delay "
                        "seconds after its status next says AVERAGING (a leave while its group forms)")
    p.add_argument("--leave-delay", type=float, default=2.0)
    p.add_argument("--leave-signal", choices=("TERM", "KILL"), default="TERM",
                   help="TERM: a leave (the node drains and says so); KILL: a crash (its process group is killed, "
                        "p2pd included, and its membership record is left to expire)")
    p.add_argument("--launch", choices=("forked", "interpreter"), default="forked",
                   help="forked: every node forked from one image holding torch and hivemind (shared pages, "
                        "start in a second); interpreter: each node its own python process")
    p.add_argument("--out", type=Path, default=Path("runs/bench/swarm-size"))
    p.add_argument("extra", nargs="*", help="more dilocox-node flags (after --)")
    a = p.parse_args(argv)
    for n in a.sizes:
        taken = a.out / f"n{n}"
        if taken.exists() and any(taken.iterdir()):
            p.error(f"{taken} is not empty: its nodes would resume from the checkpoints there and append to their "
                    f"metrics; choose another --out or remove it")
    results = []
    for n in a.sizes:
        r = run_size(n, a, a.out / f"n{n}")
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "events"}), flush=True)
        (a.out / "swarm-size.json").write_text(json.dumps(dict(results=results, slopes=slopes(results),
                                                              args={k: str(v) for k, v in vars(a).items()}), indent=1))
    (a.out / "table.md").write_text(table(results, a) + f"\noverhead slope: {slopes(results)}\n\n"
                                    + joiner_table(results))
    plot(results, a.out / "swarm-size.png", a)
    print(table(results, a))
    print(joiner_table(results))
    print("overhead slope:", slopes(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
