"""Run a local swarm of dilocox-node processes on loopback and watch it over gRPC.

Used by ``make demo`` (daemon/demo.py) and ``make bench`` (bench/). Every node is a real
``dilocox-node`` process; this module only starts them, polls ``GetStatus`` and asks them to
``Leave``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from proto.dilocox.v1 import node_pb2, node_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


@dataclass
class LocalNode:
    name: str
    workdir: Path
    proc: subprocess.Popen
    addr: str = ""
    join_maddr: str = ""
    history: list = field(default_factory=list)

    def stub(self):
        return node_pb2_grpc.NodeStub(grpc.insecure_channel(self.addr))

    def status(self, timeout: float = 3.0):
        return self.stub().GetStatus(node_pb2.GetStatusRequest(), timeout=timeout)

    def metrics(self) -> list[dict]:
        path = self.workdir / "ckpt" / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start_node(name: str, workdir: Path, args: list[str], threads: int = 1, timeout: float = 120.0) -> LocalNode:
    """Start one node and wait for its 'join with' and 'status' lines; raises RuntimeError if it dies."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCOX_")}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    out = open(workdir / "stdout", "w")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", *args, "--checkpoint-dir", str(workdir / "ckpt")],
                            stdout=out, stderr=open(workdir / "stderr", "w"), env=env, cwd=REPO,
                            start_new_session=True)  # Ctrl-C of the demo reaches nodes only via Leave
    node = LocalNode(name, workdir, proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in (workdir / "stdout").read_text().splitlines():
            if line.startswith("join with:"):
                node.join_maddr = line.split()[-1]
            elif line.startswith("status:"):
                node.addr = line.split("--addr", 1)[1].split()[0]
        if node.addr and node.join_maddr:
            return node
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}:\n{(workdir / 'stderr').read_text()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{name} did not start within {timeout}s")


def start_swarm(n: int, workdir: Path, args: list[str], threads: int = 1) -> list[LocalNode]:
    """n nodes, the first one bootstrapping, all waiting for each other (--min-replicas n)."""
    common = args + ["--min-replicas", str(n), "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0"]
    first = start_node("node0", workdir / "node0", common, threads)
    rest = [start_node(f"node{i}", workdir / f"node{i}", common + ["--join", first.join_maddr], threads)
            for i in range(1, n)]
    return [first, *rest]


def leave_all(nodes: list[LocalNode], timeout: float = 120.0) -> list[int]:
    """Ask every node to drain over gRPC, then wait for the processes; returns exit codes."""
    for node in nodes:
        try:
            node.stub().Leave(node_pb2.LeaveRequest(reason="local swarm finished"), timeout=5)
        except grpc.RpcError:
            pass
    codes = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(node.proc.pid, signal.SIGKILL)
            codes.append(node.proc.wait())
    return codes


def summarize(nodes: list[LocalNode]) -> dict:
    """Per-node and swarm figures from the nodes' metrics.jsonl (one record per outer step)."""
    import statistics

    per_node = {}
    for node in nodes:
        rows = [r for r in node.metrics() if r["outcome"] in ("applied", "solo")]
        if not rows:
            continue
        comm = [r["duration_s"] for r in rows]
        compute = [r["compute_s"] for r in rows]
        per_node[node.name] = dict(
            outer_steps=rows[-1]["outer_step"], first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"],
            first_val_loss=rows[0]["val_loss"], last_val_loss=rows[-1]["val_loss"],
            tokens_per_second_compute=statistics.median(r["tokens_per_second"] for r in rows),
            median_compute_s=statistics.median(compute), median_comm_s=statistics.median(comm),
            median_bytes_sent_per_outer_step=statistics.median(r["bytes_sent"] for r in rows),
            payload_bytes=rows[-1]["payload_bytes"], group_sizes=sorted({r["group_size"] for r in rows}),
            digests_last=rows[-1]["digest"],
        )
    return per_node
