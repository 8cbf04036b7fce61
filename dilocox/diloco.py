"""DiLoCo (Douillard et al., arXiv 2311.08105): inner loop, pseudo-gradient, outer Nesterov step.

For outer step t (DiLoCo, Algorithm 1; docs/algorithms.md, "DiLoCo"):
  1. x_r <- theta_{t-1}; H inner AdamW (or SGD) steps on replica r's data;
  2. pseudo_gradient delta_r = theta_{t-1} - x_r;
  3. Delta_t = weighted mean over replicas of delta_r (done by peers/, not here);
  4. theta_t = SGD(nesterov, outer_lr, outer_momentum) step on theta_{t-1} with gradient Delta_t.

The global parameters theta and the outer optimizer's momentum live on the CPU in fp32.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from dilocox.model import causal_lm_loss

INNER_OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class InnerConfig:
    """The inner_optimizer with linear warm-up then cosine decay to min_lr_ratio * lr, driven by the global step.

    optimizer: ``adamw`` (DiLoCo's; betas, decoupled weight_decay) or ``sgd`` (``torch.optim.SGD`` with
    ``momentum`` and coupled weight_decay, g + wd x; SCAFFOLD's and BadSFL's local optimizer,
    arXiv 1910.06378 and 2411.16167). momentum is read by sgd only, betas by adamw only."""

    lr: float = 4e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"
    momentum: float = 0.0
    warmup_steps: int = 100
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    # bf16: forward and backward under autocast, fp32 master weights and AdamW state; auto: resolve_precision's
    precision: str = "fp32"
    micro_batch_size: int = 0  # > 0: a step accumulates gradients over micro-batches of this many sequences
    compile: bool = False  # torch.compile each decoder layer (compile_layers) when the InnerLoop is built

    def lr_at(self, global_step: int) -> float:
        if global_step < self.warmup_steps:
            return self.lr * (global_step + 1) / self.warmup_steps
        progress = min(1.0, (global_step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


def training_device(spec: str) -> str:
    """``auto`` -> ``cuda`` where torch sees a GPU, else ``cpu``; ``cpu`` and ``cuda[:N]`` as given. Raises
    ValueError for a CUDA device this process cannot see (named, with how many it sees)."""
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        index = int(spec.split(":")[1]) if ":" in spec else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec}: this process sees {torch.cuda.device_count()} CUDA device(s)")
    return spec


def resolve_precision(spec: str, device: str) -> str:
    """``fp32`` or ``bf16`` for ``--precision`` ``spec`` on the training ``device`` (as ``training_device`` gives
    it): ``auto`` is bf16 on a CUDA device with native bf16 (compute capability 8.0 and later,
    ``torch.cuda.is_bf16_supported(including_emulation=False)``), else fp32 (CPU, older GPUs: emulated bf16
    is slower than fp32); ``fp32`` and ``bf16`` as given. Raises ValueError for another value."""
    if spec not in PRECISIONS:
        raise ValueError(f"precision {spec!r}: expected one of {', '.join(PRECISIONS)}")
    if spec != "auto":
        return spec
    where = torch.device(device)
    if where.type != "cuda" or not torch.cuda.is_available():
        return "fp32"
    with torch.cuda.device(where):  # is_bf16_supported asks about the current device
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"


def allow_tf32() -> None:
    """Let fp32 matmuls and convolutions on CUDA use TF32 tensor cores (10-bit mantissa inputs, fp32
    accumulation; what autocast leaves in fp32 and every fp32 run). Process-wide; CPU matmuls are untouched:
    the legacy flags, unlike ``torch.set_float32_matmul_precision``, leave oneDNN alone, so theta's host-side
    arithmetic stays bit-identical across replicas (PyTorch notes, "TensorFloat-32 (TF32) on Ampere")."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def compile_layers(model: torch.nn.Module) -> int:
    """``torch.compile`` (``dynamic=False``) every ``LlamaDecoderLayer`` of ``model`` in place, or the whole
    model where it has none (an image model); returns how many modules were compiled. ``nn.Module.compile``
    keeps parameters, their names and ``state_dict`` as they were; the compile itself happens at the first
    forward (tens of seconds, and a recompile for each new input shape, e.g. a shorter last micro-batch)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # heavy: only when compiling

    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)] or [model]
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)


def host_losses(values: Sequence[Union[float, torch.Tensor]]) -> list[float]:
    """``values`` (Python floats and 0-dim tensors, e.g. ``inner_step``'s losses) as floats, with one
    device-to-host copy for all the tensors among them (one CUDA sync, not one per value). Tensors must share
    a device; floats pass through unchanged."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def build_inner_optimizer(params: list[torch.Tensor], config: InnerConfig) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` or ``torch.optim.SGD`` over ``params`` as ``config.optimizer`` names; the lr set here
    is replaced at every step by the schedule (``InnerConfig.lr_at``). AdamW over parameters that are all on
    CUDA is the fused kernel (``fused=True``: one launch for all tensors, no host sync); elsewhere torch picks
    (foreach where it can). Raises ValueError for another name or a momentum outside [0, 1)."""
    if config.optimizer == "adamw":
        fused = bool(params) and all(p.is_cuda for p in params)
        optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
                                      fused=fused or None)
        if fused:
            optimizer.register_load_state_dict_post_hook(keep_fused)
        return optimizer
    if config.optimizer == "sgd":
        if not 0.0 <= config.momentum < 1.0:
            raise ValueError(f"inner SGD momentum must be in [0, 1), got {config.momentum}")
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    raise ValueError(f"inner optimizer {config.optimizer!r}: expected one of {', '.join(INNER_OPTIMIZERS)}")


def keep_fused(optimizer: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post-hook of a fused optimizer: a state written by an unfused one (a CPU node's
    checkpoint) brings its groups' ``fused=False`` and keeps each ``step`` on the host (torch moves it to the
    parameter's device only when the saved group was fused or capturable, optim/optimizer.py
    ``_process_value_according_to_param_policy``), which the fused kernel cannot read. The device decides
    the kernel, not the file: fused again, steps as fp32 on the parameters' device."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, None
        for p in group["params"]:
            step = optimizer.state[p].get("step") if p in optimizer.state else None
            if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)


class InnerLoop:
    """One replica's model and inner_optimizer (AdamW or SGD; its state persists across rounds, as in DiLoCo)."""

    def __init__(self, model: torch.nn.Module, config: InnerConfig, device: str = "cpu",
                 loss_fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = causal_lm_loss):
        """``loss_fn(model, inputs, targets)``: the mean training loss (default: next-byte cross-entropy).
        On a CUDA device, fp32 matmuls may use TF32 (``allow_tf32``); ``config.precision`` ``auto`` is resolved
        here (``resolve_precision``), and ``config.compile`` compiles the decoder layers (``compile_layers``).
        Raises ValueError for an unknown precision."""
        if config.precision == "auto" or config.precision not in PRECISIONS:
            config = dataclasses.replace(config, precision=resolve_precision(config.precision, device))
        self.model = model.to(device)
        self.device = device
        self.config = config
        self.loss_fn = loss_fn
        if torch.device(device).type == "cuda":
            allow_tf32()
        if config.compile:
            compile_layers(self.model)
        self.params = [p for p in self.model.parameters()]
        self.inner_optimizer = build_inner_optimizer(self.params, config)

    stop_requested = False  # a whole model has no other stages to hear a stop from (see PipelinedInnerLoop)

    def inner_step(self, inputs: torch.Tensor, targets: torch.Tensor, global_step: int, stop: bool = False,
                   after_step: Optional[Callable[[float], None]] = None) -> torch.Tensor:
        """One inner_optimizer step at the learning rate of ``global_step``; returns the loss (nats/token).

        ``inputs``, ``targets``: [batch, ...] on any device; copied to the training device once, without
        blocking (asynchronous from pinned memory, dilocox/prefetch.py). The loss is a 0-dim fp64 tensor on
        the training device, never read back here, so a step queues its GPU work without waiting for it:
        ``float()`` it (a host sync on CUDA) or read many with ``host_losses``. Its value is the old float's
        bit for bit: each micro-batch's fp32 loss widened to fp64 and summed in order, times its share.
        ``stop`` matters only to a pipelined stage, which tells its other stages. ``after_step(lr)`` runs
        right after the optimizer step (SCAFFOLD's drift correction, dilocox/scaffold.py)."""
        lr = self.config.lr_at(global_step)
        for group in self.inner_optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        n = inputs.shape[0]
        m = self.config.micro_batch_size or n
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        loss_sum: Optional[torch.Tensor] = None
        for a in range(0, n, m):  # gradient accumulation: each micro-batch's mean loss weighted by its share
            with self.autocast():
                loss = self.loss_fn(self.model, inputs[a:a + m], targets[a:a + m])
            share = min(m, n - a) / n
            (loss * share).backward() if share != 1 else loss.backward()
            part = loss.detach().to(torch.float64) * share
            loss_sum = part if loss_sum is None else loss_sum + part
        torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.inner_optimizer.step()
        if after_step is not None:
            with torch.no_grad():
                after_step(lr)
        self.inner_optimizer.zero_grad(set_to_none=True)
        return loss_sum

    def autocast(self):
        """bf16 autocast on the training device where ``precision`` is bf16 (torch.autocast: matmuls and
        convolutions in bf16, reductions and the loss in fp32; the parameters stay fp32); else a no-op."""
        return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16,
                              enabled=self.config.precision == "bf16")

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss over (inputs, targets) batches, without touching optimizer state."""
        self.model.eval()
        with self.autocast():
            losses = [float(self.loss_fn(self.model, x.to(self.device), y.to(self.device))) for x, y in batches]
        return sum(losses) / len(losses)

    @torch.no_grad()
    def load_params(self, tensors: list[torch.Tensor]) -> None:
        for p, t in zip(self.params, tensors):
            p.copy_(t)


class OuterOptimizer:
    """Global parameters theta (CPU fp32) and the outer SGD-Nesterov optimizer over them.

    Source: DiLoCo, Algorithm 1 (outer_lr 0.7, outer_momentum 0.9, nesterov). The pseudo-gradient
    is used as the gradient of theta, so ``torch.optim.SGD`` gives exactly the DiLoCo outer step.
    """

    def __init__(self, params: list[torch.Tensor], outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, outer_lr_final: Optional[float] = None, ramp_steps: int = 1):
        """``outer_lr_final``: with it, the outer learning rate of outer step t ramps linearly from
        ``outer_lr`` (t = 1) to ``outer_lr_final`` (t = ``ramp_steps``, the inner cosine schedule's
        length in rounds) and stays there (``lr_at``; ours, measured in docs/algorithms.md). Raises
        ValueError for a learning rate <= 0 or ``ramp_steps`` < 1."""
        if not outer_lr > 0 or (outer_lr_final is not None and not outer_lr_final > 0):
            raise ValueError(f"outer learning rates must be > 0; got {outer_lr}, {outer_lr_final}")
        if ramp_steps < 1:
            raise ValueError(f"ramp_steps must be >= 1; got {ramp_steps}")
        self.outer_lr, self.ramp_steps = outer_lr, ramp_steps
        self.outer_lr_final = outer_lr if outer_lr_final is None else outer_lr_final
        self.global_params = [p.detach().to("cpu", torch.float32).clone() for p in params]
        self.outer_optimizer = torch.optim.SGD(
            self.global_params, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
        )

    def lr_at(self, outer_step: int) -> float:
        """The outer learning rate of outer step ``outer_step`` (1-based): outer_lr + (outer_lr_final -
        outer_lr) * min(1, (t - 1) / (ramp_steps - 1)); a function of t alone, so that every replica and
        a joiner replaying updates (dilocox/catchup.py) use the same one."""
        if self.outer_lr_final == self.outer_lr or self.ramp_steps == 1:
            return self.outer_lr_final
        frac = min(1.0, max(0, outer_step - 1) / (self.ramp_steps - 1))
        return self.outer_lr + (self.outer_lr_final - self.outer_lr) * frac

    @torch.no_grad()
    def pseudo_gradient(self, local_params: list[torch.Tensor]) -> list[torch.Tensor]:
        """delta = theta_{t-1} - x (DiLoCo step 2); same shapes as the parameters, CPU fp32."""
        return [g - p.detach().to("cpu", torch.float32) for g, p in zip(self.global_params, local_params)]

    @torch.no_grad()
    def step(self, averaged_pseudo_gradient: Sequence[torch.Tensor], outer_step: Optional[int] = None) -> None:
        """theta_t = outer_optimizer(theta_{t-1}, Delta_t) (DiLoCo step 4); ``outer_step`` t sets the
        learning rate to ``lr_at(t)`` first (None: the last one set). ``averaged_pseudo_gradient``: tensors of
        theta's shapes, or a sequence that yields them one at a time (dilocox.sparse.SparseAggregate).

        Momentum-free SGD (the sparse default) applies each tensor as it is read, theta_i.add_(g_i, alpha=-lr):
        what torch's SGD does for CPU tensors without momentum (optim/sgd.py ``_single_tensor_sgd``), the same
        bits, without holding every tensor's gradient at once."""
        if outer_step is not None:
            self.outer_optimizer.param_groups[0]["lr"] = self.lr_at(outer_step)
        group = self.outer_optimizer.param_groups[0]
        if not self.has_momentum and group["weight_decay"] == 0 and not group["maximize"]:
            for p, g in zip(self.global_params, averaged_pseudo_gradient):
                p.add_(g.to(torch.float32), alpha=-group["lr"])
            return
        # torch's SGD adds the momentum into the gradient in place with Nesterov on its foreach path (optim/sgd.py,
        # _multi_tensor_sgd): only then is a copy needed to leave the caller's aggregate as it was
        nesterov = self.outer_optimizer.param_groups[0]["nesterov"]
        for p, g in zip(self.global_params, averaged_pseudo_gradient):
            g = g.to(torch.float32)
            p.grad = g.clone() if nesterov else g
        self.outer_optimizer.step()
        for p in self.global_params:
            p.grad = None

    @torch.no_grad()
    def lookahead(self, pseudo_gradient: list[torch.Tensor]) -> list[torch.Tensor]:
        """What ``step(pseudo_gradient)`` would make theta, without changing theta or the momentum.

        torch's SGD rule (dampening 0): b' = mu b + g (b' = g at the first step), d = g + mu b'
        (nesterov) or b' (heavy ball) or g (mu = 0), theta' = theta - lr d. Used for the delayed
        schedule's local start point (dilocox/overlap.py, ``proxy``)."""
        group = self.outer_optimizer.param_groups[0]
        lr, mu, nesterov = group["lr"], group["momentum"], group["nesterov"]
        out = []
        for p, g in zip(self.global_params, pseudo_gradient):
            g = g.to(torch.float32)
            d = g
            if mu != 0:
                buf = self.outer_optimizer.state.get(p, {}).get("momentum_buffer")
                nxt = g.clone() if buf is None else buf * mu + g
                d = g + mu * nxt if nesterov else nxt
            out.append(p - lr * d)
        return out

    @property
    def has_momentum(self) -> bool:
        """Whether the outer optimizer keeps a momentum buffer (outer_momentum > 0)."""
        return self.outer_optimizer.param_groups[0]["momentum"] != 0

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The Nesterov momentum buffer per parameter (zeros before the first outer step)."""
        out = []
        for p in self.global_params:
            buf = self.outer_optimizer.state.get(p, {}).get("momentum_buffer")
            out.append(buf.clone() if buf is not None else torch.zeros_like(p))
        return out

    @torch.no_grad()
    def load_state(self, global_params: list[torch.Tensor], momentum: list[torch.Tensor] | None) -> None:
        """Replace theta and the momentum buffers (shapes must match; raises ValueError otherwise)."""
        check_shapes(self.global_params, global_params, "global parameters")
        for p, t in zip(self.global_params, global_params):
            p.copy_(t)
        if momentum is not None:
            check_shapes(self.global_params, momentum, "outer momentum")
            for p, m in zip(self.global_params, momentum):
                self.outer_optimizer.state[p]["momentum_buffer"] = m.to(torch.float32).clone()


def check_shapes(reference: list[torch.Tensor], other: list[torch.Tensor], what: str) -> None:
    """Raise ValueError naming ``what`` when tensor count, shape or finiteness disagrees with ``reference``."""
    if len(reference) != len(other):
        raise ValueError(f"{what}: expected {len(reference)} tensors, got {len(other)}")
    for i, (r, o) in enumerate(zip(reference, other)):
        if not isinstance(o, torch.Tensor) or tuple(r.shape) != tuple(o.shape):
            raise ValueError(f"{what}: tensor {i} has shape {getattr(o, 'shape', None)}, expected {tuple(r.shape)}")
        if not torch.isfinite(o).all():
            raise ValueError(f"{what}: tensor {i} holds NaN or Inf")


def params_digest(tensors: list[torch.Tensor]) -> str:
    """Hex SHA-256 (first 16 hex digits) of the fp32 bytes of ``tensors`` in order: equal iff bit-identical."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy())  # the buffer itself: no bytes copy
    return h.hexdigest()[:16]
