#!/usr/bin/env bash
# GPU check (issue: real models): two dilocox-node processes train llama-150m in bf16 on CUDA for 3 outer
# steps (one GPU each where two are visible, else both on GPU 0) and print tokens/s, model FLOPs utilization
# (6 x parameters x tokens/s over the card's dense bf16 peak, PEAK_TFLOPS: 989 for an H100 SXM) and peak GPU
# memory per node. Needs a CUDA build of torch; nothing in make test uses it.
#   bash bench/gpu_check.sh            # from the repository root, in the project's venv
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
OUT=${OUT:-runs/gpu-check}
H=${H:-20}
rm -rf "$OUT"; mkdir -p "$OUT"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
second=$([ "$gpus" -ge 2 ] && echo cuda:1 || echo cuda:0)
common=(--model llama-150m --precision bf16 --batch-size 16 --micro-batch-size 8 --inner-steps "$H"
        --max-outer-steps 3 --min-replicas 2 --warmup-steps 10 --run-id gpucheck --eval-batches 2
        --listen /ip4/127.0.0.1/tcp/0 --matchmaking-time 5 --request-timeout 2 --checkpoint-every 100)
"$PY" -m dilocox.daemon.cli "${common[@]}" --device cuda:0 --status-addr 127.0.0.1:0 \
    --checkpoint-dir "$OUT/a" >"$OUT/a.out" 2>"$OUT/a.err" &
a=$!
for _ in $(seq 300); do grep -q "^join with:" "$OUT/a.out" 2>/dev/null && break; sleep 1; done
join=$(awk '/^join with:/ {print $NF}' "$OUT/a.out")
"$PY" -m dilocox.daemon.cli "${common[@]}" --device "$second" --status-addr 127.0.0.1:0 --join "$join" \
    --checkpoint-dir "$OUT/b" >"$OUT/b.out" 2>"$OUT/b.err" &
b=$!
trap 'kill $a $b 2>/dev/null || true' EXIT
wait $a; wait $b
"$PY" - "$OUT" "$PEAK_TFLOPS" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
from dilocox.model import ModelSpec
out, peak = Path(sys.argv[1]), float(sys.argv[2]) * 1e12
spec = ModelSpec.resolve("llama-150m")
from transformers import LlamaConfig, LlamaForCausalLM
import torch
with torch.device("meta"):
    n = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**spec.llama)).parameters())
for node in ("a", "b"):
    rows = [json.loads(l) for l in (out / node / "metrics.jsonl").read_text().splitlines()]
    tps = statistics.median(r["tokens_per_second"] for r in rows)
    print(f"node {node}: {len(rows)} outer steps, {tps:,.0f} tokens/s, MFU {6 * n * tps / peak:.1%} "
          f"({n / 1e6:.0f} M parameters, bf16 peak {peak / 1e12:.0f} TFLOPS), peak GPU memory "
          f"{max(r['device_peak_bytes'] for r in rows) / 2**30:.2f} GiB, digests {[r['digest'][:8] for r in rows]}")
PYEOF
