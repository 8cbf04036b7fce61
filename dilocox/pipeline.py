"""Inner steps of one pipeline stage inside a replica (DiLoCoX dual optimizer policy, sec. 3.1).

Every stage node of a replica calls ``inner_step`` with the same batch at the same time.
Activations and their gradients move between stages through ``torch.distributed.pipelining``
(a ``PipelineStage`` and a 1F1B or GPipe schedule over the replica's process group: gloo on
CPU, NCCL on GPU). Each stage then steps its own AdamW (its inner_optimizer) on its own
parameters; the outer optimizer of each stage lives with the node that holds the stage.

Equivalence to one stage: the schedule divides gradients by the number of microbatches
(``scale_grads=True``), so equal-size microbatches give the full-batch mean loss's gradient;
gradient clipping uses the norm over all stages (one all-reduce of squared norms per step),
as ``clip_grad_norm_`` does on the whole model.

Precision: with ``InnerConfig.precision == "bf16"`` each stage's forward and the loss run under
``torch.autocast`` (bf16 matmuls; the backward follows the forward's dtypes), the parameters and
the optimizer state stay fp32, as in ``InnerLoop``. Activations and their gradients then cross
the stage boundary in bf16 (half the bytes) and the receiving stage upcasts them to fp32, so the
residual stream inside a stage stays fp32 as in a whole model. The dtype and shape of every
boundary tensor follow from the config and the batch's shape (``PipelineStage`` in its static
mode), which every stage of a replica shares; nothing about them is read from the wire.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dilocox.diloco import InnerConfig, InnerLoop
from dilocox.model import ModelSpecError, lm_loss
from dilocox.stages import StageModule

PipelineSchedule = Literal["1f1b", "gpipe"]
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # resolved InnerConfig.precision -> boundary dtype


class PipelineBroken(RuntimeError):
    """A pipeline or replica collective failed (a stage node died, left or timed out)."""


def pipeline_microbatches(batch_size: int, microbatches: int, micro_batch_size: int = 0, num_stages: int = 1,
                          schedule: PipelineSchedule = "1f1b") -> int:
    """Pipeline micro-batches per inner step for a batch of ``batch_size`` sequences.

    ``micro_batch_size`` > 0 (``--micro-batch-size``): that many sequences per micro-batch, so
    batch_size / micro_batch_size micro-batches, and ``microbatches`` is not used; else
    ``microbatches`` (``--microbatches``) micro-batches of batch_size / microbatches sequences.
    Raises ModelSpecError (a ValueError) naming the values when the split is not exact, or when
    the 1F1B schedule would get fewer micro-batches than ``num_stages`` (torch's Schedule1F1B
    refuses that; GPipe does not).
    """
    if micro_batch_size:
        if micro_batch_size < 1 or batch_size % micro_batch_size:
            raise ModelSpecError(f"micro_batch_size={micro_batch_size} must divide batch_size={batch_size} (on a "
                                 f"pipeline stage it is the sequences per pipeline micro-batch)")
        n, source = batch_size // micro_batch_size, f"batch_size={batch_size} / micro_batch_size={micro_batch_size}"
    else:
        if microbatches < 1 or batch_size % microbatches:
            raise ModelSpecError(f"microbatches={microbatches} must divide batch_size={batch_size}")
        n, source = microbatches, f"microbatches={microbatches}"
    if schedule == "1f1b" and n < num_stages:
        raise ModelSpecError(f"{source} gives {n} pipeline micro-batch(es), fewer than the {num_stages} stages the "
                             f"1f1b schedule needs (use smaller micro-batches or pipeline_schedule gpipe)")
    return n


class _BoundaryStage(nn.Module):
    """A stage as the pipeline runs it: forward under the loop's autocast, a received activation
    upcast to fp32, a sent one cast to the wire dtype (no-ops in fp32). Holds no parameters of its own."""

    def __init__(self, module: StageModule, autocast: Callable, wire_dtype: torch.dtype):
        super().__init__()
        self.module, self.autocast, self.wire_dtype = module, autocast, wire_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.module.is_first:
            x = x.float()  # the residual stream stays fp32, as in a whole model under autocast
        with self.autocast():
            out = self.module(x)
        return out if self.module.is_last else out.to(self.wire_dtype)


class PipelinedInnerLoop(InnerLoop):
    """InnerLoop of stage ``module.stage_index`` whose forward/backward is a pipeline schedule.

    ``group``: the replica's process group (rank = stage index). Micro-batches per step:
    ``pipeline_microbatches(batch, microbatches, config.micro_batch_size, num_stages, schedule)``
    (ModelSpecError if the batch does not split). ``config.precision`` bf16: autocast, bf16
    activations and activation gradients between stages (module docstring); ``auto`` is resolved as
    ``InnerLoop`` does, ValueError for another value. Any failure of a collective raises PipelineBroken; the
    caller tears the group down.
    """

    def __init__(self, module: StageModule, config: InnerConfig, microbatches: int,
                 schedule: PipelineSchedule = "1f1b", device: str = "cpu", group: dist.ProcessGroup | None = None):
        super().__init__(module, config, device)  # resolves precision auto into self.config
        self.microbatches, self.schedule_name = microbatches, schedule
        self.wire_dtype = WIRE_DTYPES[self.config.precision]
        self.group = self.stage = self.schedule = None
        self._layout: tuple | None = None  # (micro-batches, sequences each, seq_len, schedule) of the schedule
        self.stop_requested = False  # set when any stage asked to stop in the last inner_step
        if group is not None:
            self.attach(group)

    def attach(self, group: dist.ProcessGroup) -> None:
        """Use ``group`` (the replica's, rank = stage index) for the pipeline; optimizer state is kept.
        The stage and schedule are built at the first step, when the batch's shape is known."""
        self.group, self.stage, self.schedule, self._layout = group, None, None, None

    def detach(self) -> None:
        """Drop the pipeline after a failure; gradients of a half-done step are discarded."""
        self.group = self.stage = self.schedule = self._layout = None
        self.inner_optimizer.zero_grad(set_to_none=True)

    def _boundary_args(self, micro: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors of one micro-batch's stage input and output: int64 ids [micro, seq] or the
        wire dtype's hidden [micro, seq, d] in; hidden [micro, seq, d] or logits [micro, seq, vocab] out."""
        module: StageModule = self.model
        d, vocab = module.config.hidden_size, module.config.vocab_size

        def hidden():
            return torch.empty(micro, seq_len, d, dtype=self.wire_dtype, device="meta", requires_grad=True)
        inputs = torch.empty(micro, seq_len, dtype=torch.long, device="meta") if module.is_first else hidden()
        # the last stage's logits (autocast's lm_head: bf16 in bf16) go to the loss, never on the wire
        outputs = torch.empty(micro, seq_len, vocab, dtype=self.wire_dtype, device="meta", requires_grad=True) \
            if module.is_last else hidden()
        return inputs, outputs

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits.float(), targets)  # the loss in fp32, as autocast computes cross-entropy

    def _schedule_for(self, batch: int, seq_len: int, train: bool):
        """The schedule for batches of [batch, seq_len], rebuilt when that layout changes (every stage
        sees the same batches, so every stage rebuilds at the same step). A validation batch that does
        not split (the last, short one of a small validation set) runs as one micro-batch; a training
        batch that does not split raises ModelSpecError."""
        module: StageModule = self.model
        try:
            n, name = pipeline_microbatches(batch, self.microbatches, self.config.micro_batch_size,
                                            module.num_stages, self.schedule_name), self.schedule_name
        except ModelSpecError:
            if train:
                raise
            n, name = 1, "gpipe"  # forward only (same order either way); 1F1B refuses fewer micro-batches than stages
        layout = (n, batch // n, seq_len, name)
        if self.schedule is None or self._layout != layout:
            inputs, outputs = self._boundary_args(batch // n, seq_len)
            self.stage = PipelineStage(_BoundaryStage(module, self.autocast, self.wire_dtype), module.stage_index,
                                       module.num_stages, torch.device(self.device), input_args=inputs,
                                       output_args=outputs, group=self.group)
            schedule_class = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[name]
            self.schedule, self._layout = schedule_class(self.stage, n, loss_fn=self._loss), layout
        return self.schedule

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
        """One schedule step; returns the mean microbatch loss on the last stage, else 0 (fp32 scalar).
        Raises ModelSpecError if the batch does not split into micro-batches, PipelineBroken on a failed step."""
        if self.group is None:
            raise PipelineBroken("no replica: the pipeline is not attached")
        schedule = self._schedule_for(inputs.shape[0], inputs.shape[1], train)
        losses: list[torch.Tensor] = []
        run = schedule.step if train else schedule.eval
        module: StageModule = self.model
        args = (inputs.to(self.device),) if module.is_first else ()
        kwargs = dict(target=targets.to(self.device), losses=losses) if module.is_last else {}
        try:
            run(*args, **kwargs)  # a lone stage (S = 1) is first and last: ids in, loss out
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with the transport's message
            raise PipelineBroken(f"pipeline step failed: {e}") from e
        return torch.stack([loss.detach().float() for loss in losses]).mean().cpu() if losses else torch.zeros(())

    def all_reduce(self, values: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce a small fp64 tensor across the replica's stages (in place; returned)."""
        if self.group is None:
            raise PipelineBroken("no replica: the pipeline is not attached")
        try:
            dist.all_reduce(values, op=op, group=self.group)
        except Exception as e:
            raise PipelineBroken(f"replica all-reduce failed: {e}") from e
        return values

    def inner_step(self, inputs: torch.Tensor, targets: torch.Tensor, global_step: int, stop: bool = False,
                   after_step: Optional[Callable[[float], None]] = None) -> float:
        """One pipelined AdamW step of this stage; returns the replica's loss (nats/token).

        ``inputs``, ``targets``: int64 [batch, seq], the same on every stage. ``stop``: this node wants
        to leave; every stage learns it from ``stop_requested`` after the step, so all of them abandon
        the round at the same step. ``after_step(lr)``: as in ``InnerLoop.inner_step`` (SCAFFOLD's
        drift correction of this stage's parameters).
        """
        lr = self.config.lr_at(global_step)
        for group in self.inner_optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        loss = self._run(inputs, targets, train=True)
        grads = [p.grad for p in self.params if p.grad is not None]
        f64 = torch.float64
        local_sq = torch.nn.utils.get_total_norm(grads).double().cpu() ** 2 if grads else torch.zeros((), dtype=f64)
        stats = self.all_reduce(torch.stack([local_sq, loss.double(), torch.tensor(float(stop), dtype=f64)]))
        torch.nn.utils.clip_grads_with_norm_(self.params, self.config.max_grad_norm, stats[0].sqrt().float())
        self.inner_optimizer.step()
        if after_step is not None:
            with torch.no_grad():
                after_step(lr)
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.stop_requested = bool(stats[2] > 0)
        return float(stats[1])

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean validation loss of the replica in nats/token (all stages must call it together)."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64)
        for x, y in batches:
            total += self._run(x, y, train=False).double()
        return float(self.all_reduce(total.reshape(1))[0]) / len(batches)
