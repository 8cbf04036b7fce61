"""Speed of the sparse codec and of a sparse round's aggregation (``make bench-aggregate``), in ns per value.

For each ``--values`` size (default: the ``small`` preset's 3.3 M parameters, in its shapes, and 50 M values in
2048 x 2048 matrices), with one torch thread and with all of them (``--threads``): ``SparseCodec.prepare``
(encode: error feedback, top-k, quantize, pack), ``decode`` of one payload, and ``sparse.aggregate`` of k
contributions (``--replicas``, default 4 and 8) under the plain mean and under centered-clip, each with the
daemon's norm bound 2 (its default rule). The daemon's sparse config (top-128 of each 4096, 2-bit values,
Rice-coded indices); contributions from random pseudo-gradients, one of them 30x larger (clipped by the bound).
Median of ``--repeats`` timings per cell with min and max, and the peak extra resident memory during one call
(bytes per value, the returned tensors included; RSS sampled every millisecond). Up to ``--check-values``
values, sparse.aggregate is checked against ``robust.aggregate`` on the sorted union of the sent positions
(the same bits, tests/test_sparse.py). Results: a printed table and runs/bench/aggregate.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch
from dilocox.daemon.config import NodeConfig

from dilocox import robust, sparse
from dilocox.model import ModelSpec, build_model

SMALL = 3_295_488  # the small preset's parameter count


def shapes_for(values: int) -> list[tuple[int, ...]]:
    """The small preset's shapes for its size, else 2048 x 2048 matrices and a remainder vector."""
    if values == SMALL:
        return [tuple(p.shape) for p in build_model(ModelSpec.resolve("small"), 0).parameters()]
    big = 2048 * 2048
    return [(2048, 2048)] * (values // big) + ([(values % big,)] if values % big else [])


def peak_rss(fn) -> tuple[object, int]:
    """(fn(), the largest growth of this process's resident memory while it ran, in bytes): freed memory is
    handed back to the system first (glibc's malloc_trim), so that the growth is what fn touches."""
    import ctypes

    import psutil

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure may be low
        pass
    proc, peak, done = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss - base)
            time.sleep(0.001)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return out, max(peak[0], proc.memory_info().rss - base)


def timed(fn, repeats: int, n: int) -> dict:
    fn()  # warm: the first touch of fresh memory costs more than any later one
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    _, extra = peak_rss(fn)
    ns = [t / n * 1e9 for t in times]
    return dict(ns_per_value=statistics.median(ns), min=min(ns), max=max(ns), repeats=repeats,
                peak_extra_bytes_per_value=extra / n)


def payloads_for(shapes, cfg, k: int) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(k)
    out = {}
    for i in range(k):
        grads = [torch.randn(s, generator=g) * (0.03 if i == 1 else 1e-3) for s in shapes]
        out[f"peer{i}"] = sparse.SparseCodec(shapes, cfg).encode(grads)
    return out


def check(payloads, shapes, cfg, rule: str) -> None:
    """sparse.aggregate == robust.aggregate on the sorted union of the sent positions, bit for bit."""
    n = sum(math.prod(s) for s in shapes)
    lay = sparse.layout(n, cfg)
    union = torch.from_numpy(np.unique(np.concatenate(
        [sparse.positions(sparse.parse(b, n, cfg)[0], lay, cfg) for b in payloads.values()])))
    vectors = {p: torch.cat([d.reshape(-1) for d in sparse.decode(b, shapes, cfg)])[union] for p, b in payloads.items()}
    want = torch.zeros(n)
    want[union] = robust.aggregate(vectors, dict.fromkeys(payloads, 50.0), rule, norm_bound=2.0)[0].float()
    got = torch.cat([o.reshape(-1) for o in sparse.aggregate(payloads, dict.fromkeys(payloads, 50.0), shapes, cfg,
                                                             rule=rule, norm_bound=2.0)[0]])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{rule}: the two paths differ"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values", type=int, nargs="+", default=[SMALL, 50_000_000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8], help="contributions per round (k)")
    parser.add_argument("--rules", nargs="+", default=["mean", "centered-clip"])
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, torch.get_num_threads()}))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-values", type=int, default=5_000_000,
                        help="check the bits against robust.aggregate up to this size")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/aggregate.json"))
    a = parser.parse_args(argv)
    cfg = NodeConfig().sparse_config()  # the daemon's defaults
    rows = []
    for values in a.values:
        shapes = shapes_for(values)
        n = sum(math.prod(s) for s in shapes)
        payloads = {k: payloads_for(shapes, cfg, k) for k in a.replicas}
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(1)) * 1e-3 for s in shapes]
        codec = sparse.SparseCodec(shapes, cfg)
        codec.encode(grads)  # a non-zero error-feedback buffer
        if n <= a.check_values:
            for k in a.replicas:
                for rule in a.rules:
                    check(payloads[k], shapes, cfg, rule)
        for threads in a.threads:
            torch.set_num_threads(threads)
            cell = dict(values=n, threads=threads)
            rows.append(dict(cell, op="prepare", k=1, **timed(lambda: codec.prepare(grads), a.repeats, n)))
            one = payloads[a.replicas[0]]["peer0"]
            rows.append(dict(cell, op="decode", k=1, **timed(lambda: sparse.decode(one, shapes, cfg), a.repeats, n)))
            for k in a.replicas:
                weights = dict.fromkeys(payloads[k], 50.0)
                for rule in a.rules:
                    def agg(p=payloads[k], w=weights, r=rule):
                        return sparse.aggregate(p, w, shapes, cfg, rule=r, norm_bound=2.0)
                    rows.append(dict(cell, op=f"aggregate {rule}", k=k, **timed(agg, a.repeats, n)))
            for r in rows[-2 - len(a.replicas) * len(a.rules):]:
                print(f"{r['values']:>11,} {r['threads']:>2} thr {r['op']:>25} k={r['k']:<2} "
                      f"{r['ns_per_value']:7.2f} ns/value (min {r['min']:.2f}, max {r['max']:.2f})  "
                      f"peak +{r['peak_extra_bytes_per_value']:.1f} B/value", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)  # no tests.harness.localswarm: it imports the gRPC stubs
    a.out.write_text(json.dumps(dict(config=vars(cfg), norm_bound=2.0, checked_up_to=a.check_values, rows=rows),
                                indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
