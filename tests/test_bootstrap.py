"""Joins that survive a busy or unreachable bootstrap peer: the retry rules (fakes) and real hivemind DHTs."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Optional

import psutil
import pytest
from dilocox.peers.bootstrap import Backoff, JoinAbandoned, is_join_failure, keep_trying


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class AdvancingStop(threading.Event):
    """A stop event whose waits advance the fake clock instead of sleeping."""

    def __init__(self, clock: FakeClock):
        super().__init__()
        self.clock, self.waits = clock, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        self.clock.now += timeout
        return self.is_set()


def test_backoff_grows_to_its_cap_with_bounded_jitter():
    b, rng = Backoff(first_s=1.0, factor=2.0, cap_s=30.0, jitter=0.25), random.Random(0)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (40, 30.0)]:
        delays = [b.delay(attempt, rng) for _ in range(200)]
        assert base * 0.75 <= min(delays) and max(delays) <= base * 1.25, (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > base * 0.3  # joiners started together do not knock again in step


def test_join_failures_are_retried_and_our_own_are_not():
    assert is_join_failure(RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping."))
    assert is_join_failure(RuntimeError("Daemon failed to start: failed to connect to bootstrap peers"))
    assert is_join_failure(TimeoutError())
    assert not is_join_failure(RuntimeError("Daemon failed to start: failed to listen on any addresses"))
    assert not is_join_failure(ValueError("identity is taken by another peer"))


def test_keep_trying_retries_until_a_join_and_reports_each_failure():
    clock = FakeClock()
    stop, seen, calls = AdvancingStop(clock), [], []

    def attempt():
        calls.append(clock.now)
        if len(calls) < 4:
            raise RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping.")
        return "dht"

    got = keep_trying(attempt, deadline_s=None, stop=stop, on_failure=lambda n, why, s: seen.append((n, why, s)),
                      backoff=Backoff(jitter=0.0), clock=clock)
    assert got == "dht" and len(calls) == 4
    assert [(n, s) for n, _, s in seen] == [(1, 1.0), (2, 2.0), (3, 4.0)]
    assert "initial_peers responded" in seen[0][1]


def test_keep_trying_gives_up_at_the_deadline_and_on_a_leave():
    clock = FakeClock()

    def busy():
        raise RuntimeError("DHTNode bootstrap failed")

    with pytest.raises(JoinAbandoned, match="within --sync-deadline 10s") as e:
        keep_trying(busy, deadline_s=10, stop=AdvancingStop(clock), on_failure=lambda *a: None,
                    backoff=Backoff(jitter=0.0), clock=clock)
    assert not e.value.requested and clock.now == 7.0  # waited 1 + 2 + 4; the next 8 s would pass the deadline

    stop = AdvancingStop(FakeClock())
    stop.set()
    with pytest.raises(JoinAbandoned, match="leave requested") as e:
        keep_trying(busy, deadline_s=None, stop=stop, on_failure=lambda *a: None)
    assert e.value.requested

    def broken():
        raise RuntimeError("failed to listen on any addresses")

    with pytest.raises(RuntimeError, match="failed to listen"):  # our own problem: no retry, no wait
        keep_trying(broken, deadline_s=None, stop=AdvancingStop(FakeClock()), on_failure=lambda *a: None)


def key(path):
    """The signing key of a (new) identity file: a member's records are signed with its peer identity."""
    from dilocox.peers.identity import load_or_create_identity

    return load_or_create_identity(path)[1]


def _p2pds(pid: Optional[int] = None) -> set[int]:
    """The p2pd processes below ours (or below ``pid``). One that exits between the listing and its name (the
    identity check's short-lived p2pd) is skipped: raising there ended a P2pdWatch in CI (at b78fbb0), which then
    missed the joiner's own p2pd that started after it."""
    found = set()
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "p2pd" in p.name():
                found.add(p.pid)
        except psutil.Error:  # NoSuchProcess, ZombieProcess: it has just exited
            pass
    return found


