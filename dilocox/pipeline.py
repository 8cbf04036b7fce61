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
"""

from __future__ import annotations

from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dilocox.diloco import InnerConfig, InnerLoop
from dilocox.model import lm_loss
from dilocox.stages import StageModule

PipelineSchedule = Literal["1f1b", "gpipe"]


class PipelineBroken(RuntimeError):
    """A pipeline or replica collective failed (a stage node died, left or timed out)."""


class PipelinedInnerLoop(InnerLoop):
    """InnerLoop of stage ``module.stage_index`` whose forward/backward is a pipeline schedule.

    ``group``: the replica's process group (rank = stage index). ``microbatches`` must divide the
    batch size. Any failure of a collective raises PipelineBroken; the caller tears the group down.
    """

    def __init__(self, module: StageModule, config: InnerConfig, microbatches: int,
                 schedule: PipelineSchedule = "1f1b", device: str = "cpu", group: dist.ProcessGroup | None = None):
        super().__init__(module, config, device)
        self.microbatches, self.schedule_name = microbatches, schedule
        self.group = self.stage = self.schedule = None
        self.stop_requested = False  # set when any stage asked to stop in the last inner_step
        if group is not None:
            self.attach(group)

    def attach(self, group: dist.ProcessGroup) -> None:
        """Use ``group`` (the replica's, rank = stage index) for the pipeline; optimizer state is kept."""
        module: StageModule = self.model
        self.group = group
        self.stage = PipelineStage(module, module.stage_index, module.num_stages, torch.device(self.device),
                                   group=group)
        schedule_class = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[self.schedule_name]
        self.schedule = schedule_class(self.stage, self.microbatches, loss_fn=lm_loss)

    def detach(self) -> None:
        """Drop the pipeline after a failure; gradients of a half-done step are discarded."""
        self.group = self.stage = self.schedule = None
        self.inner_optimizer.zero_grad(set_to_none=True)

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
        """One schedule step; returns the sum of microbatch losses on the last stage, else 0."""
        if self.schedule is None:
            raise PipelineBroken("no replica: the pipeline is not attached")
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        module: StageModule = self.model
        try:
            if module.is_first:
                run(inputs.to(self.device))
            elif module.is_last:
                run(target=targets.to(self.device), losses=losses)
            else:
                run()
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with the transport's message
            raise PipelineBroken(f"pipeline step failed: {e}") from e
        return torch.stack([loss.detach() for loss in losses]).sum().cpu() if losses else torch.zeros(())

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

        ``stop``: this node wants to leave; every stage learns it from ``stop_requested`` after
        the step, so all of them abandon the round at the same step. ``after_step(lr)``: as in
        ``InnerLoop.inner_step`` (SCAFFOLD's drift correction of this stage's parameters).
        """
        lr = self.config.lr_at(global_step)
        for group in self.inner_optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        loss_sum = self._run(inputs, targets, train=True)
        grads = [p.grad for p in self.params if p.grad is not None]
        f64 = torch.float64
        local_sq = torch.nn.utils.get_total_norm(grads).double().cpu() ** 2 if grads else torch.zeros((), dtype=f64)
        stats = self.all_reduce(torch.stack([local_sq, loss_sum.double(), torch.tensor(float(stop), dtype=f64)]))
        torch.nn.utils.clip_grads_with_norm_(self.params, self.config.max_grad_norm, stats[0].sqrt().float())
        self.inner_optimizer.step()
        if after_step is not None:
            with torch.no_grad():
                after_step(lr)
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.stop_requested = bool(stats[2] > 0)
        return float(stats[1]) / self.microbatches

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean validation loss of the replica (all stages must call it together)."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64)
        for x, y in batches:
            total += self._run(x, y, train=False).double() / self.microbatches
        return float(self.all_reduce(total.reshape(1))[0]) / len(batches)
