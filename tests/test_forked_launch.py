"""tests/harness/forked.py: local nodes forked from one shared image train as interpreter-started ones do, share the
image's pages, and end on SIGTERM like any dilocox-node."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from bench.compare import _rollup
from tests.harness.forked import IMAGE, ForkedProcess, _node
from tests.harness.localswarm import JOINT, LocalNode, wait_all

pytestmark = [pytest.mark.integration]

ARGS = ["--workload", "synthetic:200k:0.05", "--inner-steps", "20", "--listen", "/ip4/127.0.0.1/tcp/0",
        "--status-addr", "127.0.0.1:0", "--min-replicas", "2", "--run-id", "forked"]


@pytest.mark.swarm  # 29 s: test-swarm (make test's budget)
def test_two_forked_nodes_train_together_share_the_image_and_leave_on_sigterm(tmp_path):
    a = LocalNode("a", tmp_path / "a", ARGS, forked=True).wait_started()
    b = LocalNode("b", tmp_path / "b", ARGS + ["--join", a.join_maddr], forked=True)
    nodes = [a, b]
    try:
        assert isinstance(a.proc, ForkedProcess)
        wait_all(nodes, lambda: all(sum(r["outcome"] in JOINT for r in n.metrics()) >= 2 for n in nodes), 120,
                 "two joint rounds on both nodes")
        steps = [{r["outer_step"]: r["digest"] for r in n.metrics()} for n in nodes]
        assert steps[0][2] == steps[1][2]  # one update at outer step 2
        server = {psutil.Process(n.proc.pid).ppid() for n in nodes}
        assert len(server) == 1  # both forked from the same process
        fields = _rollup(server.pop())
        anon, pss = fields["Anonymous"], fields["Pss_Anon"]
        # the image (torch, hivemind: > 150 MB of anonymous memory) is shared with the nodes and their children,
        # so the server's proportional share of it is a fraction; a private copy would make the two equal
        assert anon > 150_000 * 1024 and pss < anon / 3, (anon, pss)
        groups = [n.proc.pid for n in nodes]
    finally:
        for n in nodes:
            n.proc.send_signal(signal.SIGTERM)
        codes = [n.terminate(signal.SIGTERM, timeout=60) for n in nodes]
    assert codes == [0, 0], codes
    assert not [p.pid for p in psutil.process_iter() if _group(p) in groups]  # nothing left in their groups


def _group(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (OSError, psutil.Error):
        return None


def test_a_forked_node_refuses_to_run_without_the_shared_image(monkeypatch, tmp_path):
    """A forkserver that could not import the image would give each node a fresh import: the point is lost,
    so the node says so instead of running."""
    import sys

    monkeypatch.delitem(sys.modules, IMAGE, raising=False)
    with pytest.raises(RuntimeError, match="did not import tests.harness.node_image"):
        _node([], str(tmp_path), {}, str(tmp_path / "out"), str(tmp_path / "err"), 1)
    assert "did not import tests.harness.node_image" in (tmp_path / "err").read_text()  # the node's log says why


def test_signalling_a_node_the_forkserver_already_reaped_is_a_no_op():
    """A forked node's parent is the forkserver, which reaps it before our ``exitcode`` knows it ended: its pid
    is gone while ``exitcode`` is still None. The stop that sends SIGTERM to every node then raised
    ProcessLookupError and ended a 32-node bench before its figures were written."""
    import subprocess
    import types

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: os.kill(pid) raises ProcessLookupError
    proc = ForkedProcess.__new__(ForkedProcess)
    proc._process, proc.pid = types.SimpleNamespace(exitcode=None), gone.pid
    with pytest.raises(ProcessLookupError):
        os.kill(gone.pid, signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)


LAUNCHER = """
import sys, time
from pathlib import Path
from tests.harness.localswarm import LocalNode
node = LocalNode("a", Path(sys.argv[1]), sys.argv[3:], forked=sys.argv[2] == "forked").wait_started()
print(node.proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.swarm  # about 15 s each: test-swarm (make test's budget)
@pytest.mark.parametrize("launch", ["forked", "interpreter"])
def test_a_node_leaves_when_the_benchmark_that_started_it_is_killed(tmp_path, launch):
    """A benchmark or test SIGKILLed from outside (a CI timeout, kill -9) ran no cleanup, and its nodes went on
    running: a forked node's parent is the forkserver, which itself lives while any node it forked does, and an
    interpreter-started node was reparented to init. Now a forked node watches its launcher
    (tests/harness/forked.py ``leave_when_gone``) and an interpreter-started one gets SIGTERM from the kernel
    (tests/harness/localswarm.py ``term_with_parent``): each leaves, and nothing is left of its process group."""
    import subprocess
    import sys

    from dilocox.peers.swarm import wait_for

    from tests.harness.localswarm import REPO

    group = None
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "a"), launch, *ARGS], cwd=REPO,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid = int(launcher.stdout.readline())
        node = psutil.Process(pid)
        group = os.getpgid(pid)
        server = node.ppid() if launch == "forked" else None
        launcher.kill()
        launcher.wait(10)
        assert node.is_running()  # the kill did not reach the node itself
        node.wait(90)  # it leaves: SIGTERM, drain, exit
        left = wait_for(lambda: not [p for p in psutil.process_iter() if _group(p) == group], 30, poll_s=0.5)
        assert left, [p.pid for p in psutil.process_iter() if _group(p) == group]
        if server is not None:  # the forkserver ends with its last client
            wait_for(lambda: not psutil.pid_exists(server), 30, poll_s=0.5)
            assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
        assert "leave requested (SIGTERM)" in (tmp_path / "a" / "stderr").read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in psutil.process_iter():
            if group is not None and _group(p) == group:
                p.kill()
