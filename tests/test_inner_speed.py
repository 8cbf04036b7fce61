"""The inner loop at a GPU's pace, checked on CPU: the loss stays a device tensor (no host read per micro-batch)
and equals the old float bit for bit, the node reads losses every 10 steps, --precision auto is fp32 on CPU,
AdamW is fused only over CUDA parameters, and --compile reaches the decoder layers."""

from __future__ import annotations

import argparse
import copy
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dilocox.assignment import assigned_shard_key
from dilocox.data import Corpus, ReplicaShard
from dilocox.diloco import (
    InnerConfig,
    InnerLoop,
    build_inner_optimizer,
    host_losses,
    keep_fused,
    resolve_precision,
)
from dilocox.model import ModelSpec
from dilocox.stages import build_stage

TEXT = "To be, or not to be, that is the question. " * 400


def _loop(micro: int = 0, **config) -> InnerLoop:
    return InnerLoop(build_stage(ModelSpec.resolve("tiny"), 0),
                     InnerConfig(lr=3e-3, warmup_steps=2, total_steps=100, micro_batch_size=micro, **config))


def _batches(tmp_path, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    (tmp_path / "text.txt").write_text(TEXT)
    shard = ReplicaShard(Corpus.from_spec(str(tmp_path / "text.txt"), 32).train, 32, 8, seed=0, shard_key=1)
    return [shard.next_batch() for _ in range(n)]


def _old_inner_step(loop: InnerLoop, inputs, targets, global_step: int) -> float:
    """InnerLoop.inner_step as it was: the loss read back with float() after every micro-batch."""
    lr = loop.config.lr_at(global_step)
    for group in loop.inner_optimizer.param_groups:
        group["lr"] = lr
    loop.model.train()
    n = inputs.shape[0]
    m = loop.config.micro_batch_size or n
    loss_sum = 0.0
    for a in range(0, n, m):
        loss = loop.loss_fn(loop.model, inputs[a:a + m], targets[a:a + m])
        share = min(m, n - a) / n
        (loss * share).backward() if share != 1 else loss.backward()
        loss_sum += float(loss.detach()) * share
    torch.nn.utils.clip_grad_norm_(loop.params, loop.config.max_grad_norm)
    loop.inner_optimizer.step()
    loop.inner_optimizer.zero_grad(set_to_none=True)
    return loss_sum


@pytest.mark.parametrize("micro", [0, 3])  # one micro-batch; 3 + 3 + 2 sequences
def test_the_loss_stays_a_tensor_and_equals_the_old_float_bit_for_bit(tmp_path, monkeypatch, micro):
    new, old = _loop(micro), _loop(micro)
    batches = _batches(tmp_path, 4)
    reads = []
    real_float = torch.Tensor.__float__
    for step, (x, y) in enumerate(batches):
        want = _old_inner_step(old, x, y, step)
        monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(t) or real_float(t))
        got = new.inner_step(x, y, step)
        monkeypatch.undo()
        assert not reads  # no host read of the loss inside the step
        assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.device == torch.device("cpu")
        assert float(got) == want, (step, float(got), want)
    assert all(torch.equal(p, q) for p, q in zip(new.params, old.params))


def test_host_losses_reads_tensors_and_floats_in_order():
    values = [torch.tensor(1.5, dtype=torch.float64), 2.25, torch.tensor(0.1, dtype=torch.float32), 3]
    got = host_losses(values)
    assert got == [1.5, 2.25, float(torch.tensor(0.1, dtype=torch.float32)), 3.0]
    assert all(type(v) is float for v in got)
    assert host_losses([0.5, 1]) == [0.5, 1.0] and host_losses([]) == []


def test_precision_auto_is_fp32_on_cpu_and_other_values_are_refused():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert (resolve_precision("fp32", "cpu"), resolve_precision("bf16", "cpu")) == ("fp32", "bf16")
    if not torch.cuda.is_available():
        assert resolve_precision("auto", "cuda") == "fp32"
    with pytest.raises(ValueError, match="fp16"):
        resolve_precision("fp16", "cpu")
    assert _loop(precision="auto").config.precision == "fp32"  # resolved when the loop is built


def test_the_node_config_defaults_to_auto_and_resolves_it_per_device(tmp_path):
    from dilocox.daemon.config import NodeConfig
    from dilocox.daemon.replica_state import ReplicaState

    from dilocox.workload import make_workload

    (tmp_path / "text.txt").write_text(TEXT)
    cfg = NodeConfig(model="tiny", data=str(tmp_path / "text.txt"), inner_steps=2, compression="none",
                     overlap="none", seq_len=16, batch_size=2)
    assert cfg.precision == "auto" and NodeConfig(stage="1/2").precision == "auto"  # stages take bf16 too
    st = ReplicaState(cfg, make_workload(cfg.model, cfg.data, 16, 2, cfg.eval_batches), shard_key=1)
    assert st.inner.config.precision == "fp32"
    st.begin_round()
    assert isinstance(st.inner_step(*st.shard.next_batch(), 0), torch.Tensor)


def test_adamw_is_fused_only_over_cuda_parameters():
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    adamw = build_inner_optimizer(params, InnerConfig())
    assert isinstance(adamw, torch.optim.AdamW)
    assert not adamw.defaults["fused"] and adamw.defaults["foreach"] is None  # torch chooses (foreach)
    assert not adamw._optimizer_load_state_dict_post_hooks
    sgd = build_inner_optimizer(params, InnerConfig(optimizer="sgd", momentum=0.9))
    assert not sgd.defaults.get("fused")