@pytest.mark.integration
def test_a_joiner_waits_out_a_frozen_bootstrap_peer_and_leaves_no_processes_behind(tmp_path):
    """Real hivemind DHTs: the bootstrap peer's DHT process is stopped (SIGSTOP: it accepts connections
    through p2pd but answers no ping, as a peer swamped by joiners), so the joiner's first attempts fail;
    once it answers again the joiner gets in, and the failed attempts left no p2pd running."""
    from dilocox.peers.swarm import JoinError, Swarm
    from hivemind.utils.crypto import RSAPrivateKey

    loop = ["/ip4/127.0.0.1/tcp/0"]
    boot = Swarm("bt", RSAPrivateKey(), initial_peers=[], host_maddrs=loop, announce_maddrs=[],
                 identity_path=str(tmp_path / "boot.key"))
    joiner = None
    try:
        before, maddrs = _p2pds(), boot.visible_maddrs()  # asked before the freeze: it goes through the DHT
        os.kill(boot.dht.pid, signal.SIGSTOP)
        failures = []
        timer = threading.Timer(12.0, lambda: os.kill(boot.dht.pid, signal.SIGCONT))
        timer.start()
        began = time.monotonic()
        joiner = Swarm("bt", RSAPrivateKey(), initial_peers=maddrs, host_maddrs=loop,
                       announce_maddrs=[], identity_path=str(tmp_path / "j.key"), startup_timeout_s=20,
                       on_join_failure=lambda n, why, s: failures.append((n, why)))
        assert failures and all("bootstrap" in why or "ping" in why for _, why in failures), failures
        assert time.monotonic() - began >= 12.0
        assert _p2pds() - before == _p2pds(joiner.dht.pid)  # one p2pd per live DHT: the failed ones ended
        # and a joiner told to give up does, with the reason
        os.kill(boot.dht.pid, signal.SIGSTOP)
        with pytest.raises(JoinError, match="within --sync-deadline"):
            Swarm("bt", RSAPrivateKey(), initial_peers=maddrs, host_maddrs=loop, announce_maddrs=[],
                  identity_path=str(tmp_path / "k.key"), join_deadline_s=5.0)
    finally:
        os.kill(boot.dht.pid, signal.SIGCONT)
        for s in (joiner, boot):
            if s is not None:
                s.shutdown()


def test_only_a_key_made_for_this_start_counts_as_new(tmp_path):
    from dilocox.peers.identity import is_new_identity, load_or_create_identity

    path = tmp_path / "id.key"
    assert is_new_identity(None) and is_new_identity(path)
    load_or_create_identity(path)
    assert not is_new_identity(path) and not is_new_identity(str(path))


