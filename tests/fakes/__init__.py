"""Fakes the unit tests share, one module per thing they stand in for: member records (records.py), the
ProgressTracker (progress.py), a StateTransfer over them (transfer.py), a simulated swarm for catch-up and
joins (catchup.py) and a node behind the gRPC status server (node.py). Not test modules: test modules import
these, never each other (tests/test_test_layout.py)."""
