"""Randomised faults on a local swarm, on loopback or in namespaces (``make bench-faults``, ``make bench-soak``).

Each trial (seeded) starts 3 nodes (tiny model, ``--compression``: int8 unless told, the daemon's
default sparse in the soak; synchronous, checkpoint every round), then applies ``--events`` faults
at random intervals (2 to 6 s, one to three rounds): SIGKILL of a random node (not the bootstrap),
SIGTERM leave, a new joiner, the restart of a killed node from its checkpoint, or (with
``--bursts``) a CPU-load burst of ``--burst-procs`` busy processes until the next event. A joiner
is started without waiting for it: the next event may come while it still starts up.
``--cpu-load K`` keeps K busy processes running through the whole trial (a volunteer's machine
doing other work); several values take turns over the trials (``--cpu-load 1 1 1 1 6``: every
fifth trial at 6). ``--netns`` puts every node on a host of its own in network namespaces (100
Mbit/s links, status over a unix socket) and adds two events: a link-rate change of a random node
(to 10, 100 or 1000 Mbit/s) and a NAT'd joiner (behind a router of its own, with ``--client-mode``).
``--jobs J`` runs J trials at once (each is load on the others). After the last event the swarm
runs two more rounds. Counted over all trials:
  rounds (outer steps applied by some group), node_rounds, stalls (a round that blocked training
  on communication for longer than averaging_timeout), past_deadline (longer than that round's own
  deadline: its group wait plus its download deadline, as metrics.jsonl records them),
  longest_stall_s, resyncs (log lines "re-syncing from peers"), skipped (rounds a group refused:
  partial or disagreeing results), splits (outer steps with two different group-applied digests:
  hivemind matchmaking formed two groups), lone_results (a group-applied digest no other node
  holds: would be a partial average), unclean_leaves (SIGTERM exits != 0), converged (trials whose
  live nodes end on one digest), failed_joins (a joiner or restarted node that never reached
  TRAINING, or exited non-zero on its own), lost_nodes (a first-three node that exited on its
  own), failed_trials (a trial the harness could not finish: counted with its error, and the run
  goes on).
Results: runs/bench/faults.json (``--out``, rewritten after every trial, so a run cut short keeps what
it measured), with each trial's timeline (events and every node's rounds), and beside it a PNG of the
trial with the most events (tests/harness/timeline.py).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import grpc

from tests.harness.localswarm import LocalNode, group_applied
from tests.harness.netsim import NetSim
from tests.harness.timeline import plot_timeline

LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0"]
ARGS = ["--model", "tiny",
        "--request-timeout", "1", "--matchmaking-time", "2", "--averaging-timeout", "8",
        "--outer-round-deadline", "30", "--announce-period", "1", "--inner-steps", "20",
        "--warmup-steps", "10", "--total-steps", "4000", "--eval-batches", "1", "--checkpoint-every", "1"]
AVERAGING_TIMEOUT = 8.0
OUTER_ROUND_DEADLINE = 30.0
RATES_MBIT = (10, 100, 1000)  # --netns: a link-rate event sets one of these
NAT_HOSTS = 2  # --netns: hosts behind routers of their own, for NAT'd joiners
EVENT_GAP_S = (2.0, 6.0)  # between events; a round of the tiny model takes about 2.5 s
JOIN_TIMEOUT = 180.0  # a joiner that is not TRAINING this long after its start counts as a failed join
ACTIVE = ("TRAINING", "AVERAGING")


class Burner:
    """Busy processes (``python -c 'while True: pass'``), each in its own session: CPU load beside the swarm."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, n: int) -> list[subprocess.Popen]:
        new = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
               for _ in range(n)]
        self.procs += new
        return new

    def stop(self, procs: Optional[list[subprocess.Popen]] = None) -> None:
        for proc in list(self.procs if procs is None else procs):
            proc.kill()
            proc.wait()
            self.procs.remove(proc)


class Watch:
    """The nodes a trial started, whether each reached TRAINING, and which ones the harness stopped."""

    def __init__(self):
        self.nodes: list[LocalNode] = []
        self.joiners: set[LocalNode] = set()  # nodes started after the first three
        self.active: set[LocalNode] = set()   # nodes seen TRAINING or AVERAGING
        self.stopped: set[LocalNode] = set()  # nodes the harness killed or asked to leave
        self.started_at: dict[LocalNode, float] = {}

    def add(self, node: LocalNode, joiner: bool) -> LocalNode:
        self.nodes.append(node)
        self.started_at[node] = time.monotonic()
        if joiner:
            self.joiners.add(node)
        return node

    def poll(self) -> None:
        """Record which live nodes are past syncing (one GetStatus each)."""
        for n in self.nodes:
            if n in self.active or n.proc.poll() is not None or not n.poll_started():
                continue
            try:
                if n.status(timeout=2.0).state in ACTIVE:
                    self.active.add(n)
            except grpc.RpcError:
                pass

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.poll()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def failed_join(self, n: LocalNode) -> bool:
        """A joiner that exited non-zero on its own, or that is still not TRAINING after JOIN_TIMEOUT."""
        if n not in self.joiners or n in self.stopped:
            return False
        if n.proc.poll() is not None:
            return n.proc.returncode != 0 or n not in self.active
        return n not in self.active and time.monotonic() - self.started_at[n] >= JOIN_TIMEOUT

    def lost(self, n: LocalNode) -> bool:
        """One of the first three nodes that exited without the harness stopping it."""
        return n not in self.joiners and n not in self.stopped and n.proc.poll() is not None


