"""Pytest fixtures several test modules use, registered for all of tests/ by tests/conftest.py's
``pytest_plugins``."""

from __future__ import annotations

import pytest


@pytest.fixture
def state(tmp_path):
    """A real ReplicaState that has computed round 1's inner steps (tests/replicas.py's computed_round)."""
    from tests.replicas import computed_round  # here, not above: torch and the daemon only for tests that use it

    return computed_round(tmp_path)
