"""Baseline (a) of ``make bench``: data-parallel training with an all-reduce every step.

The paper's "vanilla AllReduce": torch DistributedDataParallel over gloo, one process per host
(run inside tests/harness/netsim.py namespaces), the same model, data shards, AdamW schedule and batch as
a dilocox replica, so tokens per replica and validation loss compare at equal tokens.
Prints one JSON line: steps, tokens (per replica), wall_s, compute_s_per_step (forward+backward
measured under ``no_sync`` on calibration batches, plus the optimizer step), val_loss, losses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dilocox.data import Corpus, ReplicaShard, validation_batches
from dilocox.diloco import InnerConfig
from dilocox.model import ModelSpec, causal_lm_loss
from dilocox.stages import build_stage


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0 (gloo rendezvous)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--max-seconds", type=float, default=0, help="stop early after this long (0: no limit)")
    p.add_argument("--total-steps", type=int, required=True, help="length of the lr schedule (as the swarm's)")
    p.add_argument("--model", default="small")
    p.add_argument("--data", default="builtin:shakespeare")
    p.add_argument("--inner-lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world,
                           timeout=timedelta(seconds=600))
    spec = ModelSpec.resolve(args.model)
    corpus = Corpus.from_spec(args.data, spec.seq_len)
    shard = ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, args.seed, shard_key=args.rank)
    model = build_stage(spec, args.seed)  # the whole model, initialised as the nodes do
    ddp = DistributedDataParallel(model)
    schedule = InnerConfig(lr=args.inner_lr, warmup_steps=args.warmup_steps, total_steps=args.total_steps)
    opt = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, betas=schedule.betas,
                            weight_decay=schedule.weight_decay)

    def step(i: int) -> float:
        for g in opt.param_groups:
            g["lr"] = schedule.lr_at(i)
        x, y = shard.next_batch()
        loss = causal_lm_loss(ddp, x, y)
        loss.backward()  # DDP all-reduces the gradients here
        torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.max_grad_norm)
        t = time.perf_counter()
        opt.step()
        opt_times.append(time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    # calibration: forward + backward without the all-reduce, on batches no replica trains on
    calib = ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, args.seed + 1, shard_key=1000 + args.rank)
    compute_times, opt_times = [], []
    for _ in range(3):
        x, y = calib.next_batch()
        t = time.perf_counter()
        with ddp.no_sync():
            causal_lm_loss(ddp, x, y).backward()
        compute_times.append(time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    losses, start, done = [], time.perf_counter(), 0
    for i in range(args.steps):
        losses.append(step(i))
        done = i + 1
        if args.max_seconds and time.perf_counter() - start > args.max_seconds:
            break
    wall = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        val = [float(causal_lm_loss(model, x, y)) for x, y in validation_batches(corpus, spec.seq_len,
                                                                                 spec.batch_size, args.eval_batches)]
    tokens_per_step = spec.batch_size * spec.seq_len
    print(json.dumps(dict(rank=args.rank, steps=done, tokens=done * tokens_per_step, wall_s=wall,
                          compute_s_per_step=statistics.median(compute_times) + statistics.median(opt_times),
                          val_loss=sum(val) / len(val), losses=losses)), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
