"""Run a local swarm of dilocox-node processes on loopback and watch it over gRPC.

Used by ``make demo`` (bench/demo.py), ``make bench`` (bench/) and the integration tests.
Every node is a real ``dilocox-node`` process in its own session and process group; its DHT
process keeps p2pd in a group of its own, so a group-wide SIGKILL reaches the main process, the
averagers and the DHT process, and the watchdog in the DHT process ends p2pd (peers/lifecycle.py).
This module only starts them, polls ``GetStatus`` and asks them to ``Leave``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

# before grpc is imported: a benchmark that holds gRPC clients and forks nodes must not run gRPC's pre-fork handler,
# which can wait forever for its own threads (tests/conftest.py says the same for tests)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
from dilocox.proto.dilocox.v1 import node_pb2, node_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# round outcomes (metrics.jsonl) that apply the swarm's update of a round: the group's, a majority's, a union's
JOINT = ("applied", "adopted", "united")


def term_with_parent(parent_pid: int):
    """A ``preexec_fn`` that has the kernel SIGTERM the child (a leave: it drains and exits) when the thread that
    started it ends (prctl PR_SET_PDEATHSIG; it survives the exec of a wrapper such as ``ip netns exec`` and of
    the interpreter), so a benchmark or test killed from outside leaves no node running. None when called off the
    main thread: the signal follows the starting thread, not its process."""
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL("libc.so.6").prctl  # resolved here: the child, forked from a threaded parent, only calls it

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def node_env(threads: int = 1) -> dict:
    """This process's environment without DILOCOX_* variables, one torch thread per node."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCOX_")}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return env


