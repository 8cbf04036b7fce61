"""``make bench-quality``: validation loss of the global parameters against tokens, per codec.

R replicas run inside one process (bench/federation.py) with the daemon's own code for everything but the
transport:
``InnerLoop`` (AdamW, warm-up + cosine), ``OuterSchedule`` (synchronous or one-step delay with the
re-base rule), ``OuterOptimizer`` (Nesterov or plain SGD), the ``Compressor`` round protocol
(begin / phase_payload / phase_done / commit, with the weighted mean of the codes that hivemind's
all-reduce computes) and the sparse codec's ``prepare`` / ``commit`` / ``aggregate``. Every method sees the same
model init (``--seeds``) and the same data order (replica r always draws shard r), so curves differ
only by the method. Writes runs/bench/quality.{json,csv,png}.

    python -m bench.quality --replicas 4 --inner-steps 30 --outer-steps 100 --seeds 7 8 9 \
        --methods fp32 adaptive sparse
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import time
from pathlib import Path

import torch
from dilocox.daemon.config import NodeConfig

from bench.federation import Federation, Method, ShardReplica
from dilocox.data import Corpus, ReplicaShard, validation_batches
from dilocox.diloco import InnerConfig, InnerLoop
from dilocox.model import ModelSpec
from dilocox.shared_index import SharedIndexConfig
from dilocox.sparse import SparseConfig
from dilocox.stages import build_stage

OUT = Path("runs/bench")


def _sgd(name: str, codec: str, lr: float, **kw) -> Method:
    return Method(name, codec=codec, outer_lr=lr, outer_momentum=0.0, nesterov=False, **kw)


def _overlapped(name: str, delay: str, lr: tuple[float, float] = (2.5, 4.5), fp32: bool = False, **kw) -> Method:
    """The default row (``DEFAULT``) with overlapped rounds: ``delay`` "delayed" (tau = H, DiLoCoX) or
    "tauN" (round t's update lands N inner steps into round t+1); ``lr``: the outer lr ramp's ends;
    ``fp32``: fp32 DiLoCo's codec and outer step instead."""
    tau = None if delay == "delayed" else int(delay[3:])
    if fp32:
        return Method(name, overlap="delayed", tau=tau, **kw)
    return _sgd(name, "sparse", lr[0], outer_lr_final=lr[1], overlap="delayed", tau=tau,
                sparse=SparseConfig(topk=128, rice=True, beta=0.9), aggregation="centered-clip", norm_bound=2.0, **kw)



def _cut(suffix: str, budget: int, lr: tuple[float, float] = (2.5, 4.5), **kw) -> Method:
    """The default row (``DEFAULT``) with its aggregate cut to ``budget`` x topk per chunk
    (dilocox/experimental/resparsify.py); ``lr``: the outer lr ramp's ends; named
    "sparse-k128r-a{lr0}-{lr1}-b0.9-cc-{suffix}"."""
    return _sgd(f"sparse-k128r-a{lr[0]}-{lr[1]}-b0.9-cc-{suffix}", "sparse", lr[0], outer_lr_final=lr[1],
                sparse=SparseConfig(topk=128, rice=True, beta=0.9), aggregation="centered-clip", norm_bound=2.0,
                resparsify=budget, **kw)

def _shared(selection: str, topk: int, result_bits: int, beta: float = 0.9, lr: tuple[float, float] = (2.5, 4.5),
            bits: int = 2, reducer: bool = False, proposes: bool = False) -> Method:
    """The default row (``DEFAULT``) with every member sending its values at one index set (dilocox/shared_index.py);
    named "shared-{selection}-k{topk}-r{result_bits}[-b{beta}][-a{lr0}-{lr1}][-rf|-rfp]"; ``reducer`` (-rf): the
    result's quantization error stays with its range's reducer (ReducerFeedback) instead of every member;
    ``proposes`` (-rfp): and the reducer proposes from its pseudo-gradient plus that error on its range."""
    name = f"shared-{selection}-k{topk}-r{result_bits}" + (f"-b{beta:g}" if beta != 0.9 else "") + (
        f"-a{lr[0]:g}-{lr[1]:g}" if lr != (2.5, 4.5) else "") + (f"-{bits}bit" if bits != 2 else "") + (
        "-rfp" if proposes else "-rf" if reducer else "")
    return _sgd(name, "sparse", lr[0], outer_lr_final=lr[1], sparse=SparseConfig(topk=128, rice=True, beta=0.9),
                aggregation="centered-clip", norm_bound=2.0, reducer_feedback=reducer or proposes,
                reducer_proposes=proposes,
                shared=SharedIndexConfig(topk=topk, bits=bits, result_bits=result_bits, beta=beta, selection=selection))


METHODS = {m.name: m for m in [
    Method("fp32"),
    Method("fp32-delayed", overlap="delayed"),
    Method("fp32-delayed-local", overlap="delayed", proxy="local"),
    Method("fp32-delayed-eager", overlap="delayed", proxy="eager"),
    Method("int8", codec="int8"),
    Method("int8-delayed-local", codec="int8", overlap="delayed", proxy="local"),
    Method("adaptive", codec="adaptive"),
    Method("adaptive-delayed", codec="adaptive", overlap="delayed"),
    Method("adaptive-delayed-local", codec="adaptive", overlap="delayed", proxy="local"),
    Method("adaptive-noef", codec="adaptive", error_feedback=False),
    _sgd("adaptive-sgd1", "adaptive", 1.0),
    _sgd("adaptive-sgd2", "adaptive", 2.0),
    Method("adaptive-dense-embed", codec="adaptive", dense_embeddings=True),
    Method("adaptive-warmup10", codec="adaptive", warmup_rounds=10),
    Method("adaptive-power2", codec="adaptive", power_iterations=2),
    Method("adaptive-refresh5", codec="adaptive", refresh_every=5),
    Method("adaptive-rank32", codec="adaptive", rank_max=32, rank_energy=0.9),
    _sgd("sparse", "sparse", 1.0),
    *[_sgd(f"sparse-a{a}", "sparse", float(a)) for a in (2, 3, 4, 6, 8)],
    Method("sparse-nesterov0.7", codec="sparse"),
    Method("sparse-nesterov0.35", codec="sparse", outer_lr=0.35),
    *[_sgd(f"sparse-a4-beta{b}", "sparse", 4.0, sparse=SparseConfig(beta=b)) for b in (0.9, 0.99)],
    *[_sgd(f"sparse4b-a{a}", "sparse", float(a), sparse=SparseConfig(bits=4)) for a in (3, 4)],
    *[_sgd(f"sparse-k128-a{a}", "sparse", float(a), sparse=SparseConfig(topk=128)) for a in (3, 4)],
    *[_sgd(f"sparse-a3-beta{b}", "sparse", 3.0, sparse=SparseConfig(beta=b)) for b in (0.8, 0.9)],
    _sgd("sparse-c1024-a3", "sparse", 3.0, sparse=SparseConfig(chunk=1024, topk=16)),
    _sgd("sparse-c256-a3", "sparse", 3.0, sparse=SparseConfig(chunk=256, topk=4)),
    Method("sparse-hb0.5-a2", codec="sparse", outer_lr=2.0, outer_momentum=0.5, nesterov=False),
    *[_sgd(f"sparse-a3-{r}", "sparse", 3.0, aggregation=r, norm_bound=2.0)
      for r in ("mean", "centered-clip", "trimmed-mean", "median")],
    *[_sgd(f"sparse-k128r-a{a}", "sparse", float(a), sparse=SparseConfig(topk=128, rice=True)) for a in (2.5, 3, 3.5)],
    _sgd("sparse-k128r-a3-beta0.9", "sparse", 3.0, sparse=SparseConfig(topk=128, rice=True, beta=0.9)),
    _sgd("sparse-k96r-a3", "sparse", 3.0, sparse=SparseConfig(topk=96, rice=True)),
    _sgd("sparse-k144r-a3", "sparse", 3.0, sparse=SparseConfig(topk=144, rice=True)),
    *[_sgd(f"sparse-k{k}r1b-a3", "sparse", 3.0, sparse=SparseConfig(topk=k, bits=1, rice=True)) for k in (160, 192)],
    *[_sgd(f"sparse-k128r-a3.5-{r}", "sparse", 3.5, sparse=SparseConfig(topk=128, rice=True), aggregation=r,
           norm_bound=2.0) for r in ("mean", "centered-clip", "trimmed-mean", "median")],
    _sgd("sparse-k128r-a3.5-b0.9-cc", "sparse", 3.5, sparse=SparseConfig(topk=128, rice=True, beta=0.9),
         aggregation="centered-clip", norm_bound=2.0),
    *[_sgd(f"sparse-k128r-a{a}-b0.9-cc", "sparse", float(a), sparse=SparseConfig(topk=128, rice=True, beta=0.9),
           aggregation="centered-clip", norm_bound=2.0) for a in (3, 4)],
    *[_sgd(f"sparse-k128r-a3.5-b0.9-cc-nb{b:g}", "sparse", 3.5, sparse=SparseConfig(topk=128, rice=True, beta=0.9),
           aggregation="centered-clip", norm_bound=b) for b in (0.0, 3.0)],
    *[_sgd(f"sparse-k{k}r-a2.5-4.5-b0.9-cc", "sparse", 2.5, outer_lr_final=4.5,
           sparse=SparseConfig(topk=k, rice=True, beta=0.9), aggregation="centered-clip", norm_bound=2.0)
      for k in (128, 144)],
    _sgd("sparse-k144r-a3.5-cc", "sparse", 3.5, sparse=SparseConfig(topk=144, rice=True),
         aggregation="centered-clip", norm_bound=2.0),
    _sgd("sparse-a4-delayed", "sparse", 4.0, overlap="delayed"),
    _sgd("sparse-a4-delayed-local", "sparse", 4.0, overlap="delayed", proxy="local"),
    _sgd("sparse-a4-delayed-eager", "sparse", 4.0, overlap="delayed", proxy="eager"),
    # overlapped variants of the default (docs/algorithms.md, "Overlapped rounds"): D = the default row
    *[_overlapped(f"D-{d}", d) for d in ("delayed", "tau1", "tau3", "tau10", "tau20")],
    *[_overlapped(f"D-a{a}-{b}-delayed", "delayed", lr=(a, b)) for a, b in ((1.5, 2.5), (2, 3), (1, 2))],
    *[_overlapped(f"D-{d}-{p}-{src}", d, proxy=p, proxy_source=src)
      for d in ("delayed", "tau10") for p in ("local", "eager") for src in ("code", "raw", "ef")],
    *[_overlapped(f"D-{d}-mix{m:g}", d, merge="mix", mix=m) for d in ("tau3", "tau10", "delayed") for m in (0.5, 0)],
    *[_overlapped(f"D-{d}-local-code", d, proxy="local") for d in ("tau1", "tau3", "tau20")],
    *[_overlapped(f"fp32-{d}", d, fp32=True) for d in ("tau1", "tau3", "tau10")],
    _overlapped("fp32-delayed-local-code", "delayed", fp32=True, proxy="local"),
    # the default with its aggregate re-sparsified (dilocox/experimental/resparsify.py): what a reduce-scatter
    # would apply
    *[_cut(f"gtopk{b}" + (f"-{bits}bit" if bits else ""), b, resparsify_bits=bits) for b in (1, 2) for bits in (0, 8)],
    _cut("gtopk2-whole", 2, restore_whole=True),
    *[_cut("gtopk2", 2, lr) for lr in ((3.1, 5.6), (3.75, 6.75))],  # the ramp x 1.25, x 1.5
    # the default on one index set per round (dilocox/shared_index.py): a reduce-scatter needs no cut
    _shared("leader", 128, 8), _shared("leader", 128, 2), _shared("leader", 256, 4),
    _shared("random", 512, 4), _shared("random", 512, 4, beta=1.0),
    _shared("union", 128, 8), _shared("union", 256, 4), _shared("union", 256, 2), _shared("union", 384, 2),
    _shared("union", 256, 4, lr=(3.1, 5.6)),
    # what a reduce-scatter can send: the result's quantization error kept by the range's reducer
    _shared("union", 256, 4, reducer=True), _shared("union", 256, 4, lr=(3.1, 5.6), reducer=True),
    _shared("union", 256, 2, reducer=True), _shared("union", 256, 2, lr=(3.1, 5.6), reducer=True),
    _shared("union", 256, 4, lr=(3.1, 5.6), proposes=True),
]}


# the row that is the daemon's default configuration (daemon/config.py; tests/test_quality_bench.py keeps them equal)
DEFAULT = "sparse-k128r-a2.5-4.5-b0.9-cc"


def daemon_flags(m: Method) -> list[str]:
    """dilocox-node flags that configure a node like method ``m``; ValueError for an ablation the daemon
    does not offer (no error feedback, dense embeddings, warm-up, power iterations, refresh, start proxies)."""
    # the daemon's shared rounds (--compression shared) are the union with the reducer's feedback (-rf rows)
    daemon_shared = m.shared is not None and m.shared.selection.value == "union" and m.reducer_feedback \
        and not m.reducer_proposes
    if (not m.error_feedback or m.dense_embeddings or m.resparsify or (m.shared and not daemon_shared)
            or m.warmup_rounds or m.power_iterations != 1 or m.refresh_every or m.proxy != "none"
            or m.tau is not None or m.merge != "rebase"):
        raise ValueError(f"{m.name} is an ablation of the benchmark only")
    if daemon_shared:
        c = m.shared
        return ["--compression", "shared", "--overlap", m.overlap, "--outer-lr", str(m.outer_lr),
                "--outer-lr-final", str(m.outer_lr_final or m.outer_lr), "--outer-momentum", str(m.outer_momentum),
                "--nesterov" if m.nesterov else "--no-nesterov", "--sparse-chunk", str(c.chunk),
                "--shared-topk", str(c.topk), "--sparse-bits", str(c.bits), "--shared-result-bits",
                str(c.result_bits), "--sparse-beta", str(c.beta), "--aggregation", m.aggregation,
                "--norm-bound", str(m.norm_bound)]
    flags = ["--compression", m.codec, "--overlap", m.overlap,
             "--outer-lr", str(m.outer_lr), "--outer-lr-final", str(m.outer_lr_final or m.outer_lr),
             "--outer-momentum", str(m.outer_momentum),
             "--nesterov" if m.nesterov else "--no-nesterov"]
    if m.codec == "sparse":
        flags += ["--sparse-chunk", str(m.sparse.chunk), "--sparse-topk", str(m.sparse.topk),
                  "--sparse-bits", str(m.sparse.bits), "--sparse-beta", str(m.sparse.beta),
                  "--sparse-rice" if m.sparse.rice else "--no-sparse-rice",
                  "--aggregation", m.aggregation, "--norm-bound", str(m.norm_bound)]
    elif m.codec == "adaptive":
        flags += ["--rank-max", str(m.rank_max), "--rank-energy", str(m.rank_energy)]
    return flags


def run(method: Method, seed: int, replicas: int, inner_steps: int, outer_steps: int, model: str,
        eval_every: int, eval_batches: int, data: str) -> dict:
    torch.manual_seed(seed)
    spec = ModelSpec.resolve(model)
    corpus = Corpus.from_spec(data, spec.seq_len)
    node = NodeConfig()  # the daemon's inner recipe (lr, warm-up, weight decay, betas)
    inner_cfg = InnerConfig(lr=node.inner_lr, weight_decay=node.weight_decay, betas=(node.beta1, node.beta2),
                            warmup_steps=node.warmup_steps, total_steps=inner_steps * outer_steps)
    modules = [build_stage(spec, seed, 0, 1) for _ in range(replicas)]
    # replica r draws what a node started with --seed SEED --data-seed r draws (daemon/replica_state.py)
    reps = [ShardReplica(InnerLoop(m, inner_cfg), ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, seed, r),
                         inner_steps) for r, m in enumerate(modules)]
    fed = Federation(method, reps, inner_cfg, inner_steps, outer_steps, seed,  # outer lr ramp: total steps / H
                     param_names=[n for n, _ in modules[0].named_parameters()])
    evaluator = InnerLoop(build_stage(spec, seed, 0, 1), inner_cfg)
    val = validation_batches(corpus, spec.seq_len, spec.batch_size, eval_batches)
    tokens_per_round = replicas * inner_steps * spec.batch_size * spec.seq_len
    curve, payloads, uploads, started = [], [], [], time.monotonic()

    def evaluate(t: int, applied: int) -> None:
        """theta after t rounds of compute holding ``applied`` outer updates (overlapped rounds: t - 1, the
        last round's mean still in flight), compared with synchronous methods at equal tokens."""
        evaluator.load_params(fed.outer.global_params)
        curve.append(dict(outer_step=applied, rounds=t, tokens=t * tokens_per_round, val_loss=evaluator.evaluate(val)))

    evaluate(0, 0)
    for t in range(1, outer_steps + 1):
        out = fed.round(t)
        assert not out.dropped, out.dropped
        payloads.append(out.payload)
        uploads.append(out.upload)
        if (t % eval_every == 0 or t == outer_steps) and not (fed.pending is not None and t == outer_steps):
            evaluate(t, t if fed.pending is None else t - 1)
    if fed.finish(outer_steps):  # the last round's mean lands after its compute: a node applies it before it leaves
        evaluate(outer_steps, outer_steps)
    numel = fed.numel
    return dict(method=method.name, seed=seed, curve=curve, final_val_loss=curve[-1]["val_loss"],
                payload_bytes=sum(payloads) / len(payloads), fp32_bytes=4 * numel,
                upload_bytes=sum(uploads) / len(uploads),
                compression_ratio=4 * numel / (sum(payloads) / len(payloads)), seconds=time.monotonic() - started)


