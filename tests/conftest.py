"""Hypothesis profiles for every fuzzer (tests/test_fuzz.py, test_sparse.py, test_admission.py): ``ci`` (the
default, 100 cases per target in make test) and ``long`` (2,000 per target: make bench-fuzz), chosen with
DILOCOX_FUZZ_PROFILE."""

import os

from hypothesis import HealthCheck, settings

# The test process holds gRPC clients and forks nodes with a preexec_fn (tests/harness/localswarm.py): gRPC's
# pre-fork handler can wait forever for its own threads (seen once: make test-swarm hung in fork for 17 min). The
# children exec at once and the daemon turns fork support off too (daemon/cli.py).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

pytest_plugins = ["tests.fixtures"]  # fixtures several test modules share (state)

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=100, **_common)
settings.register_profile("long", max_examples=2000, **_common)
settings.load_profile(os.environ.get("DILOCOX_FUZZ_PROFILE", "ci"))
