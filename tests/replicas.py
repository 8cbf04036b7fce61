"""Real ReplicaStates for unit tests: a tiny model on a short text, in a temporary directory."""

from __future__ import annotations

from dilocox.daemon.config import NodeConfig
from dilocox.daemon.replica_state import ReplicaState

from dilocox.workload import make_workload


def computed_round(tmp_path, inner_steps: int = 2, **cfg) -> ReplicaState:
    """A real ReplicaState (tiny model, fp32 codes) that has computed round 1's inner steps; ``cfg``: more
    NodeConfig fields (e.g. overlap)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "text.txt").write_text("To be, or not to be, that is the question. " * 400)
    config = NodeConfig(**{**dict(model="tiny", data=str(tmp_path / "text.txt"), inner_steps=inner_steps,
                                  compression="none", overlap="none", seq_len=16, batch_size=2), **cfg})
    st = ReplicaState(config, make_workload(config.model, config.data, 16, 2, config.eval_batches), shard_key=1)
    st.begin_round()
    for i in range(inner_steps):
        st.inner_step(*st.shard.next_batch(), i)
    return st
