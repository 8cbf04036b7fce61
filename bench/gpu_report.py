"""The report of ``bench/gpu_check.sh``: each node's inner-loop speed and outer-round cost beside the bare loop's.

Reads ``OUT/<node>/metrics.jsonl`` (one JSON record per outer round, daemon/node.py ``_record``) for every node
folder under OUT and ``OUT/bare.json`` (bench/bare_loop.py). Per node, over the rounds after the first (the
first holds compilation and warm-up; with one round, that one):

* tokens/s = H x batch x seq_len / ``compute_s`` (the round's inner steps, wall time, ended by a host read of the
  losses, so GPU work is in it), and MFU = FLOPs per token x tokens/s / peak, FLOPs per token = 6 N + 12 L T d
  (bench/bare_loop.py ``flops_per_token``);
* peak device memory (``device_peak_bytes``, the largest of its rounds);
* the outer round per phase, medians in seconds: ``duration_s`` (from the end of the inner steps to the
  round's outcome), ``encode_s``, ``group_s``, ``gather_s``, ``aggregate_s``, ``apply_s``, ``exchange_s``, and
  ``wait_s`` (the training thread blocked on it), with wait_s / compute_s;
* the theta digests after each round (every node must print the same list).

Prints one line per node and the bare loop's, and writes them as JSON to OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.bare_loop import flops_per_token
from dilocox.model import ModelSpec

PHASES = ("duration_s", "encode_s", "group_s", "gather_s", "aggregate_s", "apply_s", "exchange_s", "wait_s")


def node_summary(rows: list[dict], tokens_per_round: int, flops: float, peak_tflops: float) -> dict:
    """One node's figures (module docstring) from its metrics.jsonl records, in order. Raises ValueError
    when there are none."""
    if not rows:
        raise ValueError("no outer rounds recorded")
    steady = rows[1:] or rows
    tokens_per_s = statistics.median(tokens_per_round / r["compute_s"] for r in steady if r["compute_s"] > 0)
    phases = {k: statistics.median(float(r.get(k, 0.0)) for r in steady) for k in PHASES}
    compute_s = statistics.median(r["compute_s"] for r in steady)
    return dict(rounds=len(rows), tokens_per_second=tokens_per_s, mfu=flops * tokens_per_s / (peak_tflops * 1e12),
                compute_s=compute_s, phases=phases, wait_fraction=phases["wait_s"] / compute_s if compute_s else 0.0,
                peak_memory_bytes=max(int(r.get("device_peak_bytes", 0)) for r in rows),
                board_tokens_per_second=rows[-1].get("tokens_per_second", 0.0),
                digests=[r["digest"][:8] for r in rows])


def report(out: Path, model: str, batch_size: int, seq_len: int, inner_steps: int, peak_tflops: float) -> dict:
    """Read OUT, print the report lines, write OUT/summary.json; returns what it wrote."""
    spec = ModelSpec.resolve(model)
    batch_size, seq_len = batch_size or spec.batch_size, seq_len or spec.seq_len
    flops = flops_per_token(spec.llama, seq_len)
    print(f"{model}: {flops['matmul_params'] / 1e6:.1f} M parameters that multiply ({flops['params'] / 1e6:.1f} M "
          f"in all); FLOPs/token = 6 N + 12 L T d = {flops['total'] / 1e9:.3f} G (attention "
          f"{flops['attention'] / flops['total']:.0%}); peak {peak_tflops:.0f} TFLOPS")
    summary = dict(model=model, batch_size=batch_size, seq_len=seq_len, inner_steps=inner_steps,
                   peak_tflops=peak_tflops, flops_per_token=flops, nodes={})
    for metrics in sorted(out.glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        node = metrics.parent.name
        try:
            s = node_summary(rows, inner_steps * batch_size * seq_len, flops["total"], peak_tflops)
        except ValueError as e:
            print(f"node {node}: {e}")
            continue
        summary["nodes"][node] = s
        p = s["phases"]
        print(f"node {node}: {s['rounds']} rounds, {s['tokens_per_second']:,.0f} tokens/s, MFU {s['mfu']:.1%}, "
              f"peak memory {s['peak_memory_bytes'] / 2**30:.2f} GiB; compute {s['compute_s']:.2f} s/round, outer "
              f"round {p['duration_s']:.2f} s (encode {p['encode_s']:.2f}, group {p['group_s']:.2f}, gather "
              f"{p['gather_s']:.2f}, aggregate {p['aggregate_s']:.2f}, apply {p['apply_s']:.2f}, exchange "
              f"{p['exchange_s']:.2f}), training blocked {p['wait_s']:.2f} s ({s['wait_fraction']:.1%} of compute); "
              f"digests {s['digests']}")
    bare_file = out / "bare.json"
    if bare_file.is_file():
        bare = json.loads(bare_file.read_text())
        summary["bare"] = bare
        print(f"bare transformers loop ({bare['card']}, {bare['precision']}, compile {bare['compile']}): "
              f"{bare['tokens_per_second']:,.0f} tokens/s, MFU {bare['mfu']:.1%}, peak memory "
              f"{bare['peak_memory_bytes'] / 2**30:.2f} GiB")
        for node, s in summary["nodes"].items():
            print(f"node {node} / bare loop: {s['tokens_per_second'] / bare['tokens_per_second']:.2f} of its tokens/s")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder gpu_check.sh wrote (node folders and bare.json)")
    ap.add_argument("--model", default="llama-150m")
    ap.add_argument("--batch-size", type=int, default=0, help="default: the preset's")
    ap.add_argument("--seq-len", type=int, default=0, help="default: the preset's")
    ap.add_argument("--inner-steps", type=int, required=True, help="H of the nodes' rounds")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    a = ap.parse_args(argv)
    summary = report(a.out, a.model, a.batch_size, a.seq_len, a.inner_steps, a.peak_tflops)
    return 0 if summary["nodes"] else 1


if __name__ == "__main__":
    sys.exit(main())
