"""Pipeline stages in bf16 against fp32: validation loss, seconds per inner step and bytes between stages.

One DiLoCo replica of ``--stages`` stages trained in-process (each stage a thread, gloo over loopback:
tests/harness/staged_replica.py) for ``--rounds`` solo outer steps of ``--inner-steps`` inner steps, once in
fp32 and once in bf16 (autocast, fp32 master weights and AdamW state, bf16 activations and gradients between
stages), with the same seed, data and micro-batches; repeated per seed. Prints one row per run and the bf16
minus fp32 difference of the final validation loss (nats/token); writes runs/bench/stages_bf16.json.
The stages share this machine's cores, so seconds per step measure the pair, not a pipeline of two hosts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tests.harness.staged_replica import train_staged_replica

OUT = Path("runs/bench")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--lr", type=float, default=3e-3)
    a = parser.parse_args(argv)
    rows = []
    for seed in a.seeds:
        for precision in ("fp32", "bf16"):
            run = train_staged_replica(precision, micro_batch_size=a.micro_batch_size, seed=seed, rounds=a.rounds,
                                       inner_steps=a.inner_steps, num_stages=a.stages, schedule=a.schedule,
                                       model=a.model, seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr)
            rows.append(dict(seed=seed, precision=precision, val_loss_start=run.val_loss_start,
                             val_loss=run.val_loss, train_loss_last=run.losses[0][-1],
                             s_per_inner_step=run.s_per_inner_step, boundary_bytes_per_step=run.boundary_bytes))
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                  flush=True)
    by = {(r["seed"], r["precision"]): r for r in rows}
    diffs = [(by[s, "bf16"]["val_loss"] - by[s, "fp32"]["val_loss"]) / by[s, "fp32"]["val_loss"] for s in a.seeds]
    print(f"bf16 vs fp32 final validation loss: mean {100 * statistics.mean(diffs):+.2f}%, per seed "
          + ", ".join(f"{100 * d:+.2f}%" for d in diffs))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "stages_bf16.json").write_text(json.dumps(dict(args=vars(a), rows=rows, relative_diffs=diffs), indent=2))


if __name__ == "__main__":
    main()
