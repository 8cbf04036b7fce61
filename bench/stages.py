"""Pipeline stages: memory per node and tokens/s per replica for S = 1, 2, 4 (``make bench-stages``).

For each S, S processes (one per stage node; 1 torch thread each) build exactly what a dilocox
node builds for its stage (StageModule, inner AdamW, outer optimizer with theta + momentum, the
start-of-round copy, error feedback), join one gloo process group on loopback and run inner steps
through torch.distributed.pipelining (1F1B), then one outer step. Reported per S:
  * per node: tensor bytes of params + inner optimizer + outer state + error feedback
    (daemon/staging.stage_memory, the figure NodeStatus.memory shows) and peak RSS growth
    over the process's RSS before the model was built;
  * per replica: tokens/s over the timed inner steps (median of per-step rates).
Results: runs/bench/stages.json and .csv. On this 2-core machine S = 4 runs 4 processes on 2
cores, so its tokens/s measures contention, not the pipeline.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

OUT = Path("runs/bench")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _stage_node(rank: int, world: int, store: str, out: str, args: dict) -> None:
    import torch.distributed as dist
    from dilocox.daemon.replica_state import stage_memory

    from dilocox.compression import CompressionConfig, DenseCompressor
    from dilocox.data import Corpus, ReplicaShard
    from dilocox.diloco import InnerConfig, InnerLoop, OuterOptimizer
    from dilocox.model import ModelSpec
    from dilocox.overlap import OuterSchedule
    from dilocox.pipeline import PipelinedInnerLoop
    from dilocox.stages import build_stage

    torch.set_num_threads(1)
    spec = ModelSpec.resolve(args["model"])
    corpus = Corpus.from_spec(args["data"], spec.seq_len)
    shard = ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, seed=0, shard_key=1)
    baseline = _rss_bytes()
    module = build_stage(spec, 0, rank, world)
    config = InnerConfig(lr=1e-3, warmup_steps=5)
    if world == 1:
        inner = InnerLoop(module, config)
    else:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        inner = PipelinedInnerLoop(module, config, args["microbatches"], "1f1b", group=dist.group.WORLD)
    outer = OuterOptimizer(inner.params)
    schedule = OuterSchedule(outer, "delayed")
    compressor = DenseCompressor([tuple(p.shape) for p in outer.global_params], CompressionConfig(mode="adaptive"))
    rates = []
    for step in range(args["warmup"] + args["steps"]):
        x, y = shard.next_batch()
        start = time.perf_counter()
        inner.inner_step(x, y, global_step=step)
        if step >= args["warmup"]:
            rates.append(x.numel() / (time.perf_counter() - start))
    outer.step(schedule.pseudo_gradient(inner.params))  # momentum buffers now exist
    memory = stage_memory(inner, outer, schedule, compressor)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(out, "w") as f:
        json.dump(dict(stage=rank, memory=memory.__dict__, rss_growth_bytes=peak - baseline,
                       tokens_per_s=statistics.median(rates)), f)
    if world > 1:
        dist.destroy_process_group()


def measure(num_stages: int, args: dict, workdir: Path) -> dict:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    outs = [workdir / f"s{num_stages}-{k}.json" for k in range(num_stages)]
    store = (workdir / f"store-{num_stages}").resolve()
    store.unlink(missing_ok=True)
    procs = [ctx.Process(target=_stage_node, args=(k, num_stages, str(store), str(outs[k]), args))
             for k in range(num_stages)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"S={num_stages}: a stage process exited with {p.exitcode}")
    nodes = [json.loads(o.read_text()) for o in outs]
    return dict(num_stages=num_stages, nodes=nodes,
                max_node_total_bytes=max(n["memory"]["total_bytes"] for n in nodes),
                max_node_rss_growth_bytes=max(n["rss_growth_bytes"] for n in nodes),
                tokens_per_s_per_replica=nodes[-1]["tokens_per_s"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--data", default="builtin:shakespeare")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    a = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    args = dict(model=a.model, data=a.data, steps=a.steps, warmup=a.warmup, microbatches=a.microbatches)
    results = [measure(s, args, OUT) for s in a.stages]
    base = results[0]
    rows = []
    for r in results:
        rows.append(dict(num_stages=r["num_stages"], node_total_MiB=r["max_node_total_bytes"] / 2**20,
                         ratio_vs_first=r["max_node_total_bytes"] / base["max_node_total_bytes"],
                         node_rss_growth_MiB=r["max_node_rss_growth_bytes"] / 2**20,
                         tokens_per_s_per_replica=r["tokens_per_s_per_replica"]))
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    (OUT / "stages.json").write_text(json.dumps(dict(args=args, results=results, rows=rows), indent=2))
    with open(OUT / "stages.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
