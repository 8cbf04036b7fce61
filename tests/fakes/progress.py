"""A ProgressTracker (daemon/progress.py) with fixed peer records and the result digests peers report."""

from __future__ import annotations


class FakeProgress:
    """Stands in for ProgressTracker: fixed peer records and the result digests peers report."""

    peer_id = "me"

    def __init__(self, others=(), results=None):
        self._others, self.results = list(others), results

    def others(self, max_age_s: float = 1.0, since=None):
        return self._others

    def exchanged_at(self, result_step):
        return None

    def exchange_result_digests(self, result_step, digest, peers, timeout_s, inputs=None):
        self.published = digest  # our report, as ProgressTracker publishes it
        return self.reports(digest, peers, timeout_s)

    def collect_result_digests(self, result_step, peers, timeout_s):
        return self.reports(self.published, peers, timeout_s)

    def reports(self, digest, peers, timeout_s):
        """What one read of the group's result reports returns (ours included)."""
        return {"me": digest, **(self.results or {})}

    def input_conflicts(self, result_step, inputs, timeout_s):
        return {}

    def propose_union(self, result_step, digests):
        self.proposed = (result_step, list(digests))

    def wait(self, predicate, timeout_s, cancelled):
        return predicate(self._others)
