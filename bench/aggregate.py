"""Time of a sparse round's aggregation on one core (``make bench-aggregate``): the rule on the dense
decoded vectors (how it ran before 2026-11-25) against ``dilocox.sparse.aggregate``, which runs it on
the union of the sent positions only; both are checked to give the same bits.

Setup: the ``small`` preset's parameter shapes (3.3 M values), the daemon's sparse config (top-128 of
each 4096, 2-bit values, Rice-coded indices), k contributions from random pseudo-gradients, the
default rule (centered-clip, norm bound 2) and the plain mean. Median and spread of ``--repeats``
timings per cell. Results: a printed table and runs/bench/aggregate.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from dilocox.daemon.config import NodeConfig

from bench.localswarm import write_json
from dilocox import robust, sparse
from dilocox.model import ModelSpec, build_model


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def _dense(payloads, weights, shapes, cfg, rule):
    vectors = {p: torch.cat([d.reshape(-1) for d in sparse.decode(b, shapes, cfg)]).double()
               for p, b in sorted(payloads.items())}
    return robust.aggregate(vectors, weights, rule, norm_bound=2.0)[0].float()


def measure(k: int, rule: str, repeats: int, shapes, cfg) -> dict:
    """One cell: k contributions under ``rule``; raises AssertionError if the two paths differ in any bit."""
    g = torch.Generator().manual_seed(k)
    payloads = {f"peer{i}": sparse.SparseCodec(shapes, cfg).encode([torch.randn(s, generator=g) * 1e-3
                                                                   for s in shapes]) for i in range(k)}
    weights = dict.fromkeys(payloads, 50.0)
    dense_t, ref = _timed(lambda: _dense(payloads, weights, shapes, cfg, rule), repeats)
    sparse_t, out = _timed(lambda: sparse.aggregate(payloads, weights, shapes, cfg, rule=rule, norm_bound=2.0)[0],
                           repeats)
    assert torch.equal(torch.cat([o.reshape(-1) for o in out]), ref), f"k={k} {rule}: the two paths differ"
    return dict(k=k, rule=rule, dense_s=statistics.median(dense_t), dense_range_s=[min(dense_t), max(dense_t)],
                sparse_s=statistics.median(sparse_t), sparse_range_s=[min(sparse_t), max(sparse_t)],
                speedup=statistics.median(dense_t) / statistics.median(sparse_t), bit_identical=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8], help="contributions per round (k)")
    parser.add_argument("--rules", nargs="+", default=["centered-clip", "mean"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/aggregate.json"))
    a = parser.parse_args(argv)
    torch.set_num_threads(1)  # a node runs one torch thread (bench/localswarm.py)
    shapes = [tuple(p.shape) for p in build_model(ModelSpec.resolve("small"), 0).parameters()]
    cfg = NodeConfig().sparse_config()  # the daemon's defaults
    rows = [measure(k, rule, a.repeats, shapes, cfg) for rule in a.rules for k in a.replicas]
    print(f"{'rule':>14} {'k':>3} {'dense s':>9} {'sent positions s':>17} {'speedup':>8}")
    for r in rows:
        print(f"{r['rule']:>14} {r['k']:>3} {r['dense_s']:>9.3f} {r['sparse_s']:>17.3f} {r['speedup']:>7.1f}x")
    write_json(a.out, dict(values=sum(math.prod(s) for s in shapes), config=vars(cfg), rows=rows))


if __name__ == "__main__":
    main()
