"""An emulated workload: a "model" of PARAMS fp32 values whose inner step sleeps STEP_S seconds.

``--workload synthetic:PARAMS:STEP_S`` lets the codec, the all-gather, the aggregation, the outer step,
digests and state transfer run at true payload sizes (25 M to 1 B values) on a machine that could not
train such a model: every table or plot made with it says it is emulated, and no quality claim comes
from it (its loss is a quadratic with no meaning beyond "replicas agree").

The model: ``PARAMS`` values in tensors of at most ``TENSOR_VALUES`` (2-D, rows of 4096, like the
matrices of a transformer), initialised N(0, 1) from the swarm's seed. Inner step s of replica k
(``SyntheticInnerLoop.inner_step``): one of ``SLICES`` contiguous slices of the flattened values,
slice s mod SLICES, moves towards the replica's target: x <- x + lr_s (n_k - x), where n_k is a
fixed N(0, 1) vector of one slice's length seeded by (seed, k) (different replicas pull different
ways, as non-IID data does), then the step sleeps until STEP_S seconds have passed since it began.
So a round of H inner steps writes a dense, deterministic pseudo-gradient with a spread of
magnitudes (what the top-k codec sees in real training), at the CPU cost of about H / SLICES passes
over the values instead of a forward and backward pass.

"Loss" (train and validation): mean of x^2 over all values (equal on every replica for theta).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

TENSOR_VALUES = 1 << 24  # values per tensor at most (a 4096 x 4096 matrix)
ROW = 4096
SLICES = 16
TOKENS_PER_STEP = 1024  # nominal tokens per inner step (what tokens_total counts; no data is read)
_SPEC = re.compile(r"^synthetic:(?P<params>[0-9.]+(?:e[0-9]+)?[kKmMgGbB]?):(?P<step>[0-9.]+(?:e-?[0-9]+)?)$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}


class WorkloadSpecError(ValueError):
    """A ``--workload`` spec that cannot be read; the message names the problem."""


def parse_spec(spec: str) -> tuple[int, float]:
    """"synthetic:25M:0.5" -> (25_000_000 values, 0.5 s per inner step). Suffixes k, M, G/B (powers of
    1000); raises WorkloadSpecError naming the problem (bad form, < 1 value, > 4e9 values, step < 0)."""
    m = _SPEC.match(spec.strip())
    if m is None:
        raise WorkloadSpecError(f"workload {spec!r}: expected synthetic:PARAMS:STEP_S, e.g. synthetic:25M:0.5")
    raw = m["params"]
    unit = raw[-1].lower() if raw[-1].isalpha() and raw[-1].lower() != "e" else ""
    try:
        params = int(round(float(raw[:-1] if unit else raw) * _UNITS[unit]))
        step_s = float(m["step"])
    except ValueError as e:
        raise WorkloadSpecError(f"workload {spec!r}: {e}") from None
    if not 1 <= params <= 4_000_000_000:
        raise WorkloadSpecError(f"workload {spec!r}: PARAMS must be in [1, 4e9], got {params}")
    if not 0 <= step_s <= 3600:
        raise WorkloadSpecError(f"workload {spec!r}: STEP_S must be in [0, 3600] seconds, got {step_s}")
    return params, step_s


def shapes_for(params: int) -> list[tuple[int, ...]]:
    """Tensor shapes holding ``params`` values: (rows, 4096) matrices of at most TENSOR_VALUES, then the
    remainder as rows of 4096 and a last 1-D tensor."""
    shapes, left = [], params
    while left >= TENSOR_VALUES:
        shapes.append((TENSOR_VALUES // ROW, ROW))
        left -= TENSOR_VALUES
    if left >= ROW:
        shapes.append((left // ROW, ROW))
        left -= (left // ROW) * ROW
    if left:
        shapes.append((left,))
    return shapes


class SyntheticModel(torch.nn.Module):
    """The emulated model's parameters (no forward pass)."""

    def __init__(self, params: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.values = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=g), requires_grad=False) for s in shapes_for(params)])


def _quadratic(params: list[torch.Tensor]) -> float:
    n = sum(p.numel() for p in params)
    return sum(float(torch.dot(p.reshape(-1), p.reshape(-1))) for p in params) / max(1, n)


