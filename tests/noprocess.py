"""A pytest plugin for ``make check``: a test that starts a process (``os.fork``, ``subprocess``,
``multiprocessing``, a hivemind DHT and its p2pd) fails at once, naming what it started.

``make check`` is the edit loop: the rules, codecs and fuzzers, in-process only. A test that needs a process
belongs to ``make test`` and says so with ``@pytest.mark.integration`` (or ``swarm``), which ``make check``
deselects. Loaded with ``-p tests.noprocess`` (Makefile ``check``); the guard replaces the fork and exec
entry points that subprocess, multiprocessing and os share (``_posixsubprocess.fork_exec``, ``os.fork``,
``os.posix_spawn``)."""

from __future__ import annotations

import _posixsubprocess
import os

import pytest


class ProcessStarted(RuntimeError):
    """A test under ``make check`` started a process."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise ProcessStarted(f"make check runs no processes, and this test started one ({what}): mark it "
                             f"@pytest.mark.integration so that make test runs it")
    return refuse


@pytest.fixture(scope="session", autouse=True)
def _no_process():
    """Session-wide, so module- and session-scoped fixtures (a shared DHT, a p2pd) are guarded too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_posixsubprocess, "fork_exec", _refuse("fork_exec: subprocess or multiprocessing spawn"))
        patch.setattr(os, "fork", _refuse("os.fork"))
        patch.setattr(os, "posix_spawn", _refuse("os.posix_spawn"))
        patch.setattr(os, "posix_spawnp", _refuse("os.posix_spawnp"))
        yield
