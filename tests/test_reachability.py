"""Reachability verdicts and the dial log (peers/reachability.py), with a fake clock."""

from __future__ import annotations

from dilocox.peers.reachability import FORGET_S, RETRY_S, DialLog, Reachability, describe, verdict


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_failed_dial_is_not_retried_for_a_while_and_forgotten_later():
    clock = Clock()
    log = DialLog(clock)
    assert log.worth_dialing("p") and log.undialable() == []
    log.failed("p")
    log.failed("q")
    assert not log.worth_dialing("p") and log.undialable() == ["p", "q"]
    clock.t += RETRY_S
    assert log.worth_dialing("p") and log.undialable() == ["p", "q"]  # tried again, still reported
    log.succeeded("q")
    assert log.undialable() == ["p"]
    clock.t += FORGET_S
    assert log.undialable() == []


def test_verdicts():
    reports = [("a", ["me", "x"]), ("b", []), ("c", ["me"])]
    assert verdict("me", False, reports) == (Reachability.UNREACHABLE, ["a", "c"])
    assert verdict("me", False, [("a", ["x"]), ("b", [])]) == (Reachability.REACHABLE, [])
    assert verdict("me", False, []) == (Reachability.REACHABLE, [])
    assert verdict("me", False, [("me", ["me"])]) == (Reachability.REACHABLE, [])  # our own record counts not
    assert verdict("me", True, reports) == (Reachability.CLIENT, ["a", "c"])  # a client is never "unreachable"


def test_the_unreachable_verdict_names_the_peers_and_the_remedy():
    text = describe(Reachability.UNREACHABLE, [f"peer{i:02d}xxxxxxxxxx" for i in range(5)])
    assert text.startswith("unreachable: 5 peer(s) could not dial us") and "--client-mode" in text
    assert "peer00xxxxxx…" in text and "and 2 more" in text
    assert describe(Reachability.CLIENT, []) == "client" and describe(Reachability.REACHABLE, []) == "reachable"
