"""SCAFFOLD in the node: the control variates survive a checkpoint and a state download (c adopted, c_i
reset), a damaged c is refused; --inner-optimizer sgd in the node and its checkpoints; and three real nodes
with --outer-algorithm scaffold and SGD inner steps on label-sharded Fashion-MNIST agree on parameters and c
at every outer step and beat the majority-class baseline."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from dilocox.daemon.config import NodeConfig
from dilocox.daemon.replica_state import ReplicaState
from dilocox.daemon.transfer import StateTransfer

from dilocox.vision import DEBIAN_FASHION_MNIST, write_idx
from dilocox.workload import make_workload
from tests.fakes.progress import FakeProgress
from tests.fakes.records import Record
from tests.helpers import FAST, digests_by_step, start


def synthetic_fashion(root: Path, n_train: int = 300, n_test: int = 60) -> None:
    """Ten classes whose images differ by a bright column: learnable in a few steps."""
    g = np.random.default_rng(0)
    d = root / "fashion-mnist"
    d.mkdir(parents=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        y = (np.arange(n) % 10).astype(np.uint8)
        x = g.integers(0, 60, size=(n, 28, 28)).astype(np.uint8)
        x[np.arange(n), :, 2 + 2 * y] = 250
        write_idx(d / f"{split}-images-idx3-ubyte.gz", x)
        write_idx(d / f"{split}-labels-idx1-ubyte.gz", y)


def scaffold_state(tmp_path, monkeypatch, shard_key: int = 0, **settings) -> ReplicaState:
    monkeypatch.setenv("DILOCOX_DATASETS_DIR", str(tmp_path / "data"))
    cfg = NodeConfig(model="cnn", data="fashion-mnist", outer_algorithm="scaffold", compression="none",
                     partition="label-shards:2", num_clients=3, inner_steps=3, batch_size=8, eval_batches=1,
                     **settings)
    workload = make_workload(cfg.model, cfg.data, None, cfg.batch_size, cfg.eval_batches, cfg.partition,
                             cfg.num_clients, cfg.seed)
    return ReplicaState(cfg, workload, shard_key)


def one_round(st: ReplicaState) -> None:
    st.begin_round()
    for i in range(st.H):
        st.inner_step(*st.shard.next_batch(), i)
    delta = st.pseudo_gradient()
    st.end_round_control(delta, 0)
    st.apply_outer(delta, st.round)
    st.round += 1
    st.rebase_and_begin()


def test_control_variates_survive_checkpoint_and_download(tmp_path, monkeypatch):
    synthetic_fashion(tmp_path / "data")
    st = scaffold_state(tmp_path, monkeypatch)
    one_round(st)
    one_round(st)
    assert any(float(c.abs().sum()) > 0 for c in st.control.c)
    assert st.start_digest().endswith("/" + st.control.digest())  # c is part of what a round starts from
    # checkpoint and restart
    fresh = scaffold_state(tmp_path, monkeypatch)
    fresh.restore(st.checkpoint_state())
    assert fresh.control.digest() == st.control.digest()
    assert all(torch.equal(a, b) for a, b in zip(fresh.control.c_i, st.control.c_i))
    # download: a joiner adopts the swarm's c, and its own c_i starts from zero
    st.snapshot()
    donor = StateTransfer(st.cfg, st, FakeProgress(), lambda: ("TRAINING", 1), lambda: False)
    meta, tensors = donor.serve()
    joiner = scaffold_state(tmp_path, monkeypatch, shard_key=1)
    vouching = [Record("donor", st.outer_step, st.digest)]
    got = StateTransfer(joiner.cfg, joiner, FakeProgress(vouching), lambda: ("SYNCING", 0), lambda: False).validate(
        dict(meta), [t.clone() for t in tensors])
    joiner.adopt(got.theta, got.momentum, got.meta.compression_rank, got.compression_shared, got.meta.outer_step,
                 got.meta.digest, st.round, False, got.control)
    assert joiner.control.digest() == st.control.digest() and joiner.start_digest() == st.start_digest()
    assert all(float(c.abs().sum()) == 0 for c in joiner.control.c_i)
    # a c that is not the donor's is refused
    n = len(st.outer.global_params)
    damaged = [t.clone() for t in tensors]
    damaged[2 * n].add_(1.0)
    with pytest.raises(ValueError, match="control variate does not match"):
        StateTransfer(joiner.cfg, joiner, FakeProgress(vouching), lambda: ("SYNCING", 0),
                      lambda: False).validate(dict(meta), damaged)
    # a DiLoCo checkpoint holds no control variates: refused, nothing half-loaded
    diloco = st.checkpoint_state()
    diloco["control"] = None
    before = fresh.control.digest()
    with pytest.raises(ValueError, match="no SCAFFOLD control variates"):
        fresh.restore(diloco)
    assert fresh.control.digest() == before


def test_sgd_inner_optimizer_in_the_node_and_its_checkpoints(tmp_path, monkeypatch):
    synthetic_fashion(tmp_path / "data")
    st = scaffold_state(tmp_path, monkeypatch, inner_optimizer="sgd", inner_momentum=0.5, inner_lr=0.05)
    opt = st.inner.inner_optimizer
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.5
    assert st.memory().inner_optimizer_bytes == st.memory().params_bytes  # one momentum buffer
    one_round(st)
    one_round(st)
    assert st.memory().inner_optimizer_bytes == st.memory().params_bytes
    saved = st.checkpoint_state()
    assert saved["inner_optimizer_name"] == "sgd"
    # the flags win over the hyper-parameters stored in the file; the momentum buffers come back
    other = scaffold_state(tmp_path, monkeypatch, inner_optimizer="sgd", inner_momentum=0.8, inner_lr=0.05)
    other.restore(saved)
    assert other.inner.inner_optimizer.param_groups[0]["momentum"] == 0.8
    buffers = [s["momentum_buffer"] for s in other.inner.inner_optimizer.state.values()]
    assert buffers and all(float(b.abs().sum()) > 0 for b in buffers)
    # an AdamW node refuses SGD state (and the reverse), naming both; nothing is half-loaded
    adamw = scaffold_state(tmp_path, monkeypatch)
    before = adamw.digest
    with pytest.raises(ValueError, match="inner optimizer state is sgd's; this node runs --inner-optimizer adamw"):
        adamw.restore(saved)
    assert adamw.digest == before and not adamw.inner.inner_optimizer.state
    old = adamw.checkpoint_state()
    del old["inner_optimizer_name"]  # written before --inner-optimizer existed: AdamW state
    with pytest.raises(ValueError, match="inner optimizer state is adamw's"):
        other.restore(old)


@pytest.mark.integration
@pytest.mark.skipif(not DEBIAN_FASHION_MNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed "
                                                               "(make install and .ci/run install it)")
def test_three_scaffold_nodes_on_label_shards(tmp_path):
    args = FAST + ["--run-id", "scaffold", "--model", "cnn", "--data", "fashion-mnist", "--outer-algorithm",
                   "scaffold", "--compression", "none", "--partition", "label-shards:2", "--num-clients", "3",
                   "--batch-size", "32", "--min-replicas", "3", "--eval-batches", "2",
                   "--inner-optimizer", "sgd", "--inner-lr", "0.02"]  # SCAFFOLD's documented local optimizer
    first = start(tmp_path, "n0", args + ["--data-seed", "0"])
    nodes = [first] + [start(tmp_path, f"n{i}", args + ["--data-seed", str(i), "--join", first.join_maddr])
                       for i in (1, 2)]
    try:
        for n in nodes:
            n.wait_for(lambda p: len(p.metrics()) >= 5, 240, "five recorded rounds")
        assert all(len(d) == 1 for d in digests_by_step(nodes).values())
        controls: dict[int, set] = {}
        for n in nodes:
            for r in n.metrics():
                controls.setdefault(r["outer_step"], set()).add(r["control_digest"])
        assert all(len(c) == 1 for c in controls.values()), controls  # the same c everywhere
        assert len({c for cs in controls.values() for c in cs}) >= 4  # and it moves
        rows = nodes[0].metrics()
        assert sum(r["group_size"] == 3 for r in rows) >= 4, rows  # a round may fail under load: applied alone
        # each client holds 2 of the 10 classes; the majority-class baseline is 10% on the balanced test set
        assert rows[-1]["val_accuracy"] > 0.2, [r["val_accuracy"] for r in rows]
        assert nodes[0].status().outer_algorithm == "scaffold"
        assert "inner=sgd(lr=0.02," in nodes[0].status().swarm_settings
    finally:
        for n in nodes:
            n.terminate(signal.SIGKILL)


def test_every_round_steps_with_the_correction_its_outer_step_left(tmp_path, monkeypatch):
    """As the node drives rounds: ``begin_round`` once at start, then ``rebase_and_begin`` after each outer step.
    Each round's inner steps must correct with c - c_i as that step left them (SCAFFOLD, Algorithm 1 line 10), not
    with the zero correction of the first round."""
    from dilocox.daemon import replica_state

    synthetic_fashion(tmp_path / "data")
    st = scaffold_state(tmp_path, monkeypatch)
    used: list[list[torch.Tensor]] = []
    real = replica_state.apply_correction_step
    monkeypatch.setattr(replica_state, "apply_correction_step",
                        lambda params, correction, lr: (used.append([c.clone() for c in correction]),
                                                        real(params, correction, lr)))
    st.begin_round()
    expected = []
    for _ in range(3):
        expected.append(st.control.correction())
        for i in range(st.H):
            st.inner_step(*st.shard.next_batch(), i)
        delta = st.pseudo_gradient()
        st.end_round_control(delta, 0)
        st.apply_outer([d * 0.5 for d in delta], st.round)  # the mean with a client that did not move: c != c_i
        st.round += 1
        st.rebase_and_begin()
    assert len(used) == 3 * st.H
    assert all(float(c.abs().sum()) == 0 for c in expected[0])  # c = c_i = 0 before the first outer step
    for r in (1, 2):
        assert sum(float(c.abs().sum()) for c in expected[r]) > 0
        for step in used[r * st.H:(r + 1) * st.H]:
            assert all(torch.equal(a, b) for a, b in zip(step, expected[r])), f"round {r + 1}"
