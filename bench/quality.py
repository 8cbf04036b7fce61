"""``make bench-quality``: validation loss of the global parameters against tokens, per codec.

R replicas run inside one process with the daemon's own code for everything but the transport:
``InnerLoop`` (AdamW, warm-up + cosine), ``OuterSchedule`` (synchronous or one-step delay with the
re-base rule), ``OuterOptimizer`` (Nesterov or plain SGD), the ``Compressor`` round protocol
(begin / phase_payload / phase_done / commit, with the weighted mean of the codes that hivemind's
all-reduce computes) and the sparse codec's ``encode`` / ``aggregate``. Every method sees the same
model init (``--seeds``) and the same data order (replica r always draws shard r), so curves differ
only by the method. Writes runs/bench/quality.{json,csv,png}.

    python -m bench.quality --replicas 4 --inner-steps 30 --outer-steps 100 --seeds 7 8 9 \
        --methods fp32 adaptive sparse
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from daemon.config import NodeConfig
from dilocox import exact_mean
from dilocox.compression import CompressionConfig, Compressor
from dilocox.data import Corpus, ReplicaShard, validation_batches
from dilocox.diloco import InnerConfig, InnerLoop, OuterOptimizer
from dilocox.model import ModelSpec
from dilocox.overlap import OuterSchedule
from dilocox.sparse import SparseCodec, SparseConfig, aggregate
from dilocox.stages import build_stage

OUT = Path("runs/bench")


@dataclass(frozen=True)
class Method:
    """One row: how pseudo-gradients are coded and how the outer step applies their mean."""

    name: str
    codec: str = "none"             # Compressor mode (none, fp16, int8, adaptive) or "sparse"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    overlap: str = "none"
    rank_max: int = 8
    rank_energy: float = 0.5
    sparse: SparseConfig = field(default_factory=SparseConfig)


METHODS = {
    "fp32": Method("fp32"),
    "fp32-delayed": Method("fp32-delayed", overlap="delayed"),
    "int8": Method("int8", codec="int8"),
    "adaptive": Method("adaptive", codec="adaptive"),
    "adaptive-delayed": Method("adaptive-delayed", codec="adaptive", overlap="delayed"),
    "sparse": Method("sparse", codec="sparse", outer_lr=1.0, outer_momentum=0.0, nesterov=False),
}
for _lr in (2, 4, 6, 8):
    METHODS[f"sparse-a{_lr}"] = Method(f"sparse-a{_lr}", codec="sparse", outer_lr=float(_lr), outer_momentum=0.0,
                                       nesterov=False)
for _lr in (0.35, 0.7):
    METHODS[f"sparse-nesterov{_lr}"] = Method(f"sparse-nesterov{_lr}", codec="sparse", outer_lr=_lr)


def _codes_mean(codes: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The weighted mean hivemind's all-reduce returns for fp32 code buffers (integers: exact)."""
    total = sum(weights)
    return sum(w / total * c for w, c in zip(weights, codes))


def run(method: Method, seed: int, replicas: int, inner_steps: int, outer_steps: int, model: str,
        eval_every: int, eval_batches: int, data: str) -> dict:
    torch.manual_seed(seed)
    spec = ModelSpec.resolve(model)
    corpus = Corpus.from_spec(data, spec.seq_len)
    node = NodeConfig()  # the daemon's inner recipe (lr, warm-up, weight decay, betas)
    inner_cfg = InnerConfig(lr=node.inner_lr, weight_decay=node.weight_decay, betas=(node.beta1, node.beta2),
                            warmup_steps=node.warmup_steps, total_steps=inner_steps * outer_steps)
    inners = [InnerLoop(build_stage(spec, seed, 0, 1), inner_cfg) for _ in range(replicas)]
    outer = OuterOptimizer(inners[0].params, method.outer_lr, method.outer_momentum, method.nesterov)
    schedules = [OuterSchedule(outer, method.overlap) for _ in inners]
    shards = [ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, 1234, r) for r in range(replicas)]
    shapes = [tuple(p.shape) for p in outer.global_params]
    numel = sum(math.prod(s) for s in shapes)
    if method.codec == "sparse":
        codecs = [SparseCodec(shapes, method.sparse) for _ in inners]
    else:
        codecs = [Compressor(shapes, CompressionConfig(mode=method.codec, rank_max=method.rank_max,
                                                       energy=method.rank_energy, seed=seed)) for _ in inners]
    evaluator = InnerLoop(build_stage(spec, seed, 0, 1), inner_cfg)
    val = validation_batches(corpus, spec.seq_len, spec.batch_size, eval_batches)
    step_bound = exact_mean.adam_step_bound(node.beta1, node.beta2)
    tokens_per_round = replicas * inner_steps * spec.batch_size * spec.seq_len
    curve, payloads, pending, started = [], [], None, time.monotonic()

    def evaluate(t: int) -> None:
        evaluator.load_params(outer.global_params)
        curve.append(dict(outer_step=t, tokens=t * tokens_per_round, val_loss=evaluator.evaluate(val)))

    evaluate(0)
    for s in schedules:
        s.begin_round(inners[0].params)
    for t in range(1, outer_steps + 1):
        for inner, shard in zip(inners, shards):
            for i in range(inner_steps):
                inner.inner_step(*shard.next_batch(), global_step=(t - 1) * inner_steps + i)
        deltas = [s.pseudo_gradient(inner.params) for s, inner in zip(schedules, inners)]
        averaged, payload = _average(method, codecs, deltas, outer, t, inner_cfg, inner_steps, step_bound)
        payloads.append(payload)
        if method.overlap == "none":
            outer.step(averaged)
        elif pending is not None:  # delayed: round t-1's mean is applied at the end of round t
            outer.step(pending)
        pending = averaged
        for s, inner in zip(schedules, inners):
            s.rebase(inner.params)
            s.begin_round(inner.params)
        if t % eval_every == 0 or t == outer_steps:
            evaluate(t)
    return dict(method=method.name, seed=seed, curve=curve, final_val_loss=curve[-1]["val_loss"],
                payload_bytes=sum(payloads) / len(payloads), fp32_bytes=4 * numel,
                compression_ratio=4 * numel / (sum(payloads) / len(payloads)), seconds=time.monotonic() - started)