class Hosts:
    """Where a trial's nodes run: all on loopback (``net`` None), or each on a host of its own in network
    namespaces (tests/harness/netsim.py): the first ``public`` hosts reachable, the rest behind NAT routers. A node
    keeps its host when it restarts; a NAT'd one runs with --client-mode. Status goes over a unix socket
    in the node's directory, which the harness reaches from any namespace."""

    def __init__(self, net: Optional[NetSim] = None, public: int = 0):
        self.net, self.public = net, public
        self.of: dict[str, int] = {}  # node name -> host index

    def free(self, nat: bool) -> bool:
        """Whether a host of that kind is left for a new node."""
        return self.net is not None and self._next(nat) is not None

    def _next(self, nat: bool) -> Optional[int]:
        pool = range(self.public, self.net.n_hosts) if nat else range(self.public)
        return next((i for i in pool if i not in self.of.values()), None)

    def place(self, name: str, workdir: Path, nat: bool = False) -> tuple[list[str], list[str]]:
        """(arguments, command wrapper) for node ``name``; raises RuntimeError if no host of the kind is free."""
        if self.net is None:
            return LOOPBACK, []
        if name not in self.of:
            i = self._next(nat)
            if i is None:
                raise RuntimeError(f"no {'NAT' if nat else 'public'} host left for {name}")
            self.of[name] = i
        i = self.of[name]
        args = ["--listen", f"/ip4/{self.net.address(i)}/tcp/0",
                "--status-addr", f"unix:{(workdir / 'status.sock').resolve()}"]
        return args + (["--client-mode"] if i >= self.public else []), self.net.wrapper(i)


def _live(nodes):
    return [n for n in nodes if n.proc.poll() is None]


def _start(name: str, workdir: Path, args: list[str], watch: Watch, joiner: bool, hosts: Hosts,
           nat: bool = False) -> LocalNode:
    """Start a joiner without waiting for it; failed_join counts it if it exits or never reaches TRAINING."""
    where, wrapper = hosts.place(name, workdir, nat)
    return watch.add(LocalNode(name, workdir, args + where, wrapper=wrapper), joiner)


def trial(seed: int, events: int, workdir: Path, cpu_load: int = 0, bursts: bool = False,
          burst_procs: int = 2, compression: str = "int8", netns: bool = False) -> dict:
    """One seeded trial (module docstring). ``netns``: every node on a host of its own in network namespaces
    (100 Mbit/s links), with link-rate changes and NAT'd joiners among the events."""
    if not netns:
        return _trial(seed, events, workdir, cpu_load, bursts, burst_procs, compression, Hosts())
    public = 3 + events  # the first three and a joiner per event at most
    with NetSim(public + NAT_HOSTS, 100, prefix=f"dlf{seed}", nat=range(public, public + NAT_HOSTS)) as net:
        return _trial(seed, events, workdir, cpu_load, bursts, burst_procs, compression, Hosts(net, public))


