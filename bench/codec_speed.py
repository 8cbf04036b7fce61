"""Sparse codec and aggregation: this version against an older one, side by side, and a determinism digest.

    python -m bench.codec_speed --old DIR [--values N] [--threads 1 2] [--k 4]
    python -m bench.codec_speed --digest [--threads 1 2 16]

``--old DIR``: a folder holding the previous ``old_sparse.py`` and ``old_robust.py`` (for instance
``git show REV:dilocox/sparse.py | sed 's/from dilocox import robust/import old_robust as robust/' >
DIR/old_sparse.py`` and ``git show REV:dilocox/robust.py > DIR/old_robust.py``); each op (prepare, decode,
aggregate under the mean and centered-clip with norm bound 2, the daemon's sparse config) runs on the same
inputs in one process, new then old, and prints ns per value (median, min, max), the peak extra resident
memory per value (the result included) and the speedup. Without ``--old``, only this version.

``--digest``: the sha256 of this version's payloads, error-feedback buffers and aggregates (k = 1 to 8, every
rule, two configs) for fixed inputs made by numpy, at each ``--threads``: members of a swarm must print the
same digest whatever their CPU, SIMD width, torch/numpy versions or thread count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from bench.aggregate import timed
from dilocox import robust, sparse

DAEMON = dict(chunk=4096, topk=128, bits=2, beta=0.9, rice=True)  # NodeConfig().sparse_config()


def compare(a) -> list[dict]:
    n = a.values
    big = 2048 * 2048
    shapes = [(2048, 2048)] * (n // big) + ([(n % big,)] if n % big else [])
    cfg = sparse.SparseConfig(**DAEMON)
    old = None
    if a.old:
        sys.path.insert(0, str(a.old))
        import old_sparse as old

        ocfg = old.SparseConfig(**DAEMON)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
    payloads = {}
    for i in range(a.k):
        payloads[f"peer{i}"] = sparse.SparseCodec(shapes, cfg).encode(
            [torch.randn(s, generator=g) * (0.03 if i == 1 else 1e-3) for s in shapes])  # peer1: clipped
    weights = dict.fromkeys(payloads, 50.0)
    codec = sparse.SparseCodec(shapes, cfg)
    codec.encode(grads)  # a non-zero error-feedback buffer
    ops = {"prepare": lambda: codec.prepare(grads),
           "decode": lambda: sparse.decode(payloads["peer0"], shapes, cfg)}
    for rule in ("mean", "centered-clip"):
        ops[f"aggregate {rule}"] = lambda r=rule: sparse.aggregate(payloads, weights, shapes, cfg, rule=r,
                                                                   norm_bound=2.0)
    olds = {}
    if old is not None:
        ocodec = old.SparseCodec(shapes, ocfg)
        ocodec.load_state_dict(codec.state_dict())
        olds = {"prepare": lambda: ocodec.prepare(grads),
                "decode": lambda: old.decode(payloads["peer0"], shapes, ocfg)}
        for rule in ("mean", "centered-clip"):
            olds[f"aggregate {rule}"] = lambda r=rule: old.aggregate(payloads, weights, shapes, ocfg, rule=r,
                                                                     norm_bound=2.0)
    rows = []
    print(f"{n:,} values, k={a.k}, {DAEMON}, torch {torch.__version__}, numpy {np.__version__}", flush=True)
    for threads in a.threads:
        torch.set_num_threads(threads)
        for name, fn in ops.items():
            row = dict(op=name, threads=threads, values=n, k=a.k, new=timed(fn, a.repeats, n))
            new = row["new"]
            line = (f"{threads:>2} thr {name:>24}: new {new['ns_per_value']:7.2f} ns/value "
                    f"[{new['min']:.2f}-{new['max']:.2f}] +{new['peak_extra_bytes_per_value']:.1f} B")
            if name in olds:
                row["old"] = timed(olds[name], a.old_repeats, n)
                row["speedup"] = row["old"]["ns_per_value"] / row["new"]["ns_per_value"]
                line += (f" | old {row['old']['ns_per_value']:7.2f} [{row['old']['min']:.2f}-{row['old']['max']:.2f}] "
                         f"+{row['old']['peak_extra_bytes_per_value']:.1f} B | x{row['speedup']:.1f}")
            print(line, flush=True)
            rows.append(row)
    return rows


def digest(threads: int, n: int) -> str:
    torch.set_num_threads(threads)
    h = hashlib.sha256()
    shapes = [(n - 12345,), (12345,)]
    for cfg in (sparse.SparseConfig(**DAEMON), sparse.SparseConfig(chunk=195, topk=12, bits=4)):
        rng = np.random.default_rng(0)
        payloads = {}
        for i in range(8):
            grads = [torch.from_numpy(rng.standard_normal(s).astype(np.float32) * (0.3 if i == 2 else 1e-3))
                     for s in shapes]
            payload, error = sparse.SparseCodec(shapes, cfg).prepare(grads)
            h.update(payload)
            h.update(error.numpy().tobytes())
            payloads[f"peer{i}"] = payload
        for k in (1, 2, 3, 4, 8):
            sub = {p: payloads[p] for p in list(payloads)[:k]}
            for rule in ("mean", "centered-clip", "median", "trimmed-mean"):
                out, _ = sparse.aggregate(sub, {p: 10.0 + j for j, p in enumerate(sub)}, shapes, cfg, rule=rule,
                                          norm_bound=2.0)
                for o in out:
                    h.update(o.numpy().tobytes())
    rng = np.random.default_rng(1)
    vectors = {f"p{i}": torch.from_numpy(rng.standard_normal(200_003) * (100 if i == 0 else 1)) for i in range(5)}
    for rule in robust.Aggregation:
        h.update(robust.aggregate(vectors, dict.fromkeys(vectors, 1.0), rule)[0].numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, help="folder with old_sparse.py and old_robust.py")
    parser.add_argument("--values", type=int, default=50_000_000)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, torch.get_num_threads()}))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--old-repeats", type=int, default=1)
    parser.add_argument("--digest", action="store_true")
    parser.add_argument("--digest-values", type=int, default=1_000_000)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args(argv)
    if a.digest:
        out = {t: digest(t, a.digest_values) for t in a.threads}
        for t, d in out.items():
            print(f"digest {torch.backends.cpu.get_cpu_capability()} {t} threads: {d}", flush=True)
    else:
        out = compare(a)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