def _average(method, codecs, deltas, outer, t, inner_cfg, inner_steps, step_bound):
    """The group's mean pseudo-gradient as every member computes it, and one member's payload bytes."""
    weights = [float(inner_steps)] * len(deltas)
    if method.codec == "sparse":
        payloads = {f"r{i}": c.encode(d) for i, (c, d) in enumerate(zip(codecs, deltas))}
        mean, dropped = aggregate(payloads, {p: w for p, w in zip(payloads, weights)},
                                  [tuple(p.shape) for p in outer.global_params], method.sparse)
        assert not dropped, dropped
        return mean, len(payloads["r0"])
    lr_sum = sum(inner_cfg.lr_at((t - 1) * inner_steps + i) for i in range(inner_steps))
    bounds = [exact_mean.pseudo_gradient_bound(lr_sum, inner_cfg.weight_decay, float(p.abs().max()), step_bound)
              for p in outer.global_params]
    rounds = [c.begin(d, bounds, t) for c, d in zip(codecs, deltas)]
    for _ in range(rounds[0].num_phases):
        out = [r.phase_payload() for r in rounds]
        mean = _codes_mean([codes for codes, _ in out], weights)
        for r in rounds:
            r.phase_done(mean, [stats for _, stats in out], weights)
    for r, c in zip(rounds, codecs):
        r.decide_rank(0.0, 0.0, len(rounds))
        c.commit(r)
    return rounds[0].result(), rounds[0].stats.payload_bytes


def _job(args):
    name, seed, kw = args
    torch.set_num_threads(1)
    return run(METHODS[name], seed, **kw)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["fp32", "adaptive", "sparse"], choices=sorted(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[7, 8, 9])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--outer-steps", type=int, default=100)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data", default="builtin:shakespeare")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT / "quality")
    a = ap.parse_args(argv)
    kw = dict(replicas=a.replicas, inner_steps=a.inner_steps, outer_steps=a.outer_steps, model=a.model,
              eval_every=a.eval_every, eval_batches=a.eval_batches, data=a.data)
    jobs = [(m, s, kw) for m in a.methods for s in a.seeds]
    with mp.get_context("spawn").Pool(a.workers) as pool:
        results = []
        for r in pool.imap_unordered(_job, jobs):
            results.append(r)
            print(f"{r['method']:>20} seed {r['seed']}: val_loss {r['final_val_loss']:.4f} "
                  f"ratio {r['compression_ratio']:.1f}x ({r['seconds']:.0f}s)", flush=True)
    report(results, a.methods, a.out, kw)


def report(results: list[dict], methods: list[str], out: Path, settings: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    base = [r["final_val_loss"] for r in results if r["method"] == "fp32"]
    rows = []
    for m in methods:
        mine = sorted((r for r in results if r["method"] == m), key=lambda r: r["seed"])
        losses = [r["final_val_loss"] for r in mine]
        mean = sum(losses) / len(losses)
        rows.append(dict(method=m, seeds=" ".join(str(r["seed"]) for r in mine),
                         val_loss_mean=round(mean, 4), val_loss_min=round(min(losses), 4),
                         val_loss_max=round(max(losses), 4),
                         vs_fp32=round(mean / (sum(base) / len(base)) - 1, 4) if base else "",
                         payload_bytes=round(mine[0]["payload_bytes"]),
                         compression_ratio=round(mine[0]["compression_ratio"], 1)))
    out.with_suffix(".json").write_text(json.dumps(dict(settings=settings, rows=rows, runs=results), indent=1))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r)
    _plot(results, methods, out.with_suffix(".png"))


def _plot(results, methods, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for k, m in enumerate(methods):
        for j, r in enumerate(r for r in results if r["method"] == m):
            c = r["curve"][1:]
            ax.plot([p["tokens"] for p in c], [p["val_loss"] for p in c], color=f"C{k}", alpha=0.8,
                    label=f"{m} ({r['compression_ratio']:.0f}x)" if j == 0 else None)
    ax.set_xlabel("tokens (all replicas)")
    ax.set_ylabel("validation loss of theta (nats/byte)")
    ax.set_title("pseudo-gradient codecs at equal tokens (one line per seed)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
