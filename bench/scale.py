"""``make bench-scale``: real tokenizers, prepared data and larger models on this machine's CPUs.

Parts (``--parts``, all by default; real training throughout, nothing emulated):

* ``swarm``: a byte-level BPE of ``--vocab`` ids is trained on the builtin corpus and the corpus prepared
  into shards; 2 nodes train ``llama-20m`` from them for ``--outer-steps`` rounds. Reported: validation bits
  per byte (first, last), tokens/s per node, each node's memory by part (model, inner optimizer, outer
  state, error feedback: its status) and peak PSS.
* ``precision``: ``llama-20m`` in-process, one replica, 20 outer steps of H = 5: fp32 against bf16 (autocast),
  micro-batches of 2 against whole batches of 8, and activation checkpointing against none: validation loss
  of theta after each run, time per inner step and the peak RSS growth of training, per seed.
* ``150m``: one ``llama-150m`` node on CPU for 2 outer steps of H = 2: tokens/s and peak PSS.
* ``1b``: the host memory of a node's outer state (theta, the round-start copy, error feedback) built as the
  daemon builds it (ReplicaState), in bytes per parameter beyond the model and its inner optimizer:
  ``llama-150m`` through an encode, ``llama-1b`` up to the round's start.
* ``corpus``: resident memory of a process drawing 2,000 batches from a prepared corpus of ``--big-gb`` GB
  of tokens against one of 20 MB.

Results: runs/bench/scale.{json,png}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.compare import PeakMemory
from tests.harness.localswarm import REPO, LocalNode, leave_all, write_json

PARTS = ("swarm", "precision", "150m", "1b", "corpus")


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fresh(code: str, **env) -> dict:
    """Run ``code`` (which prints one JSON value last) in a fresh interpreter, so peak memory is its own."""
    res = subprocess.run([sys.executable, "-c", f"import json; {code}"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, **env})
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def _label(row: dict) -> str:
    """The precision part's name for a run."""
    return ("bf16" if row["precision"] == "bf16" else "micro-batch 2" if row["micro_batch_size"]
            else "checkpointing" if row["activation_checkpointing"] else "fp32")


def prepare_corpus(work: Path, vocab: int) -> tuple[Path, Path]:
    from dilocox.data import iter_documents
    from dilocox.shards import prepare
    from dilocox.tokenizer import train_bpe

    tok = train_bpe(iter_documents("builtin:shakespeare"), vocab, work / "tokenizer.json")
    prepare(iter_documents("builtin:shakespeare"), tok, work / "data", source="builtin:shakespeare")
    return tok.json_path(), work / "data"


def part_swarm(a, work: Path) -> dict:
    tok, data = prepare_corpus(work, a.vocab)
    common = ["--model", "llama-20m", "--tokenizer", str(tok), "--data", str(data), "--seq-len", str(a.seq_len),
              "--batch-size", str(a.batch_size), "--inner-steps", str(a.inner_steps), "--max-outer-steps",
              str(a.outer_steps), "--warmup-steps", "20", "--inner-lr", "1e-3", "--min-replicas", "2",
              "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0", "--run-id", "scale",
              "--matchmaking-time", "5", "--request-timeout", "2", "--eval-batches", "4", "--eval-every", "2",
              "--checkpoint-every", "100"]
    peak = PeakMemory()
    first = LocalNode("n0", work / "n0", common).wait_started()
    second = LocalNode("n1", work / "n1", common + ["--join", first.join_maddr]).wait_started()
    nodes = [first, second]
    for n in nodes:
        peak.watch(n.proc.pid)
    memory = {}
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline and not all(n.proc.poll() is not None for n in nodes):
        for n in nodes:
            try:
                m = n.status().memory
                memory[n.name] = dict(params=m.params_bytes, inner_optimizer=m.inner_optimizer_bytes,
                                      outer=m.outer_optimizer_bytes, error_feedback=m.error_feedback_bytes,
                                      total=m.total_bytes)
            except Exception:
                pass
        time.sleep(2)
    codes = leave_all(nodes, 60)
    peak.stop()
    out = dict(exit_codes=codes, peak_pss_bytes=peak.peaks(), memory=memory, nodes={})
    for n in nodes:
        rows = n.metrics()
        bpb = [(r["outer_step"], r["val_bits_per_byte"]) for r in rows
               if r["val_bits_per_byte"] == r["val_bits_per_byte"]]  # measured rounds (NaN elsewhere)
        out["nodes"][n.name] = dict(rounds=len(rows), bits_per_byte=bpb,
                                    tokens_per_second=statistics.median(r["tokens_per_second"] for r in rows)
                                    if rows else 0.0, digests=[r["digest"] for r in rows],
                                    outcomes=[r["outcome"] for r in rows])
    return out


