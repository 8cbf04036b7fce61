#!/usr/bin/env bash
# GPU check: dilocox nodes train MODEL (llama-150m) on CUDA, one node per visible GPU (SINGLE=1: one node), for
# ROUNDS outer steps of H inner steps, after a bare transformers loop of the same model on GPU 0
# (bench/bare_loop.py); then bench/gpu_report.py prints, per node and for the bare loop: tokens/s, MFU with
# attention counted (FLOPs/token = 6 N + 12 L T d: N the parameters that multiply, L layers, T seq_len, d hidden
# size; over PEAK_TFLOPS, 989 for an H100 SXM in bf16), peak GPU memory, and the outer round's cost per phase
# from metrics.jsonl (encode, group, gather, aggregate, apply, exchange, and the time training was blocked).
# Precision is --precision auto (bf16 on an Ampere or later card); COMPILE=1 (the default) adds --compile.
# Needs a CUDA build of torch; nothing in make test uses it. CPU=1 runs the same steps on the CPU (MODEL=tiny),
# to check the script itself: its MFU means nothing.
#   bash bench/gpu_check.sh                    # from the repository root, in the project's venv
#   SINGLE=1 H=50 bash bench/gpu_check.sh      # one node
#   NODES=2 bash bench/gpu_check.sh            # two nodes even on one GPU (both on it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
OUT=${OUT:-runs/gpu-check}
MODEL=${MODEL:-llama-150m}
H=${H:-20}
ROUNDS=${ROUNDS:-3}
BATCH=${BATCH:-16}
MICRO=${MICRO:-0}
COMPILE=${COMPILE:-1}
rm -rf "$OUT"; mkdir -p "$OUT"
if [ "${CPU:-0}" = 1 ]; then
    gpus=1
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
fi
nodes=${NODES:-$gpus}
[ "${SINGLE:-0}" = 1 ] && nodes=1
# each process sees only its GPU, as cuda:0: the node's peak-memory reading asks the current device
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"; else ids=($(seq 0 $((gpus - 1)))); fi
gpu() { echo "${ids[$(($1 % gpus))]}"; }
device=cuda:0; [ "${CPU:-0}" = 1 ] && device=cpu
compile=(); [ "$COMPILE" = 1 ] && compile=(--compile)
micro=(); [ "$MICRO" != 0 ] && micro=(--micro-batch-size "$MICRO")

# the ceiling first, alone on the card the first node uses
CUDA_VISIBLE_DEVICES=$(gpu 0) "$PY" -m bench.bare_loop --model "$MODEL" --device "$device" --batch-size "$BATCH" "${micro[@]}" \
    "${compile[@]}" --peak-tflops "$PEAK_TFLOPS" --out "$OUT/bare.json" >"$OUT/bare.out" 2>"$OUT/bare.err"

common=(--model "$MODEL" --precision auto --batch-size "$BATCH" "${micro[@]}" "${compile[@]}" --inner-steps "$H"
        --max-outer-steps "$ROUNDS" --min-replicas "$nodes" --warmup-steps 10 --run-id gpucheck --eval-batches 2
        --listen /ip4/127.0.0.1/tcp/0 --matchmaking-time 5 --request-timeout 2 --checkpoint-every 100
        --status-addr 127.0.0.1:0)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
join=()
for k in $(seq 0 $((nodes - 1))); do
    CUDA_VISIBLE_DEVICES=$(gpu "$k") "$PY" -m dilocox.daemon.cli "${common[@]}" "${join[@]}" --device "$device" \
        --checkpoint-dir "$OUT/n$k" >"$OUT/n$k.out" 2>"$OUT/n$k.err" &
    pids+=($!)
    if [ "$k" = 0 ] && [ "$nodes" -gt 1 ]; then
        for _ in $(seq 300); do grep -q "^join with:" "$OUT/n0.out" 2>/dev/null && break; sleep 1; done
        join=(--join "$(awk '/^join with:/ {print $NF}' "$OUT/n0.out")")
    fi
done
for p in "${pids[@]}"; do wait "$p"; done
"$PY" -m bench.gpu_report "$OUT" --model "$MODEL" --batch-size "$BATCH" --inner-steps "$H" --peak-tflops "$PEAK_TFLOPS"
