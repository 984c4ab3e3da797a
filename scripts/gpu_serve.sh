#!/usr/bin/env bash
# The whole server on a GPU: `specula-launcher` with one CUDA worker (bfloat16, CUDA graphs) on a random
# ~125M-parameter Llama, driven over HTTP by benchmark/http_load.py at 1, 16 and 64 streams, once with one decode
# step per Step call and once with up to four (--num-scheduler-steps 4). Prepared like scripts/gpu_check.sh: the
# machine's own torch, the project on PYTHONPATH, missing requirements from .gpu-wheels/. About 3 minutes.
#
#   scripts/gpu_serve.sh
#   SERVE_ARGS="--kv-cache-dtype fp8" SCHEDULER_STEPS=1 scripts/gpu_serve.sh    # other launcher flags
#
# Writes to $OUT (default ./gpu-serve-out): steps1.json, steps4.json (http_load's results), each run's server
# log, and serve.log (everything printed).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-serve-out}"
WHEELS="${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}"
PYTHON="${PYTHON:-python3}"
SERVE_ARGS="${SERVE_ARGS:-}"
SCHEDULER_STEPS="${SCHEDULER_STEPS:-1 4}"
export PYTHONPATH="$ROOT/server:$ROOT/kernels:$ROOT/proto:$ROOT/router:$ROOT/launcher:$ROOT/testing${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" "grpcio>=1.85.1" "fastapi>=0.110" \
        "uvicorn>=0.29" "llguidance>=1.9,<2" "gguf>=0.17" 2>&1 | tail -3
    for steps in $SCHEDULER_STEPS; do
        echo "## --num-scheduler-steps $steps $SERVE_ARGS"
        timeout 200 "$PYTHON" "$ROOT/benchmark/http_load.py" --concurrency 1 16 64 --requests-per-client 4 \
            --new-tokens 256 --launcher-args "--device cuda --dtype bfloat16 --num-scheduler-steps $steps $SERVE_ARGS" \
            --json "$OUT/steps$steps.json" --server-log "$OUT/server-steps$steps.log"
        echo "exit status: $?"
    done
} 2>&1 | tee "$OUT/serve.log"