def test_a_fused_optimizer_stays_fused_when_it_loads_an_unfused_state():
    """A checkpoint written by an unfused AdamW (a CPU node) loaded into a fused one (a GPU node): torch keeps the
    file's fused=False and its host-side steps; keep_fused restores the kernel and puts the steps beside the
    parameters (fused AdamW has a CPU kernel too, so the hook is exercised here)."""
    torch.manual_seed(0)
    start = torch.randn(8, 8)
    grads = [torch.randn(8, 8) for _ in range(3)]

    def run(optimizer, p, steps):
        for g in steps:
            p.grad = g.clone()
            optimizer.step()

    p_plain = torch.nn.Parameter(start.clone())
    plain = torch.optim.AdamW([p_plain], lr=1e-2)
    run(plain, p_plain, grads[:2])
    p_fused = torch.nn.Parameter(p_plain.detach().clone())
    fused = torch.optim.AdamW([p_fused], lr=1e-2, fused=True)
    fused.register_load_state_dict_post_hook(keep_fused)
    fused.load_state_dict(copy.deepcopy(plain.state_dict()))  # as from a file: no tensors shared
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is None
    step = fused.state[p_fused]["step"]
    assert step.dtype == torch.float32 and step.device == p_fused.device and float(step) == 2
    run(fused, p_fused, grads[2:])
    run(plain, p_plain, grads[2:])
    assert torch.allclose(p_fused, p_plain, atol=1e-6)


def test_the_compile_flag_reaches_the_decoder_layers(tmp_path):
    from dilocox.daemon.config import add_flags, load_config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    parser = argparse.ArgumentParser()
    add_flags(parser)
    assert load_config(vars(parser.parse_args(["--compile"])), {}).compile is True
    assert load_config({}, {}).compile is False
    loop = _loop(compile=True)  # nn.Module.compile wraps now and compiles at the first forward
    layers = [m for m in loop.model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert len(layers) == 2 and all(m._compiled_call_impl is not None for m in layers)
    assert loop.model._compiled_call_impl is None  # the layers, not the whole stage
    assert _loop().model.layers[0]._compiled_call_impl is None
    names = [n for n, _ in loop.model.named_parameters()]
    assert names == [n for n, _ in _loop().model.named_parameters()]  # checkpoints keep their keys


@pytest.mark.integration  # Inductor compiles C++ kernels with the system compiler (subprocesses); ~35 s on 2 cores
def test_compiled_layers_train_like_eager_ones(tmp_path):
    eager, compiled = _loop(), _loop(compile=True)
    losses = [(float(eager.inner_step(x, y, step)), float(compiled.inner_step(x, y, step)))
              for step, (x, y) in enumerate(_batches(tmp_path, 3))]
    assert all(abs(a - b) < 1e-4 for a, b in losses), losses
    assert max(float((p - q).detach().abs().max()) for p, q in zip(eager.params, compiled.params)) < 1e-4


class _Rounds:
    def finish_early(self, steps: int) -> bool:
        return False

    def early_wanted(self) -> bool:
        return False


class _Node:
    """What Node._inner_steps reads of a whole-model node outside a swarm."""

    def __init__(self, state, board, H: int):
        self.state, self.board, self.H, self.cfg = state, board, H, state.cfg
        self.swarm = SimpleNamespace(peer_id="QmInnerSpeed")
        self.staged, self.audits, self.attack, self.ahead, self.pipeline = False, None, None, None, None
        self.leave_requested, self.rounds = threading.Event(), _Rounds()

    def _set_state(self, state, **changes) -> None:
        self.board.update(state=state, **changes)

    def _published_step(self) -> None:
        pass


def test_the_node_reads_losses_every_ten_steps_and_at_the_rounds_end(tmp_path):
    from dilocox.daemon.config import NodeConfig
    from dilocox.daemon.node import Node
    from dilocox.daemon.replica_state import ReplicaState
    from dilocox.daemon.status import StatusBoard

    from dilocox.workload import make_workload

    (tmp_path / "text.txt").write_text(TEXT)
    H = 23
    cfg = NodeConfig(model="tiny", data=str(tmp_path / "text.txt"), inner_steps=H, compression="none",
                     overlap="none", seq_len=16, batch_size=2)
    st = ReplicaState(cfg, make_workload(cfg.model, cfg.data, 16, 2, cfg.eval_batches), shard_key=1)
    st.begin_round()
    board = StatusBoard()
    seen = []
    update = board.update
    board.update = lambda **changes: (seen.append(changes), update(**changes))[1]
    node = _Node(st, board, H)
    started = time.monotonic()
    losses, compute_s, skip = Node._inner_steps(node, 0)
    assert skip == 0 and 0 < compute_s <= time.monotonic() - started
    assert len(losses) == H and all(type(v) is float for v in losses)
    assert st.shard.position == H  # batches consumed, none drawn ahead left counted
    # the swarm assigned the round's batches (text data, no --data-seed: dilocox/assignment.py)
    assert cfg.assigned_data and st.shard.shard_key == assigned_shard_key(cfg.run_id, "QmInnerSpeed", st.round)
    at = [c["inner_step"] for c in seen if "loss" in c]
    assert at == [10, 20, H]
    assert [c["inner_step"] for c in seen if "inner_step" in c][-H:] == list(range(1, H + 1))
    s = board.snapshot()
    assert s.initial_loss == losses[0] and s.loss == pytest.approx(sum(losses[-10:]) / 10)
    assert s.tokens_total == H * 2 * 16 and s.tokens_per_second > 0