class SyntheticInnerLoop:
    """The InnerLoop interface (dilocox/diloco.py) for the emulated model: ``inner_step`` writes the
    deterministic update of the module docstring and sleeps out ``step_s``; no optimizer state."""

    stop_requested = False

    def __init__(self, model: SyntheticModel, config, step_s: float, target_seed: int, device: str = "cpu"):
        """``config``: dilocox.diloco.InnerConfig (its lr schedule scales the step); ``target_seed``: this
        replica's pull (seed, shard key)."""
        self.model, self.config, self.step_s, self.device = model, config, step_s, device
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.slice_len = -(-self.numel // SLICES)
        g = torch.Generator().manual_seed(target_seed)
        self.target = torch.randn(self.slice_len, generator=g)
        # no state: keeps checkpoint and memory accounting code unchanged
        self.inner_optimizer = torch.optim.SGD(self.params, lr=config.lr)

    @torch.no_grad()
    def _flat_slice(self, k: int, fn: Callable[[torch.Tensor, int], None]) -> None:
        """Apply fn(view, offset_in_slice) to the parts of slice k that lie in each tensor."""
        lo, hi = k * self.slice_len, min(self.numel, (k + 1) * self.slice_len)
        start = 0
        for p in self.params:
            end = start + p.numel()
            a, b = max(lo, start), min(hi, end)
            if a < b:
                fn(p.view(-1)[a - start:b - start], a - lo)
            start = end

    def inner_step(self, inputs: torch.Tensor, targets: torch.Tensor, global_step: int, stop: bool = False,
                   after_step: Optional[Callable[[float], None]] = None) -> float:
        """x_slice <- x_slice + lr (n_k - x_slice) on slice global_step mod SLICES, then sleep until
        ``step_s`` has passed; returns the mean of x^2 over the slice (the step's "loss")."""
        began = time.monotonic()
        lr = min(1.0, self.config.lr_at(global_step) * 100)  # an inner lr of 1e-3 moves a slice by 10%
        losses = []

        def step(view: torch.Tensor, off: int) -> None:
            pull = self.target[off:off + view.numel()]
            losses.append(float(torch.dot(view, view)) / max(1, view.numel()))
            view.mul_(1.0 - lr).add_(pull, alpha=lr)

        self._flat_slice(global_step % SLICES, step)
        if after_step is not None:
            with torch.no_grad():
                after_step(lr)
        left = self.step_s - (time.monotonic() - began)
        if left > 0:
            time.sleep(left)
        return sum(losses) / max(1, len(losses))

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        return _quadratic(self.params)

    @torch.no_grad()
    def evaluate_params(self, tensors: list[torch.Tensor]) -> float:
        """The "loss" of other parameters (theta) without loading them."""
        return _quadratic(tensors)

    @torch.no_grad()
    def load_params(self, tensors: list[torch.Tensor]) -> None:
        for p, t in zip(self.params, tensors):
            p.copy_(t)


class SyntheticShard:
    """A ReplicaShard with no data: ``next_batch`` gives a (1, TOKENS_PER_STEP) placeholder so token counts
    mean something; ``position`` and ``shard_key`` checkpoint as for text."""

    def __init__(self, shard_key: int):
        self.shard_key, self.position = shard_key, 0
        self._batch = torch.zeros(1, TOKENS_PER_STEP, dtype=torch.int64)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        return self._batch, self._batch


@dataclass
class SyntheticWorkload:
    """``--workload synthetic:PARAMS:STEP_S`` (module docstring); whole models only."""

    spec: str
    params: int
    step_s: float
    kind: str = "synthetic"
    batch_size: int = 1

    @classmethod
    def from_spec(cls, spec: str) -> "SyntheticWorkload":
        params, step_s = parse_spec(spec)
        return cls(spec, params, step_s)

    @staticmethod
    def loss_fn(model, x, y):  # never called: the inner loop writes its update itself
        raise NotImplementedError("the synthetic workload has no loss function")

    @property
    def samples_per_step(self) -> int:
        return TOKENS_PER_STEP

    def build(self, seed: int, stage_index: int, num_stages: int) -> torch.nn.Module:
        if num_stages != 1:
            raise WorkloadSpecError("the synthetic workload has no pipeline stages: use --stage 0/1")
        return SyntheticModel(self.params, seed)

    def inner_loop(self, module, config, device: str = "cpu", loss_fn=None, seed: int = 0, shard_key: int = 0):
        return SyntheticInnerLoop(module, config, self.step_s, (seed * 1_000_003 + shard_key) & 0x7FFF_FFFF, device)

    def shard(self, seed: int, shard_key: int) -> SyntheticShard:
        return SyntheticShard(shard_key)

    def val_batches(self) -> list:
        return []

    def accuracy(self, model, batches) -> float:
        return math.nan
