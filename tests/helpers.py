"""Start real dilocox-node processes on loopback and talk to them over gRPC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from proto.dilocox.v1 import node_pb2, node_pb2_grpc

FAST = ["--model", "tiny", "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0",
        "--request-timeout", "1", "--matchmaking-time", "2", "--averaging-timeout", "8",
        "--outer-round-deadline", "30", "--announce-period", "1", "--inner-steps", "20",
        "--warmup-steps", "10", "--total-steps", "2000", "--eval-batches", "2"]


def node_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCOX_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class NodeProcess:
    """A dilocox-node subprocess with its stdout/stderr in files under ``workdir``."""

    def __init__(self, workdir: Path, name: str, args: list[str], env: dict | None = None):
        self.name, self.dir = name, workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = self.dir / "stdout", self.dir / "stderr"
        self.args = [sys.executable, "-m", "daemon.cli", *args, "--checkpoint-dir", str(self.dir / "ckpt")]
        self.proc = subprocess.Popen(self.args, stdout=open(self.out_path, "w"), stderr=open(self.err_path, "w"),
                                     env=env or node_env(), cwd=Path(__file__).resolve().parents[1],
                                     start_new_session=True)  # own process group: teardown reaches p2pd too
        self.addr = self.join_maddr = None

    def wait_started(self, timeout: float = 90.0) -> "NodeProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.out_path.read_text()
            if "status: dilocox-ctl --addr" in text and "join with:" in text:
                for line in text.splitlines():
                    if line.startswith("join with:"):
                        self.join_maddr = line.split()[-1]
                    if line.startswith("status:"):
                        self.addr = line.split("--addr", 1)[1].split()[0]
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.err_path.read_text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not start in {timeout}s: {self.err_path.read_text()[-3000:]}")

    def stub(self) -> node_pb2_grpc.NodeStub:
        return node_pb2_grpc.NodeStub(grpc.insecure_channel(self.addr))

    def status(self) -> node_pb2.NodeStatus:
        return self.stub().GetStatus(node_pb2.GetStatusRequest(), timeout=5)

    def metrics(self) -> list[dict]:
        path = self.dir / "ckpt" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} while waiting for {what}:\n"
                                   f"{self.err_path.read_text()[-4000:]}")
            try:
                value = predicate(self)
            except grpc.RpcError:
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{self.name}: no {what} within {timeout}s:\n{self.err_path.read_text()[-4000:]}")

    def terminate(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` to the node; SIGKILL goes to its whole process group (DHT, averager, p2pd)."""
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
        try:  # children left behind by a killed parent
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return code


def digests_by_step(nodes: list[NodeProcess]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for n in nodes:
        for r in n.metrics():
            out.setdefault(r["outer_step"], set()).add(r["digest"])
    return out