class P2pdWatch(threading.Thread):
    """Every p2pd our process tree started while the watch ran (polled every 10 ms)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.seen, self.done = set(), threading.Event()

    def run(self):
        while not self.done.is_set():
            self.seen |= _p2pds()
            time.sleep(0.01)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.join()


@pytest.mark.integration
def test_the_identity_check_guards_a_kept_key_and_is_skipped_for_a_new_one(tmp_path):
    """hivemind's check for a peer already holding our identity starts a second p2pd that dials the swarm. It
    still refuses a kept key that a live peer holds, with the reason and no retry; with ``check_identity=False``,
    as the node passes for a key made for this start (the file exists by then: hivemind itself skips the check
    only for a file it makes), the joiner starts its own p2pd and no other."""
    from dilocox.peers.swarm import JoinError, Swarm

    loop = ["/ip4/127.0.0.1/tcp/0"]
    boot = Swarm("ic", key(tmp_path / "boot.key"), initial_peers=[], host_maddrs=loop, announce_maddrs=[],
                 identity_path=str(tmp_path / "boot.key"))
    joiners = []
    try:
        maddrs, before = boot.visible_maddrs(), _p2pds()
        with pytest.raises(JoinError, match="taken"):
            Swarm("ic", key(tmp_path / "boot.key"), initial_peers=maddrs, host_maddrs=loop, announce_maddrs=[],
                  identity_path=str(tmp_path / "boot.key"), join_deadline_s=30.0)
        for check in (True, False):
            with P2pdWatch() as watch:
                joiners.append(Swarm("ic", key(tmp_path / f"{check}.key"), initial_peers=maddrs, host_maddrs=loop,
                                     announce_maddrs=[], identity_path=str(tmp_path / f"{check}.key"),
                                     check_identity=check))
            own = _p2pds(joiners[-1].dht.pid)
            assert len(own) == 1 and own <= watch.seen
            assert len(watch.seen - before) == (2 if check else 1), (check, watch.seen - before, own)
            before = _p2pds()
    finally:
        for s in (*joiners, boot):
            s.shutdown()


@pytest.mark.integration
def test_24_joiners_started_at_once_against_a_busy_bootstrap_peer_all_get_in(tmp_path):
    """24 real DHT joiners start together while the only bootstrap peer is frozen (SIGSTOP) until it has turned
    one of them away (6 s at least: 24 DHT processes take seconds to start on 2 cores, and a fixed 6 s freeze
    could end before any of them dialled); none gives up, and afterwards every one of them is in the same DHT:
    each sees all 25 membership records."""
    from dilocox.peers.records import MemberRecord
    from dilocox.peers.swarm import Swarm, wait_for

    loop, n = ["/ip4/127.0.0.1/tcp/0"], 24
    boot = Swarm("storm", key(tmp_path / "boot.key"), initial_peers=[], host_maddrs=loop, announce_maddrs=[],
                 identity_path=str(tmp_path / "boot.key"), ttl_s=120)
    maddrs = boot.visible_maddrs()
    joiners, errors, failures = [None] * n, [], []

    def join(i: int) -> None:
        try:
            joiners[i] = Swarm("storm", key(tmp_path / f"{i}.key"), initial_peers=maddrs, host_maddrs=loop,
                               announce_maddrs=[], identity_path=str(tmp_path / f"{i}.key"), ttl_s=120,
                               on_join_failure=lambda k, why, s: failures.append((i, k)))
        except Exception as e:  # noqa: BLE001 - the test reports whatever a joiner died of
            errors.append((i, repr(e)))

    def record(s: Swarm) -> MemberRecord:
        return MemberRecord(peer_id=s.peer_id, run_id="storm", state="TRAINING", outer_step=0, inner_step=0,
                            inner_steps=1, tokens_per_second=0.0, loss=0.0, global_params_digest="")

    try:
        os.kill(boot.dht.pid, signal.SIGSTOP)

        def thaw_after_a_refusal() -> None:
            time.sleep(6.0)
            wait_for(lambda: failures, 120)
            os.kill(boot.dht.pid, signal.SIGCONT)

        threading.Thread(target=thaw_after_a_refusal, daemon=True).start()
        threads = [threading.Thread(target=join, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert failures, "the frozen bootstrap peer turned nobody away: the test did not test the retry"
        everyone = [boot] + joiners
        # the first heartbeat after the storm may find no peer free to store it (a node retries with its next
        # heartbeat, every --announce-period): retry as a node would, and name the swarm that never stored
        unstored = [s.peer_id[-6:] for s in everyone if not wait_for(lambda: s.publish(record(s)), 60, poll_s=1.0)]
        assert not unstored, f"no DHT peer stored these joiners' records in 60 s: {unstored}"
        seen = {s.peer_id: wait_for(lambda: len(s.members(max_age_s=0)) == n + 1 and s.members(max_age_s=0), 60)
                for s in everyone}
        assert all(len(v) == n + 1 for v in seen.values()), {p[-6:]: len(v) for p, v in seen.items()}
    finally:
        os.kill(boot.dht.pid, signal.SIGCONT)
        ends = [threading.Thread(target=s.shutdown) for s in [boot] + joiners if s is not None]
        for t in ends:
            t.start()
        for t in ends:
            t.join(60)


@pytest.mark.integration
def test_a_node_joining_a_busy_swarm_keeps_trying_and_every_stop_path_ends_it(tmp_path):
    """dilocox-node processes against a frozen bootstrap peer: one started with --sync-deadline gives up with
    the reason (exit 1), one asked to leave while retrying exits 0 at once, and one left alone gets in and
    trains once the peer answers; none of them leaves a process behind."""
    from tests.harness.localswarm import LocalNode
    from tests.helpers import FAST, dht_process, thaw

    boot = LocalNode("boot", tmp_path / "boot", FAST + ["--run-id", "bt"]).wait_started()
    dht = dht_process(boot)
    join = FAST + ["--run-id", "bt", "--join", boot.join_maddr]
    nodes = [boot]
    try:
        dht.suspend()
        quitter = LocalNode("quitter", tmp_path / "quitter", join + ["--sync-deadline", "4"])
        leaver = LocalNode("leaver", tmp_path / "leaver", join)
        patient = LocalNode("patient", tmp_path / "patient", join)
        nodes += [quitter, leaver, patient]
        assert quitter.proc.wait(90) == 1
        assert "within --sync-deadline 4s" in quitter.log_tail() and "attempts" in quitter.log_tail()
        leaver_pids = {p.pid for p in psutil.Process(leaver.proc.pid).children(recursive=True)}
        for n in (leaver, patient):
            wait_for_text(n, "joining the DHT failed (attempt 1", 60)
        began = time.monotonic()
        assert leaver.terminate(signal.SIGTERM) == 0, leaver.log_tail()
        assert time.monotonic() - began < 10
        # torch's shared-memory daemon ends by itself, after its last client (tests/test_stop.py)
        left = [psutil.Process(p) for p in leaver_pids if psutil.pid_exists(p)]
        assert not [(p.pid, p.name(), p.status()) for p in left
                    if p.status() != "zombie" and p.name() != "torch_shm_manager"]
        dht.resume()
        patient.wait_started(120)
        patient.wait_for(lambda p: p.status().outer_step >= 1, 120, "an outer step with the swarm")
        assert "BOOTSTRAPPING" in patient.log_tail(200_000)  # the state it was in, logged on the change
    finally:
        thaw(dht)
        for n in nodes:
            n.terminate(signal.SIGTERM)


def wait_for_text(node, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in node.log_tail(200_000):
        assert node.proc.poll() is None, f"{node.name} exited {node.proc.returncode}:\n{node.log_tail()}"
        assert time.monotonic() < deadline, f"{node.name}: no {text!r} within {timeout_s}s:\n{node.log_tail()}"
        time.sleep(0.2)
