"""The fault benchmark's counting rules (bench/faults.py), with fakes for the nodes: a failed trial is
counted and the run goes on; a joiner that never trains or dies on its own is a failed join; the CPU
burners it starts are real processes and are gone after stop()."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import faults


def _trial_result(**over) -> dict:
    r = {k: 1 for k in faults.KEYS}
    r.update(events=["join", "kill"], longest_stall_s=2.5, converged=True, live_nodes=3)
    r.update(over)
    return r


def test_a_trial_that_raises_is_counted_and_the_run_goes_on(capsys):
    def run_one(seed):
        if seed == 101:
            raise TimeoutError("n3: no outer step 9 within 180s")
        return _trial_result(failed_joins=seed - 100)

    results = faults.run_trials([100, 101, 102], run_one)
    assert [r["seed"] for r in results] == [100, 101, 102]
    assert results[1]["error"].startswith("TimeoutError: n3: no outer step 9")
    total = faults.totals(results)
    assert total["trials"] == 3 and total["failed_trials"] == 1
    assert total["failed_joins"] == 0 + 2  # seeds 100 and 102; the failed trial adds nothing
    assert total["rounds"] == 2 and total["events"] == 4 and total["converged"] == 2
    assert capsys.readouterr().out.count("\n") == 3  # one line per trial, printed as it ends


class _Node:
    def __init__(self, code=None, addr="127.0.0.1:1"):
        self.proc = SimpleNamespace(poll=lambda: code, returncode=code)
        self.addr = addr


def test_failed_join_rules():
    watch = faults.Watch()
    first = watch.add(_Node(code=1), joiner=False)         # an original node that died: lost, not a failed join
    trained = watch.add(_Node(), joiner=True)
    crashed = watch.add(_Node(code=1), joiner=True)        # exited non-zero on its own
    quit_early = watch.add(_Node(code=0), joiner=True)     # exited 0 without ever training
    killed = watch.add(_Node(code=-9), joiner=True)        # the harness killed it
    syncing = watch.add(_Node(), joiner=True)              # alive, never TRAINING
    watch.active |= {trained, crashed}
    watch.stopped.add(killed)
    assert watch.lost(first) and not watch.failed_join(first)
    assert not watch.failed_join(trained) and not watch.failed_join(killed)
    assert watch.failed_join(crashed) and watch.failed_join(quit_early)
    assert not watch.failed_join(syncing)  # still inside JOIN_TIMEOUT
    watch.started_at[syncing] = time.monotonic() - faults.JOIN_TIMEOUT - 1
    assert watch.failed_join(syncing)
    assert not any(watch.lost(n) for n in (trained, crashed, syncing))


def test_burner_processes_burn_and_are_gone_after_stop():
    burner = faults.Burner()
    procs = burner.start(2)
    time.sleep(0.5)
    assert all(p.poll() is None for p in procs)
    cpu = [float(Path(f"/proc/{p.pid}/stat").read_text().split()[13]) for p in procs]  # utime, clock ticks
    assert sum(cpu) > 0
    burner.stop(procs[:1])
    assert procs[0].poll() is not None and procs[1].poll() is None and burner.procs == procs[1:]
    burner.stop()
    assert procs[1].poll() is not None and burner.procs == []


def test_the_timeline_png_draws_nodes_rounds_and_events(tmp_path):
    import pytest

    from tests.harness.timeline import plot_timeline

    t0 = 1_800_000_000.0
    timeline = dict(start=t0, events=[[t0 + 10, "kill", "n2"], [t0 + 20, "join", "n3"], [t0 + 25, "burst", ""]],
                    rounds={"n0": [[t0 + 3 * i, i, 3 if i < 4 else 2, "applied"] for i in range(1, 10)],
                            "n2": [[t0 + 3, 1, 3, "applied"], [t0 + 6, 2, 3, "resynced"]],
                            "n3": [[t0 + 27, 9, 2, "applied"]]})
    png = plot_timeline(timeline, tmp_path / "trial.png", "seed 1")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="no rounds"):
        plot_timeline(dict(start=t0, events=[], rounds={}), tmp_path / "empty.png")


class FakeNet:
    """The two NetSim methods Hosts uses, for 5 hosts."""

    n_hosts = 5

    def address(self, i):
        return f"10.0.0.{i + 1}"

    def wrapper(self, i):
        return ["ip", "netns", "exec", f"h{i}"]


def test_hosts_place_nodes_keep_them_on_restart_and_run_natd_ones_as_clients(tmp_path):
    assert faults.Hosts().place("n0", tmp_path / "n0") == (faults.LOOPBACK, [])
    assert not faults.Hosts().free(nat=True)
    hosts = faults.Hosts(FakeNet(), public=3)
    placed = {name: hosts.place(name, tmp_path / name) for name in ("n0", "n1", "n2")}
    assert [w[-1] for _, w in placed.values()] == ["h0", "h1", "h2"]
    args, _ = placed["n1"]
    assert args[:2] == ["--listen", "/ip4/10.0.0.2/tcp/0"] and "--client-mode" not in args
    assert args[3] == f"unix:{(tmp_path / 'n1' / 'status.sock').resolve()}"
    with pytest.raises(RuntimeError, match="no public host left for n3"):
        hosts.place("n3", tmp_path / "n3")
    assert hosts.free(nat=True)
    args, wrapper = hosts.place("n3", tmp_path / "n3", nat=True)
    assert wrapper[-1] == "h3" and args[-1] == "--client-mode"
    assert hosts.place("n3", tmp_path / "n3") == (args, wrapper)  # a restart: same host, still a client
    hosts.place("n4", tmp_path / "n4", nat=True)
    assert not hosts.free(nat=True)


def test_a_rounds_deadline_is_its_group_wait_plus_its_downloads_or_the_flags():
    assert faults.round_deadline_s(dict(group_wait_s=22.0, download_deadline_s=5.0)) == 27.0
    assert faults.round_deadline_s(dict(group_wait_s=60.0, download_deadline_s=0.0)) == 60.0 + faults.AVERAGING_TIMEOUT
    assert faults.round_deadline_s({}) == faults.OUTER_ROUND_DEADLINE  # no figures recorded: the flags
