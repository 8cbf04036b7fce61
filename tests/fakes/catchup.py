"""A simulated swarm for catch-up (dilocox/catchup.py) and the join rule it enables (daemon/transfer.py): real
ReplicaStates, a donor going through rounds of H inner steps, downloads that take the swarm's time and a server
of the updates the donor applied."""

from __future__ import annotations

import dataclasses

import torch
from dilocox.daemon.config import NodeConfig
from dilocox.daemon.replica_state import ReplicaState
from dilocox.daemon.transfer import StateTransfer

from dilocox.catchup import encode
from dilocox.workload import make_workload

H = 4


def make_state(tmp_path, **overrides) -> ReplicaState:
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 400)
    # compression none by default: Nesterov momentum, which replay must carry
    cfg = NodeConfig(**dict(dict(model="tiny", data=str(text), inner_steps=H, compression="none", overlap="none",
                                 seq_len=16, batch_size=2), **overrides))
    st = ReplicaState(cfg, make_workload(cfg.model, cfg.data, 16, 2, cfg.eval_batches), shard_key=1)
    st.snapshot()
    return st


def aggregate(st: ReplicaState, seed: int, density: float = 0.05) -> list[torch.Tensor]:
    """A sparse-looking averaged pseudo-gradient (most values zero, as sparse rounds give)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.where(torch.rand(p.shape, generator=g) < density, torch.randn(p.shape, generator=g) * 1e-2, 0.0)
            for p in st.outer.global_params]


@dataclasses.dataclass
class Record:
    """The MemberRecord fields the join rule reads."""

    peer_id: str
    state: str
    outer_step: int
    round: int
    inner_step: int
    global_params_digest: str
    client_mode: bool = False
    tokens_per_second: float = 0.0


class SimSwarm:
    """A donor replica going through rounds: H ticks TRAINING (inner steps 0..H-1), one tick AVERAGING, then
    round r's update is applied (outer step r) and round r + 1 begins. Keeps the encoded updates it applied."""

    def __init__(self, donor: ReplicaState, outsized: frozenset = frozenset()):
        """``outsized``: the outer steps whose rounds had an outsized contribution (SCAFFOLD's quiet restart)."""
        self.donor, self.tick, self.updates, self.outsized = donor, 0, {}, outsized
        donor.on_applied = lambda u: self.updates.__setitem__(u.outer_step, encode(u))

    def record(self) -> Record:
        d = self.donor
        return Record("donor", "TRAINING" if self.tick < H else "AVERAGING", d.outer_step, d.round,
                      min(self.tick, H), d.digest)

    def advance(self, ticks: int) -> None:
        for _ in range(ticks):
            self.tick += 1
            if self.tick > H:
                r = self.donor.round
                self.donor.apply_outer(aggregate(self.donor, r), r, group_size=2, outsized=r in self.outsized)
                self.donor.round, self.tick = r + 1, 0


class SimProgress:
    peer_id = "joiner"

    def __init__(self, swarm: SimSwarm):
        self.swarm = swarm

    def others(self, max_age_s: float = 1.0):
        return [self.swarm.record()]

    def wait(self, predicate, timeout_s, cancelled):
        for _ in range(100 * (H + 1)):  # simulated time passes while we wait
            if predicate(self.others()):
                return True
            self.swarm.advance(1)
        return False


class SlowDownloads:
    """hivemind's state download, taking ``ticks`` of the swarm's time: the donor's snapshot of when it began."""

    def __init__(self, swarm: SimSwarm, ticks: int):
        self.swarm, self.ticks, self.calls = swarm, ticks, 0

    def download_state(self, timeout_s):
        self.calls += 1
        rec = self.swarm.record()
        meta, tensors = self.swarm.donor.served()
        meta = dict(meta, donor_state=rec.state, donor_inner_step=rec.inner_step, donor_round=rec.round,
                    donor_peer_id="donor")
        tensors = [t.clone() for t in tensors]
        self.swarm.advance(self.ticks)
        return meta, tensors

    def set_priority(self, value):
        pass


class UpdateServer:
    """ContributionServer.fetch over the donor's kept updates; ``tamper(step, payload)`` changes what it serves."""

    def __init__(self, swarm: SimSwarm, tamper=None):
        self.swarm, self.tamper, self.fetched = swarm, tamper, []

    def fetch(self, wanted, key, timeout_s, relays=(), no_direct=frozenset()):
        (peer, (_, max_size)), = wanted.items()
        step = int(key.split("/")[1])
        payload = self.swarm.updates.get(step)
        if payload is None:
            return {}, {peer: f"no contribution under key {key!r}"}
        if self.tamper is not None:
            payload = self.tamper(step, payload)
        assert len(payload) <= max_size
        self.fetched.append(step)
        return {peer: payload}, {}


def joiner_for(tmp_path, donor, swarm, download_ticks, catch_up=True, **overrides):
    joiner = make_state(tmp_path, **overrides)
    t = StateTransfer(joiner.cfg, joiner, SimProgress(swarm), lambda: ("SYNCING", 0), lambda: False)
    t.averager = SlowDownloads(swarm, download_ticks)
    t.updates = UpdateServer(swarm) if catch_up else None
    return joiner, t


