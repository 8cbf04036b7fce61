"""Peak host memory of a node per parameter, on the EMULATED workload (``make bench-node-memory``).

Two ``dilocox-node`` processes on loopback train ``--workload synthetic:VALUES:STEP_S`` (dilocox/synthetic.py:
compute is a sleep over VALUES fp32 values, so what is measured is the node's own memory: parameters, theta,
error feedback, the round's pseudo-gradient, codec, aggregation, outer step, digests and what is served) with
``--min-replicas 2``, so that every round after the first is a group round of two. The main process's peak
resident set (``VmHWM``, /proc/PID/status) is read while it runs; the same run with one value per node gives the
process's own footprint (torch, hivemind, the interpreter), which is subtracted. Bytes per value = (peak - that
footprint) / VALUES. The synthetic "model" is one fp32 copy of the parameters with no inner optimizer state, so a
whole-model node's figure beyond its model and inner optimizer is the result minus 4.

No quality is claimed from it.

    python -m bench.node_memory --values 100M 200M
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dilocox.synthetic import parse_spec
from tests.harness.localswarm import LocalNode


def _status(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_pair(values: str, step_s: float, inner_steps: int, rounds: int, extra: list[str], timeout: float) -> dict:
    """Two nodes for ``rounds`` rounds; each one's peak VmHWM (bytes) and its metrics rows' outcomes."""
    with tempfile.TemporaryDirectory(prefix="node-memory-") as tmp:
        args = ["--workload", f"synthetic:{values}:{step_s}", "--inner-steps", str(inner_steps), "--max-outer-steps",
                str(rounds), "--min-replicas", "2", "--status-addr", "127.0.0.1:0", *extra]
        a = LocalNode("a", Path(tmp) / "a", args).wait_started()
        b = LocalNode("b", Path(tmp) / "b", [*args, "--join", a.join_maddr]).wait_started()
        peak = {"a": 0, "b": 0}
        deadline = time.monotonic() + timeout
        try:
            while (a.proc.poll() is None or b.proc.poll() is None) and time.monotonic() < deadline:
                for n in (a, b):
                    if n.proc.poll() is None:
                        peak[n.name] = max(peak[n.name], _status(n.proc.pid, "VmHWM"))
                time.sleep(0.2)
        finally:
            for n in (a, b):
                if n.proc.poll() is None:
                    n.terminate()
        rows = a.metrics()
        return dict(peak=peak, outcomes=[r["outcome"] for r in rows], phases=phases(rows))


PHASES = ("compute_s", "encode_s", "exchange_s", "aggregate_s", "apply_s", "wait_s", "duration_s")


def phases(rows: list[dict]) -> dict:
    """Median seconds per phase over the group rounds after the first (RoundInfo's fields in metrics.jsonl)."""
    grouped = [r for r in rows if r.get("group_size", 1) > 1][1:]
    return {k: statistics.median(float(r.get(k, 0.0)) for r in grouped) for k in PHASES} if grouped else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", nargs="+", default=["100M"], help="VALUES of the synthetic workload, e.g. 200M")
    p.add_argument("--step-s", type=float, default=0.3)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None)
    args, extra = p.parse_known_args(argv)
    base = run_pair("1", args.step_s, args.inner_steps, 3, extra, args.timeout)
    footprint = statistics.median(base["peak"].values())
    rows = []
    for spec in args.values:
        n, _ = parse_spec(f"synthetic:{spec}:0")
        got = run_pair(spec, args.step_s, args.inner_steps, args.rounds, extra, args.timeout)
        per = {k: (v - footprint) / n for k, v in got["peak"].items()}
        rows.append(dict(values=n, spec=spec, peak=got["peak"], bytes_per_value=per, outcomes=got["outcomes"],
                         phases=got["phases"]))
        print(f"{spec}: peak {', '.join(f'{k} {v / 1e9:.2f} GB' for k, v in got['peak'].items())}; "
              f"{', '.join(f'{k} {v:.1f}' for k, v in per.items())} bytes/value; rounds {got['outcomes']}", flush=True)
    print(f"\nEMULATED workload (synthetic), 2 nodes, H = {args.inner_steps}, {args.rounds} rounds, flags "
          f"{' '.join(extra) or '(defaults)'}; process footprint {footprint / 1e9:.2f} GB subtracted\n")
    print("| values | peak VmHWM per node | bytes per value (median of 2 nodes) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['spec']} | {' / '.join(f'{v / 1e9:.2f} GB' for v in r['peak'].values())} | "
              f"{statistics.median(r['bytes_per_value'].values()):.1f} |")
    print("\nnode a, median seconds per group round after the first:\n")
    print("| values | " + " | ".join(PHASES) + " |\n|---|" + "---|" * len(PHASES))
    for r in rows:
        print(f"| {r['spec']} | " + " | ".join(f"{r['phases'].get(k, float('nan')):.2f}" for k in PHASES) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(footprint=footprint, rows=rows, flags=extra), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