def _trial(seed: int, events: int, workdir: Path, cpu_load: int, bursts: bool, burst_procs: int, compression: str,
           hosts: Hosts) -> dict:
    rng = random.Random(seed)
    shutil.rmtree(workdir, ignore_errors=True)  # old checkpoints would be resumed
    args = ARGS + ["--run-id", f"faults{seed}", "--compression", compression]
    watch, burner = Watch(), Burner()
    burner.start(cpu_load)
    burst: list[subprocess.Popen] = []
    killed, log, unclean = [], [], 0  # log: (time.time(), event, node name)
    started = time.time()
    try:
        where, wrapper = hosts.place("n0", workdir / "n0")
        boot = watch.add(LocalNode("n0", workdir / "n0", args + ["--min-replicas", "3"] + where,
                                   wrapper=wrapper).wait_started(), False)
        join = ["--join", boot.join_maddr]
        for i in (1, 2):
            where, wrapper = hosts.place(f"n{i}", workdir / f"n{i}")
            watch.add(LocalNode(f"n{i}", workdir / f"n{i}", args + join + ["--min-replicas", "3"] + where,
                                wrapper=wrapper), False)
        for n in watch.nodes[1:]:
            n.wait_started()
        boot.wait_for(lambda p: p.status().outer_step >= 2, 120, "outer step 2")
        for _ in range(events):
            watch.sleep(rng.uniform(*EVENT_GAP_S))
            burner.stop(burst)
            burst = []
            nodes = watch.nodes
            victims = [n for n in _live(nodes) if n is not boot and n.poll_started()]  # whose signal handlers are set
            choices = (["join"] + (["kill", "leave"] if len(victims) >= 2 else []) + (["restart"] if killed else [])
                       + (["burst"] if bursts else []) + (["rate"] if hosts.net else [])
                       + (["natjoin"] if hosts.free(nat=True) else []))
            event, hit = rng.choice(choices), ""
            if event == "kill":
                victim = rng.choice(victims)
                watch.stopped.add(victim)
                hit = victim.name
                victim.terminate(signal.SIGKILL)
                killed.append(victim)
            elif event == "leave":
                victim = rng.choice(victims)
                watch.stopped.add(victim)
                hit = victim.name
                unclean += victim.terminate(signal.SIGTERM, timeout=60) != 0
            elif event in ("join", "natjoin"):
                hit = f"n{len(nodes)}"
                _start(hit, workdir / hit, args + join, watch, joiner=True, hosts=hosts, nat=event == "natjoin")
            elif event == "restart":
                old = killed.pop(0)
                hit = old.name
                old.err_path.rename(old.err_path.with_name(f"stderr.{len(log)}"))  # keep its first life's log
                _start(old.name, old.workdir, args + join, watch, joiner=True, hosts=hosts)
            elif event == "rate":
                target_node, rate = rng.choice(_live(nodes)), rng.choice(RATES_MBIT)
                hosts.net.set_rate(hosts.of[target_node.name], rate)
                hit = f"{target_node.name} {rate} Mbit/s"
            else:
                burst = burner.start(burst_procs)
            log.append((round(time.time(), 1), event, hit))
        burner.stop(burst)
        target = boot.status().outer_step + 2
        for n in _live(watch.nodes):
            try:
                n.wait_started(JOIN_TIMEOUT)
                n.wait_for(lambda p: p.status().outer_step >= target, JOIN_TIMEOUT, f"outer step {target}")
            except (RuntimeError, TimeoutError):
                pass  # a joiner that never got there is a failed join; an original one is a lost node
            watch.poll()
        time.sleep(2.0)
        return dict(_count(watch, log, unclean, target), timeline=_timeline(watch, log, started))
    finally:
        burner.stop()
        for n in watch.nodes:
            n.terminate(signal.SIGKILL)


def _count(watch: Watch, log, unclean, target) -> dict:
    nodes = watch.nodes
    by_dir = {n.workdir: n for n in nodes}  # a restarted node shares its metrics file with its first life
    rows = {d: list({r["outer_step"]: r for r in n.metrics()}.values()) for d, n in by_dir.items()}
    held = group_applied(list(by_dir.values()), upto=target)
    digests_at = Counter(step for step, _ in held)
    all_rows = [r for rs in rows.values() for r in rs]
    live = [n for n in nodes if n.proc.poll() is None]
    finals: dict[int, set] = {}
    for n in live:
        try:
            s = n.status()
        except grpc.RpcError:
            continue
        finals.setdefault(s.outer_step, set()).add(s.global_params_digest)
    top = max(finals, default=None)
    return dict(
        events=[e for _, e, _ in log],
        rounds=len({r["outer_step"] for r in all_rows
                    if r["outcome"] in ("applied", "adopted", "united", "solo", "applied_alone")}),
        node_rounds=len(all_rows), stalls=sum(r["wait_s"] > AVERAGING_TIMEOUT for r in all_rows),
        past_deadline=sum(r["wait_s"] > round_deadline_s(r) for r in all_rows),
        longest_stall_s=round(max((r["wait_s"] for r in all_rows), default=0.0), 2),
        resyncs=sum(f.read_text().count("re-syncing from peers") for d in by_dir for f in d.glob("stderr*")),
        skipped=sum(r["outcome"] == "skipped" for r in all_rows),
        splits=sum(n > 1 for n in digests_at.values()),
        lone_results=sum(c == 1 for c in held.values()),
        unclean_leaves=unclean, failed_joins=sum(watch.failed_join(n) for n in nodes),
        lost_nodes=sum(watch.lost(n) for n in nodes),
        converged=top is not None and len(finals[top]) == 1, live_nodes=len(live))


def round_deadline_s(row: dict) -> float:
    """A metrics.jsonl round's own deadline in seconds: the group wait (matchmaking and its retries) plus the
    download deadline, each the flag (ARGS) where the row has none (a round that never reached downloads)."""
    return (row.get("group_wait_s") or OUTER_ROUND_DEADLINE - AVERAGING_TIMEOUT) + \
        (row.get("download_deadline_s") or AVERAGING_TIMEOUT)