def _job(args):
    name, seed, kw = args
    torch.set_num_threads(1)
    return run(METHODS[name], seed, **kw)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["fp32", "int8", "adaptive-delayed", DEFAULT],
                    choices=sorted(METHODS))
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
    ap.add_argument("--tradeoff", type=Path, nargs="+", metavar="JSON",
                    help="draw loss against upload per member from these runs' JSON into --out's .png, and exit")
    a = ap.parse_args(argv)
    if a.tradeoff:
        plot_tradeoff(a.tradeoff, a.out.with_suffix(".png"))
        return
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
                         upload_bytes=round(mine[0]["upload_bytes"]),
                         upload_x_payload=round(mine[0]["upload_bytes"] / mine[0]["payload_bytes"], 2),
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


YCLIP = 10.0  # % over fp32 beyond which plot_tradeoff names a row instead of drawing it


def plot_tradeoff(paths: list[Path], path: Path) -> None:
    """Validation loss against fp32 (%, mean over seeds with min-max bars) against the bytes a member uploads
    per round (x the default row's payload at that replica count, else x the method's own), one marker per
    method and one colour per replica count, from saved runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [json.loads(Path(p).read_text()) for p in paths]
    fp32 = {(d["settings"]["replicas"], r["seed"]): r["final_val_loss"]  # runs with equal settings reproduce fp32
            for d in loaded for r in d["runs"] if r["method"] == "fp32"}
    unit = {d["settings"]["replicas"]: r["payload_bytes"] for d in loaded for r in d["runs"] if r["method"] == DEFAULT}
    colours = {n: f"C{i}" for i, n in enumerate(sorted({d["settings"]["replicas"] for d in loaded}))}
    fig, ax = plt.subplots(figsize=(9, 6))
    off = []
    for d in loaded:
        runs, replicas = d["runs"], d["settings"]["replicas"]
        base = {seed: v for (n, seed), v in fp32.items() if n == replicas}
        for m in sorted({r["method"] for r in runs} - {"fp32"}):
            mine = [r for r in runs if r["method"] == m and r["seed"] in base]
            if not mine:
                continue
            rel = [100 * (r["final_val_loss"] / base[r["seed"]] - 1) for r in mine]
            x = sum(r["upload_bytes"] / unit.get(replicas, r["payload_bytes"]) for r in mine) / len(mine)
            y = sum(rel) / len(rel)
            if y > YCLIP:  # one diverged row would squash the others: named in a corner instead
                off.append(f"{m} (k={replicas}): {y:+.0f}%")
                continue
            ax.errorbar([x], [y], yerr=[[y - min(rel)], [max(rel) - y]], fmt="o", color=colours[replicas], capsize=3)
            label = m.replace("sparse-k128r-", "").replace("-b0.9-cc", "").replace("a2.5-4.5-", "").replace(
                "shared-", "")
            label = "default, all-gather" if label == "a2.5-4.5" else label
            ax.annotate(f"{label} (k={replicas})", (x, y), textcoords="offset points", fontsize=7,
                        xytext=(6, 0), va="center")
    if off:
        ax.text(0.99, 0.98, "off the chart: " + "; ".join(off), transform=ax.transAxes, ha="right", va="top",
                fontsize=7)
    ax.axhline(0, color="grey", lw=0.8)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("upload per member and round (x the default's payload)")
    ax.set_ylabel("final validation loss vs fp32 DiLoCo (%)")
    ax.set_title("the default codec's all-gather against rules with flat upload")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
