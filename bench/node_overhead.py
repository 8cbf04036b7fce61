"""A lone ``dilocox-node`` against a bare ``transformers`` training loop on the same cores (make bench-node-overhead).

Both train the same Llama preset (dilocox/model.py), batch, sequence length and data (the workload's own shard
of ``--data``, random windows of its tokens) with AdamW (the node's betas, weight decay and lr) and gradient
clipping at 1.0, on ``--threads`` torch threads. The bare loop is nothing but that: batch, forward, loss,
backward, clip, step. The node runs with its default flags, except ``--inner-steps`` and ``--max-outer-steps``,
and its rate is read from its metrics.jsonl between its first and last rows (so it counts everything a round
adds: the outer step, evaluation, checkpoints, the status board), and also per inner step (``compute_s``).

Runs alternate (bare, node, bare, node, ...) so that a busy machine slows both; the table gives the median of
each and the ratio of the medians, and the ratio of each pair. Real training on this machine's CPU; nothing is
emulated.

    python -m bench.node_overhead --model llama-20m --inner-steps 100 --rounds 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.harness.localswarm import REPO, LocalNode, node_env


def bare_loop(model: str, data: str, steps: int, warmup: int, threads: int) -> dict:
    """Train ``steps`` steps in this process; tokens/s over the steps after the first ``warmup`` (wall clock,
    batches included)."""
    import torch
    from dilocox.daemon.config import NodeConfig
    from transformers import LlamaForCausalLM

    from dilocox.model import build_model
    from dilocox.workload import make_workload

    torch.set_num_threads(threads)
    cfg = NodeConfig()
    workload = make_workload(model, data, None, None, 1)
    net = build_model(workload.spec, cfg.seed)  # transformers' LlamaForCausalLM of the node's LlamaConfig
    assert isinstance(net, LlamaForCausalLM), type(net)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.inner_lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    shard = workload.shard(cfg.seed, 0)
    vocab = net.config.vocab_size
    start, tokens = 0.0, 0
    for i in range(steps):
        if i == warmup:
            start, tokens = time.perf_counter(), 0
        x, y = shard.next_batch()
        loss = torch.nn.functional.cross_entropy(net(x).logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
    return dict(tokens_per_s=tokens / (time.perf_counter() - start), steps=steps - warmup,
                tokens_per_step=x.numel())


def run_bare(args, threads: int) -> dict:
    """``bare_loop`` in a fresh interpreter (the same start as a node's: nothing else in the process)."""
    steps = args.inner_steps * (args.rounds + 1)
    out = subprocess.run([sys.executable, "-m", "bench.node_overhead", "--bare", "--model", args.model, "--data",
                          args.data, "--steps", str(steps), "--warmup", str(args.inner_steps), "--threads",
                          str(threads)], capture_output=True, text=True, cwd=REPO, env=node_env(threads),
                         timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"bare loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_node(args, threads: int, workdir: Path) -> dict:
    """A lone node with default flags for ``rounds`` + 1 rounds; tokens/s between its first and last rows."""
    node = LocalNode("node", workdir, ["--model", args.model, "--data", args.data, "--inner-steps",
                                       str(args.inner_steps), "--max-outer-steps", str(args.rounds + 1),
                                       "--status-addr", "127.0.0.1:0", *args.node_args], threads=threads)
    try:
        code = node.proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        node.terminate()
        raise RuntimeError(f"the node did not finish within {args.timeout} s:\n{node.log_tail()}")
    rows = node.metrics()
    if code != 0 or len(rows) < 2:
        raise RuntimeError(f"the node exited {code} with {len(rows)} metrics rows:\n{node.log_tail()}")
    first, last = rows[0], rows[-1]
    tokens = last["tokens_total"] - first["tokens_total"]
    compute = sum(r["compute_s"] for r in rows[1:])
    return dict(tokens_per_s=tokens / (last["time"] - first["time"]), step_tokens_per_s=tokens / compute,
                rounds=len(rows) - 1, outside_compute_s=statistics.median(
                    (b["time"] - a["time"]) - b["compute_s"] for a, b in zip(rows, rows[1:])))


def measure(args) -> dict:
    threads = args.threads or len(os.sched_getaffinity(0))
    bare, node = [], []
    with tempfile.TemporaryDirectory(prefix="node-overhead-") as tmp:
        for r in range(args.repeats):
            bare.append(run_bare(args, threads))
            node.append(run_node(args, threads, Path(tmp) / f"node{r}"))
            print(f"repeat {r + 1}: bare {bare[-1]['tokens_per_s']:.0f} tokens/s, node {node[-1]['tokens_per_s']:.0f} "
                  f"({node[-1]['step_tokens_per_s']:.0f} per inner step)", flush=True)
    b = statistics.median(x["tokens_per_s"] for x in bare)
    n = statistics.median(x["tokens_per_s"] for x in node)
    s = statistics.median(x["step_tokens_per_s"] for x in node)
    return dict(model=args.model, inner_steps=args.inner_steps, rounds=args.rounds, threads=threads,
                node_args=args.node_args, bare=bare, node=node, bare_tokens_per_s=b, node_tokens_per_s=n,
                node_step_tokens_per_s=s, ratio=n / b, step_ratio=s / b,
                pair_ratios=[x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(node, bare)])


def table(result: dict) -> str:
    r = result
    lines = [f"{r['model']}, H = {r['inner_steps']}, {r['rounds']} measured rounds x {len(r['bare'])} repeats, "
             f"{r['threads']} torch threads (real training)", "",
             "| | tokens/s (median) | / bare |", "|---|---|---|",
             f"| bare transformers loop | {r['bare_tokens_per_s']:,.0f} | 1.00 |",
             f"| dilocox-node, per inner step | {r['node_step_tokens_per_s']:,.0f} | {r['step_ratio']:.2f} |",
             f"| dilocox-node, between metrics rows | {r['node_tokens_per_s']:,.0f} | **{r['ratio']:.2f}** |", "",
             "pairs (node / bare, in run order): " + ", ".join(f"{x:.3f}" for x in r["pair_ratios"]),
             f"median time per round outside inner steps: "
             f"{statistics.median(x['outside_compute_s'] for x in r['node']):.2f} s"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--data", default="builtin:shakespeare")
    p.add_argument("--inner-steps", type=int, default=100, help="H of the node; the bare loop runs as many steps")
    p.add_argument("--rounds", type=int, default=2, help="rounds measured after the first")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the CPUs this process may use)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--min-ratio", type=float, default=0.0, help="exit 1 if node/bare (between rows) is below this")
    p.add_argument("--min-step-ratio", type=float, default=0.0,
                   help="exit 1 if node/bare per inner step (rounds' own work left out) is below this")
    p.add_argument("--out", type=Path, default=None, help="JSON of every run")
    p.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    args, args.node_args = p.parse_known_args(argv)
    if args.bare:
        print(json.dumps(bare_loop(args.model, args.data, args.steps, args.warmup, args.threads)))
        return 0
    result = measure(args)
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if result["ratio"] < args.min_ratio or result["step_ratio"] < args.min_step_ratio:
        print(f"node/bare {result['ratio']:.3f} (bound {args.min_ratio}), per inner step {result['step_ratio']:.3f} "
              f"(bound {args.min_step_ratio})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
