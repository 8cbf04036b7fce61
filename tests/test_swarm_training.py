"""Real swarms on loopback: 3 nodes train together, a gRPC client observes, one leaves with SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
import pytest
from dilocox.proto.dilocox.v1 import node_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.helpers import FAST, LocalNode, digests_by_step, node_env, start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]


@pytest.fixture(scope="module")
def swarm3(tmp_path_factory):
    work = tmp_path_factory.mktemp("swarm3")
    # the basic swarm: synchronous fp32 DiLoCo. With delayed overlap a node that resyncs after a partial
    # result can chase the swarm for a few rounds, and adaptive low rank learns slower per round on the
    # tiny model (make bench measures it); tests/test_delayed.py and test_netsim.py cover the defaults.
    args = FAST + ["--run-id", "swarm3", "--min-replicas", "3", "--overlap", "none", "--compression", "none"]
    first = start(work, "n0", args)
    nodes = [first] + [LocalNode(f"n{i}", work / f"n{i}", args + ["--join", first.join_maddr]) for i in (1, 2)]
    for n in nodes[1:]:
        n.wait_started()
    yield nodes
    for n in nodes:
        n.terminate(signal.SIGKILL)


def test_three_nodes_train_together(swarm3):
    for n in swarm3:
        n.wait_for(lambda p: p.status().outer_step >= 4, 120, "outer step 4")
    steps = digests_by_step(swarm3)
    for step in range(1, 5):
        assert len(steps[step]) == 1, f"replicas disagree at outer step {step}: {steps[step]}"
    for n in swarm3:
        rounds = [r for r in n.metrics() if r["outer_step"] <= 4]
        assert [r["group_size"] for r in rounds] == [3, 3, 3, 3], rounds
        # "resynced": hivemind returned a partial average to this node; it took the group's result instead
        assert all(r["outcome"] in ("applied", "resynced") for r in rounds), rounds
        status = n.status()
        assert status.loss < status.initial_loss - 1.0, (status.loss, status.initial_loss)
        assert rounds[-1]["val_loss"] < rounds[0]["val_loss"]
        assert status.last_round.payload_bytes > 0 and status.bytes_sent > 0
    # the same outer step means the same digest over gRPC too
    last = [n.status() for n in swarm3]
    by_step = {}
    for s in last:
        by_step.setdefault(s.outer_step, set()).add(s.global_params_digest)
    assert all(len(v) == 1 for v in by_step.values()), by_step


def test_ctl_status_json_and_peers(swarm3):
    node = swarm3[0]
    out = subprocess.run([sys.executable, "-m", "dilocox.daemon.ctl", "--addr", node.addr, "status", "--json"],
                         capture_output=True, text=True, timeout=60, env=node_env())
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    for field in ("peer_id", "listen_maddrs", "outer_step", "inner_step", "loss", "global_params_digest"):
        assert field in status, field
    assert "group_size" in status["last_round"]
    assert status["listen_maddrs"][0].startswith("/ip4/127.0.0.1/tcp/")
    assert status["reachability"] == "reachable" and status["client_mode"] is False
    # butterfly rounds (compression none) keep the flag as hivemind's all-reduce timeout
    assert status["deadlines"] == "matchmaking 2s, round 30s (flags), all-reduce 8s (flag)", status["deadlines"]
    out = subprocess.run([sys.executable, "-m", "dilocox.daemon.ctl", "--addr", node.addr, "peers", "--json"],
                         capture_output=True, text=True, timeout=60, env=node_env())
    assert out.returncode == 0, out.stderr
    peers = json.loads(out.stdout)
    assert {p["peer_id"] for p in peers} == {n.status().peer_id for n in swarm3}
    assert all(p["client_mode"] is False and p["undialable_by"] == [] for p in peers), peers


def test_health_reflection_and_bad_requests(swarm3):
    channel = grpc.insecure_channel(swarm3[0].addr)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="dilocox.v1.Node"), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING

    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    services = {s.name for r in replies for s in r.list_services_response.service}
    assert "dilocox.v1.Node" in services and "grpc.health.v1.Health" in services

    unknown = channel.unary_unary("/dilocox.v1.Node/NoSuchMethod")
    with pytest.raises(grpc.RpcError) as err:
        unknown(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

    raw = channel.unary_unary("/dilocox.v1.Node/GetStatus")  # bytes in, bytes out: no (de)serializers
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff\xff garbage", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # and the node keeps serving (below)

    watch = swarm3[0].stub().WatchStatus(node_pb2.WatchStatusRequest(interval_s=0.2), timeout=10)
    first, second = next(watch), next(watch)
    watch.cancel()
    assert first.peer_id == second.peer_id
    assert swarm3[0].status().state in ("TRAINING", "AVERAGING")  # still serving after all of the above


def test_sigterm_during_round_leaves_cleanly(swarm3):
    leaver, stayers = swarm3[2], swarm3[:2]
    leaver.wait_for(lambda p: p.status().state == "AVERAGING", 60, "an averaging phase")
    started = time.monotonic()
    code = leaver.terminate(signal.SIGTERM, timeout=40)
    assert code == 0, leaver.log_tail()
    assert time.monotonic() - started < 8 + 5  # within averaging_timeout (+ process teardown)
    left_at = max(r["outer_step"] for r in stayers[0].metrics())
    for n in stayers:
        n.wait_for(lambda p: any(r["outer_step"] >= left_at + 2 and r["group_size"] == 2 for r in p.metrics()),
                   120, "two more rounds with a group of 2")
    steps = digests_by_step(stayers)
    assert all(len(steps[s]) == 1 for s in steps if s > left_at), steps
