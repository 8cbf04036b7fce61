"""Hypothesis profiles for every fuzzer (tests/test_fuzz.py, test_sparse.py, test_admission.py): ``ci`` (the
default, 100 cases per target in make test) and ``long`` (2,000 per target: make bench-fuzz), chosen with
DILOCOX_FUZZ_PROFILE."""

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.fixtures"]  # fixtures several test modules share (state)

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=100, **_common)
settings.register_profile("long", max_examples=2000, **_common)
settings.load_profile(os.environ.get("DILOCOX_FUZZ_PROFILE", "ci"))