def _timeline(watch: Watch, log, started: float) -> dict:
    """The trial for tests/harness/timeline.py: events and every node's rounds (time, outer step, group, outcome)."""
    rounds = {}
    for n in {n.workdir: n for n in watch.nodes}.values():  # a restarted node's two lives share one file
        rounds[n.name] = [[round(r["time"], 1), r["outer_step"], r["group_size"], r["outcome"]] for r in n.metrics()]
    return dict(start=round(started, 1), events=[list(e) for e in log], rounds=rounds)


KEYS = ["rounds", "node_rounds", "stalls", "past_deadline", "resyncs", "skipped", "splits", "lone_results",
        "unclean_leaves", "failed_joins", "lost_nodes"]


def totals(results: list[dict]) -> dict:
    """Sums over trials; a failed trial (``{"seed", "error"}``) counts in failed_trials and nowhere else."""
    done = [r for r in results if "error" not in r]
    total = {k: sum(r[k] for r in done) for k in KEYS}
    total.update(trials=len(results), failed_trials=len(results) - len(done),
                 events=sum(len(r["events"]) for r in done),
                 longest_stall_s=max((r["longest_stall_s"] for r in done), default=0.0),
                 converged=sum(r["converged"] for r in done))
    return total


def run_trials(seeds: list[int], run_one, jobs: int = 1, on_result=None) -> list[dict]:
    """``run_one(seed)`` for each seed, ``jobs`` at once; an exception becomes ``{"seed", "error"}`` and the
    run goes on. Results in seed order; each is printed, and passed to ``on_result``, as it ends."""
    lock = threading.Lock()

    def one(seed: int) -> dict:
        started = time.monotonic()
        try:
            r = dict(seed=seed, **run_one(seed))
        except Exception as exc:  # noqa: BLE001 -- a harness failure is a result to count, not a crash
            r = dict(seed=seed, error=f"{type(exc).__name__}: {str(exc)[-1500:]}")
        r["seconds"] = round(time.monotonic() - started, 1)
        with lock:
            print(json.dumps(r), flush=True)
            if on_result is not None:
                on_result(r)
        return r

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, seeds))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--events", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-load", type=int, nargs="+", default=[0], metavar="K",
                        help="K busy processes running through a trial; several values take turns over the trials")
    parser.add_argument("--bursts", action="store_true", help="CPU-load bursts among the random events")
    parser.add_argument("--burst-procs", type=int, default=2, help="busy processes per burst")
    parser.add_argument("--jobs", type=int, default=1, help="trials at once")
    parser.add_argument("--compression", default="int8", choices=["sparse", "int8", "fp16", "none", "adaptive"])
    parser.add_argument("--netns", action="store_true",
                        help="each node on a host of its own in network namespaces (100 Mbit/s), with link-rate "
                             "changes and NAT'd joiners (--client-mode) among the events")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/faults.json"))
    a = parser.parse_args(argv)
    if min(a.trials, a.events, *a.cpu_load, a.burst_procs) < 0 or a.jobs < 1:
        parser.error("--trials, --events, --cpu-load and --burst-procs must be >= 0, --jobs >= 1")
    if a.netns and not NetSim.nat_available()[0]:
        parser.error(f"--netns needs NAT'd network namespaces: {NetSim.nat_available()[1]}")
    work = Path("runs/bench")
    work.mkdir(parents=True, exist_ok=True)
    args = {k: str(v) for k, v in vars(a).items()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []

    def save(result: dict) -> None:  # after every trial, so a run cut short keeps what it measured
        done.append(result)
        a.out.write_text(json.dumps(dict(args=args, trials=sorted(done, key=lambda r: r["seed"]),
                                         total=totals(done)), indent=2))

    def run_one(seed: int) -> dict:
        load = a.cpu_load[(seed - a.seed) % len(a.cpu_load)]
        return dict(cpu_load=load, **trial(seed, a.events, work / f"faults-{seed}", load, a.bursts, a.burst_procs,
                                           a.compression, a.netns))

    results = run_trials(list(range(a.seed, a.seed + a.trials)), run_one, a.jobs, on_result=save)
    total = totals(results)
    print("TOTAL " + json.dumps(total), flush=True)
    drawn = [r for r in results if r.get("timeline", {}).get("rounds")]
    if drawn:
        pick = max(drawn, key=lambda r: len(r["events"]))
        png = plot_timeline(pick["timeline"], a.out.with_suffix(".png"),
                            f"fault trial seed {pick['seed']}: rounds per node (colour: group size) and events")
        print(f"wrote {a.out} and {png}", flush=True)


if __name__ == "__main__":
    main()