def _train(precision="fp32", micro=0, checkpointing=False, steps=100, seed=0, inner_steps=5) -> dict:
    """One replica of llama-20m (bytes, seq 128, batch 8) for ``steps`` inner steps with an outer step every
    ``inner_steps``: validation loss of theta, seconds per inner step, peak RSS growth during training."""
    import torch

    from dilocox.data import Corpus, ReplicaShard, validation_batches
    from dilocox.diloco import InnerConfig, InnerLoop, OuterOptimizer
    from dilocox.model import ModelSpec
    from dilocox.stages import build_stage

    torch.manual_seed(seed)
    spec = ModelSpec.resolve("llama-20m")
    corpus = Corpus.from_spec("builtin:shakespeare", 128)
    module = build_stage(spec, seed)
    module.activation_checkpointing = checkpointing
    loop = InnerLoop(module, InnerConfig(lr=1e-3, warmup_steps=10, total_steps=steps, precision=precision,
                                         micro_batch_size=micro))
    shard = ReplicaShard(corpus.train, 128, 8, seed=seed, shard_key=0)
    val = validation_batches(corpus, 128, 8, 4)
    gc.collect()
    base = _rss()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    began = time.monotonic()
    outer = OuterOptimizer(loop.params)  # fp32 DiLoCo's outer step (Nesterov 0.7 / 0.9), one replica
    for step in range(steps):
        loop.inner_step(*shard.next_batch(), global_step=step)
        if (step + 1) % inner_steps == 0:
            with torch.no_grad():
                outer.step([t - p.detach() for t, p in zip(outer.global_params, loop.params)])
            loop.load_params(outer.global_params)
    step_s = (time.monotonic() - began) / steps
    loop.load_params(outer.global_params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # catches the activations' transient peak
    return dict(precision=precision, micro_batch_size=micro, activation_checkpointing=checkpointing,
                val_loss=loop.evaluate(val), step_s=step_s, peak_growth_bytes=peak - base,
                peak_before_training=peak_before, rss_before_training=base)


def part_precision(a, work: Path) -> dict:
    """Each configuration in a fresh process (peak RSS is per process)."""
    rows = []
    for kw in (dict(), dict(precision="bf16"), dict(micro=2), dict(checkpointing=True)):
        for seed in a.seeds:
            row = _fresh(f"from bench.scale import _train; "
                         f"print(json.dumps(_train(steps={a.precision_steps}, seed={seed}, **{kw!r})))",
                         OMP_NUM_THREADS="2")
            row["seed"] = seed
            rows.append(row)
            print(row, flush=True)
    return dict(rows=rows)


def part_150m(a, work: Path) -> dict:
    args = ["--model", "llama-150m", "--seq-len", "256", "--batch-size", "2", "--inner-steps", "2",
            "--max-outer-steps", "2", "--warmup-steps", "2", "--eval-batches", "1", "--listen",
            "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0", "--run-id", "m150", "--checkpoint-every", "100"]
    peak = PeakMemory()
    node = LocalNode("m150", work / "m150", args, threads=2).wait_started(300)
    peak.watch(node.proc.pid)
    code = node.proc.wait(a.timeout)
    peak.stop()
    rows = node.metrics()
    return dict(exit_code=code, rounds=len(rows), peak_pss_bytes=peak.peaks()[0],
                tokens_per_second=[r["tokens_per_second"] for r in rows], val_loss=[r["val_loss"] for r in rows])


def part_1b(a, work: Path) -> dict:
    """In fresh processes: llama-150m through a whole round's outer state (theta, round start, error feedback
    after an encode), and llama-1b built as the daemon builds it (theta and the round-start copy; its encode
    would not fit beside them in this machine's 24 GB)."""
    out = {}
    for preset, encode in (("llama-150m", True), ("llama-1b", False)):
        out[preset] = _fresh(f"from bench.scale import _outer_state; "
                             f"print(json.dumps(_outer_state({preset!r}, {encode})))")
        print(preset, out[preset], flush=True)
    return out


def _outer_state(preset: str, encode: bool) -> dict:
    """Resident bytes of a ReplicaState of ``preset`` (bytes tokenizer, the default sparse codec) beyond its
    model: the inner optimizer's state is created at the first inner step, so what grows here is the outer
    state; ``encode``: also a round's pseudo-gradient encoded (the error feedback buffer exists after it)."""
    from dilocox.daemon.config import NodeConfig
    from dilocox.daemon.replica_state import ReplicaState

    from dilocox.workload import make_workload

    cfg = NodeConfig(model=preset, seq_len=64, batch_size=1, eval_batches=1, inner_steps=2)
    workload = make_workload(cfg.model, cfg.data, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    gc.collect()
    start = _rss()
    state = ReplicaState(cfg, workload, shard_key=1)
    n = sum(p.numel() for p in state.params)
    built = _rss() - start
    state.begin_round()
    began = _rss() - start
    out = dict(params=n, model_bytes=4 * n, inner_optimizer_bytes_when_created=8 * n)
    if encode:
        pg = state.pseudo_gradient()
        state.compressor.begin(pg, state.pseudo_gradient_bounds(1), 1)
        del pg
        gc.collect()
    held = _rss() - start
    out.update(rss_after_build=built, rss_after_begin_round=began, rss_held=held,
               outer_state_bytes_per_param=(held - 4 * n) / n, memory=vars(state.memory()))
    return out


def _draw(folder: str, batches: int) -> dict:
    from dilocox.data import Corpus, ReplicaShard

    gc.collect()
    corpus = Corpus.from_spec(folder, 256)
    base = _rss()
    shard = ReplicaShard(corpus.train, 256, 8, seed=0, shard_key=1)
    for _ in range(batches):
        shard.next_batch()
    return dict(tokens=len(corpus.train), rss_before=base, rss_after=_rss())


def _fake_prepared(folder: Path, tokens: int) -> None:
    """A prepared folder of ``tokens`` uint16 ids (random: only the reading is measured), bytes tokenizer."""
    import numpy as np

    from dilocox.shards import write_index
    from dilocox.tokenizer import byte_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, total in (("train", tokens), ("val", 1 << 16)):
        left, shards = total, []
        while left:
            n = min(left, 1 << 27)
            name = f"{split}-{len(shards):05d}.bin"
            rng.integers(0, 256, size=n, dtype=np.uint16).tofile(folder / name)
            shards.append(dict(file=name, tokens=n))
            left -= n
        splits[split] = dict(shards=shards, tokens=total, bytes=total)
    write_index(folder, byte_tokenizer(), np.uint16, splits, source="random")


def part_corpus(a, work: Path) -> dict:
    out = {}
    for name, tokens in (("20MB", 10_000_000), (f"{a.big_gb:g}GB", int(a.big_gb * 1e9 / 2))):
        folder = work / f"corpus-{name}"
        if not (folder / "index.json").exists():
            _fake_prepared(folder, tokens)
        out[name] = _fresh(f"from bench.scale import _draw; print(json.dumps(_draw({str(folder)!r}, 2000)))")
        print(name, out[name], flush=True)
    small, big = out.values()
    out["rss_ratio"] = big["rss_after"] / small["rss_after"]
    return out


def plot(results: dict, path: Path) -> None:
    """Validation bits per byte of the swarm part per outer step, and the precision part's loss and memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, node in results.get("swarm", {}).get("nodes", {}).items():
        steps, bpb = zip(*node["bits_per_byte"][::2]) if node["bits_per_byte"] else ((), ())
        axes[0].plot(steps, bpb, marker="o", label=f"{name} ({node['tokens_per_second']:.0f} tokens/s)")
    axes[0].set_xlabel("outer step (H = 10)")
    axes[0].set_ylabel("validation bits per byte")
    axes[0].set_title("2 nodes, llama-20m, 8192-token BPE, prepared shards")
    axes[0].legend()
    rows = results.get("precision", {}).get("rows", [])
    names = list(dict.fromkeys(_label(r) for r in rows))
    for k, name in enumerate(names):
        sel = [r for r in rows if _label(r) == name]
        axes[1].bar(k, statistics.mean(r["peak_growth_bytes"] for r in sel) / 2**20, color=f"C{k}")
        axes[1].text(k, 10, f"loss {statistics.mean(r['val_loss'] for r in sel):.4f}\n"
                            f"{statistics.mean(r['step_s'] for r in sel):.2f} s/step", ha="center", color="white")
    axes[1].set_xticks(range(len(names)), names)
    axes[1].set_ylabel("peak RSS growth while training (MiB)")
    axes[1].set_title("llama-20m, one replica, 20 outer steps of H = 5 (mean of seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--outer-steps", type=int, default=20)
    p.add_argument("--precision-steps", type=int, default=100, help="inner steps (an outer step every 5)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--big-gb", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench" / "scale-work")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "scale.json")
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    for part in a.parts:
        began = time.monotonic()
        results[part] = {**globals()[f"part_{part}"](a, a.work), "bench_s": time.monotonic() - began}
        print(part, json.dumps(results[part])[:2000], flush=True)
        write_json(a.out, results)
    plot(results, a.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
