"""Bad input to dilocox-node: a clear message naming the problem and a non-zero exit, quickly."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.harness.forked import ForkedProcess
from tests.helpers import FAST, LocalNode, node_env, start

pytestmark = pytest.mark.integration  # hivemind peers (p2pd) or node processes: make test, not make check

REPO = Path(__file__).resolve().parents[1]


def run_node(args, env_extra=None, timeout=90):
    """(exit code, stderr, seconds) of ``dilocox-node ARGS``: the daemon's own ``node_main`` in a process forked
    from the shared image (tests/harness/forked.py), as a fresh interpreter would run it minus the imports (5-8 s a case
    on 2 cores, most of this file's time when each case was its own interpreter)."""
    env = node_env()
    env.update(env_extra or {})
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dlx-bad-input-") as d:
        proc = ForkedProcess(list(args), str(REPO), env, f"{d}/stdout", f"{d}/stderr")
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            raise
        return code, Path(d, "stderr").read_text(), time.monotonic() - start


def test_missing_data_path(tmp_path):
    code, err, _ = run_node(FAST + ["--data", str(tmp_path / "nope.txt")])
    assert code == 2 and "nope.txt does not exist" in err


def test_empty_data_file(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    code, err, _ = run_node(FAST + ["--data", str(tmp_path / "empty.txt")])
    assert code == 2 and "empty.txt is empty" in err


def test_undecodable_data_file(tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"hello \xff\xfe\x00\x81 world" * 50)
    code, err, _ = run_node(FAST + ["--data", str(tmp_path / "bin.txt")])
    assert code == 2 and "bin.txt is not UTF-8" in err


def test_unknown_config_field(tmp_path):
    (tmp_path / "node.toml").write_text('inner_steps = 5\nbogus_field = 1\n')
    code, err, _ = run_node(FAST + ["--config", str(tmp_path / "node.toml")])
    assert code == 2 and "unknown field(s) bogus_field" in err


def test_unknown_env_variable():
    code, err, _ = run_node(FAST, {"DILOCOX_INNER_STEPZ": "5"})
    assert code == 2 and "DILOCOX_INNER_STEPZ" in err


def test_invalid_value_names_its_source():
    code, err, _ = run_node(FAST, {"DILOCOX_OUTER_LR": "zero"})
    assert code == 2 and "DILOCOX_OUTER_LR" in err
    code, err, _ = run_node(FAST + ["--matchmaking-time", "50"])
    assert code == 2 and "matchmaking_time" in err and "averaging_timeout" in err


def test_bad_multiaddr():
    code, err, _ = run_node(FAST + ["--join", "not-a-multiaddr"])
    assert code != 0 and "not-a-multiaddr" in err


def test_unreachable_join_address():
    # a valid multiaddr on a closed loopback port: the join is retried (peers/bootstrap.py) until --sync-deadline,
    # then the node exits 1 naming the address, the attempts and the last failure; it never hangs
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmPu7vZznbjWzqnHeV4eupKG9tWuiSr4cCVAtpVnegHXy9"
    code, err, elapsed = run_node(FAST + ["--join", dead, "--startup-timeout", "20", "--sync-deadline", "6"])
    assert code == 1 and "could not join the DHT" in err and dead in err, err[-2000:]
    assert "within --sync-deadline 6s" in err and "failed to connect to bootstrap peers" in err, err[-2000:]
    assert elapsed < 60


def test_busy_status_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = [a for a in FAST]
        args[args.index("--status-addr") + 1] = f"127.0.0.1:{port}"
        code, err, _ = run_node(args)
    assert code == 2 and f"127.0.0.1:{port} is not available" in err


@pytest.mark.parametrize("model", ["huge", "missing.json"])
def test_unknown_model(model):
    code, err, _ = run_node(FAST + ["--model", model])
    assert code == 2 and model in err


@pytest.mark.parametrize("args, message", [
    (["--stage", "2/2"], "stage '2/2': need K < S"),
    (["--stage", "0/3"], "3 stages need at least 3 decoder layers"),
    (["--stage", "0/2", "--microbatches", "3"], "microbatches=3 must divide batch_size=8"),
    (["--stage", "0/2", "--micro-batch-size", "3"], "micro_batch_size=3 must divide batch_size=8"),
    (["--stage", "0/2", "--micro-batch-size", "8"], "gives 1 pipeline micro-batch(es), fewer than the 2 stages"),
    (["--device", "cuda:7"], "device cuda:7: this process sees"),
    (["--tokenizer", "/nonexistent/tok.json"], "tokenizer '/nonexistent/tok.json': cannot read"),
    (["--stage", "0/2", "--pipeline-addr", "192.0.2.7:0"],
     "pipeline address 192.0.2.7 is not an address of this machine"),
])
def test_bad_stage_arguments(args, message):
    code, err, _ = run_node(FAST + args)
    assert code == 2 and message in err, err


@pytest.mark.integration
def test_a_joiner_with_other_swarm_settings_refuses_to_join_and_the_swarm_trains_on(tmp_path):
    """Another outer learning rate would leave theta different after every outer step (and re-sync every round):
    the joiner exits 2 naming both settings digests and its own settings; the member keeps training."""
    args = FAST + ["--run-id", "settings"]
    a = start(tmp_path, "a", args)
    try:
        x = LocalNode("x", tmp_path / "x", args + ["--join", a.join_maddr, "--outer-lr", "1.5"])
        assert x.proc.wait(60) == 2, x.log_tail()
        assert re.search(r"not joining: 1 of the 1 other live members of our stage \(.*\) run swarm settings "
                         r"[0-9a-f]{16}; ours are [0-9a-f]{16}: H=20 T=2000 .*outer=sgd\(lr=1\.5,momentum=0\.0,",
                         x.log_tail()), x.log_tail()
        status = a.status()
        assert "outer=sgd(lr=2.5->4.5 over 100 rounds," in status.swarm_settings, status.swarm_settings
        step = status.outer_step
        a.wait_for(lambda p: p.status().outer_step > step and p.status().state in ("TRAINING", "AVERAGING"), 60,
                   "another outer step")
    finally:
        a.terminate(signal.SIGKILL)