class LocalNode:
    """A dilocox-node subprocess; stdout, stderr and checkpoints live under ``workdir``."""

    def __init__(self, name: str, workdir: Path, args: list[str], threads: int = 1, wrapper: list[str] = (),
                 forked: bool = False, netns: str | None = None, env: dict | None = None):
        """``wrapper`` prefixes the command, e.g. ``ip netns exec HOST`` (tests/harness/netsim.py). ``forked``: fork the
        node from the image shared by all forked nodes (tests/harness/forked.py) instead of starting an interpreter;
        ``netns``: the network namespace a forked node enters (a host of tests/harness/netsim.py), in place of a
        wrapper; ``env``: variables added to the node's environment (e.g. a red-team side channel)."""
        self.name, self.workdir = name, workdir
        self.started_at = time.time()  # wall clock, as the metrics rows' "time"
        workdir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = workdir / "stdout", workdir / "stderr"
        argv = [*args, "--checkpoint-dir", str(workdir / "ckpt")]
        if forked:
            if wrapper:
                raise ValueError("a forked node cannot run under a wrapper command (netns= puts it in a namespace)")
            from tests.harness.forked import ForkedProcess

            self.proc = ForkedProcess(argv, str(REPO), node_env(threads), str(self.out_path), str(self.err_path),
                                      threads, netns)
        elif netns:
            raise ValueError("netns= is for forked nodes; an interpreter runs under wrapper=NetSim.wrapper(i)")
        else:
            self.proc = subprocess.Popen(
                [*wrapper, sys.executable, "-m", "dilocox.daemon.cli", *argv],
                stdout=open(self.out_path, "w"), stderr=open(self.err_path, "w"),
                env={**node_env(threads), **(env or {})}, cwd=REPO,
                start_new_session=True, preexec_fn=term_with_parent(os.getpid()))
        self.addr = self.join_maddr = ""

    def wait_started(self, timeout: float = 120.0) -> "LocalNode":
        """Wait for the 'join with' and 'status' lines; raises RuntimeError/TimeoutError with the log tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll_started():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.1)
        self.terminate(signal.SIGKILL)
        raise TimeoutError(f"{self.name} did not start within {timeout}s:\n{self.log_tail()}")

    def poll_started(self) -> bool:
        """Whether the node has printed its 'join with' and 'status' lines (sets join_maddr and addr); never waits."""
        if not (self.addr and self.join_maddr):
            for line in self.out_path.read_text().splitlines():
                if line.startswith("join with:"):
                    self.join_maddr = line.split()[-1]
                elif line.startswith("status:"):
                    self.addr = line.split("--addr", 1)[1].split()[0]
        return bool(self.addr and self.join_maddr)

    def log_tail(self, chars: int = 4000) -> str:
        return self.err_path.read_text()[-chars:]

    def stub(self) -> node_pb2_grpc.NodeStub:
        return node_pb2_grpc.NodeStub(grpc.insecure_channel(self.addr))

    def status(self, timeout: float = 5.0) -> node_pb2.NodeStatus:
        return self.stub().GetStatus(node_pb2.GetStatusRequest(), timeout=timeout)

    def metrics(self) -> list[dict]:
        """One record per outer step (daemon/rounds.py), from the node's metrics.jsonl. A last line without its
        newline is a record the node is still writing: left for the next call."""
        path = self.workdir / "ckpt" / "metrics.jsonl"
        if not path.exists():
            return []
        text = path.read_text()
        lines = text.split("\n")[:-1]  # the piece after the last newline is incomplete (or empty)
        return [json.loads(line) for line in lines if line.strip()]

    def wait_for(self, predicate, timeout: float, what: str):
        """Poll ``predicate(self)`` until truthy; raises if the node exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} while waiting for {what}:\n"
                                   f"{self.log_tail()}")
            try:
                value = predicate(self)
            except grpc.RpcError:
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{self.name}: no {what} within {timeout}s:\n{self.log_tail()}")

    def terminate(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (SIGKILL goes to the whole process group); wait; clean up orphans; exit code."""
        if self.proc.poll() is None:
            if sig == signal.SIGKILL:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        try:  # children a killed parent left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return code


def wait_all(nodes: list[LocalNode], predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate()`` until truthy; raises RuntimeError (with the logs) if a node exits first,
    TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        dead = [n.name for n in nodes if n.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead} exited while waiting for {what}:\n{_tails(nodes)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f}s:\n{_tails(nodes)}")
        time.sleep(0.2)


def _tails(nodes: list[LocalNode], chars: int = 1500) -> str:
    return "\n".join(f"--- {n.name}\n{n.log_tail(chars)}" for n in nodes)


def write_json(path: Path, data) -> None:
    """Write a benchmark's results (creating the directory) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")


def steps_of(node: LocalNode) -> dict[int, dict]:
    """The node's metrics rows by outer step."""
    return {r["outer_step"]: r for r in node.metrics()}


def start_swarm(n: int, workdir: Path, args: list[str], threads: int = 1) -> list[LocalNode]:
    """n nodes, the first one bootstrapping, all waiting for each other (--min-replicas n)."""
    common = args + ["--min-replicas", str(n), "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0"]
    first = LocalNode("node0", workdir / "node0", common, threads).wait_started()
    rest = [LocalNode(f"node{i}", workdir / f"node{i}", common + ["--join", first.join_maddr], threads)
            for i in range(1, n)]
    return [first, *[node.wait_started() for node in rest]]


def leave_all(nodes: list[LocalNode], timeout: float = 120.0) -> list[int]:
    """Ask every node to drain over gRPC, then wait for the processes; returns exit codes."""
    for node in nodes:
        try:
            node.stub().Leave(node_pb2.LeaveRequest(reason="local swarm finished"), timeout=5)
        except grpc.RpcError:
            pass
    return [_wait(node, timeout) for node in nodes]


def _wait(node: LocalNode, timeout: float) -> int:
    try:
        return node.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return node.terminate(signal.SIGKILL)


def digests_by_step(nodes: list[LocalNode]) -> dict[int, set[str]]:
    """outer_step -> the set of global_params_digest values the nodes recorded for it."""
    out: dict[int, set[str]] = {}
    for n in nodes:
        for r in n.metrics():
            out.setdefault(r["outer_step"], set()).add(r["digest"])
    return out


def group_applied(nodes: list[LocalNode], upto: float = float("inf")) -> Counter:
    """(outer_step, digest) -> how many nodes hold that update, over rounds applied by a group of 2 or
    more up to ``upto``. Each node counts once per step (a restarted node re-records steps). An update
    held by a single node would be a partial average; two digests at one step are two groups."""
    held: Counter = Counter()
    for n in nodes:
        for r in {r["outer_step"]: r for r in n.metrics()}.values():
            if r["outcome"] == "applied" and r["group_size"] >= 2 and r["outer_step"] <= upto:
                held[r["outer_step"], r["digest"]] += 1
    return held


def summarize(nodes: list[LocalNode]) -> dict:
    """Per-node figures from the nodes' metrics.jsonl (one record per outer step)."""
    import statistics

    per_node = {}
    for node in nodes:
        rows = node.metrics()
        if not rows:
            continue
        per_node[node.name] = dict(
            outer_steps=rows[-1]["outer_step"], first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"],
            first_val_loss=rows[0]["val_loss"], last_val_loss=rows[-1]["val_loss"],
            tokens_per_second_compute=statistics.median(r["tokens_per_second"] for r in rows),
            median_compute_s=statistics.median(r["compute_s"] for r in rows),
            median_comm_s=statistics.median(r["duration_s"] for r in rows),
            median_wait_s=statistics.median(r.get("wait_s", r["duration_s"]) for r in rows),
            compute_utilization=rows[-1].get("compute_utilization", 0.0),
            median_bytes_sent_per_outer_step=statistics.median(r["bytes_sent"] for r in rows),
            payload_bytes=rows[-1]["payload_bytes"], group_sizes=sorted({r["group_size"] for r in rows}),
            digest_last=rows[-1]["digest"],
        )
    return per_node


@contextlib.contextmanager
def peers_on_loopback(n: int, namespace: str, tampers=(), offer_wait_s: float = 1.0, keep: int = 4):
    """n real hivemind peers on loopback, each with a ContributionServer (``tampers[i]``: peer i's hook) that
    waits ``offer_wait_s`` for an offer asked for before it was made and keeps ``keep`` offers; yields
    [(peer_id, server, dht)]."""
    import hivemind  # here, not at the top: the node launcher above needs neither
    from dilocox.peers.contributions import ContributionServer

    dhts, out = [], []
    try:
        for i in range(n):
            dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs() if dhts else None, start=True,
                                     host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, startup_timeout=60))
            tamper = tampers[i] if i < len(tampers) else None
            out.append(ContributionServer(dhts[-1].replicate_p2p, namespace, tamper=tamper, offer_wait_s=offer_wait_s,
                                          keep=keep))
        yield [(d.peer_id.to_base58(), s, d) for d, s in zip(dhts, out)]
    finally:
        for s in out:
            s.shutdown()  # idempotent, as is DHT.shutdown: a test may stop a peer early
        for d in dhts:
            d.shutdown()
