#!/usr/bin/env bash
# The GPU benchmark in one command, under a time limit (docs/BENCHMARKS.md, "GPU benchmark"):
# bench/gpu_bench.py on the four full-size models of bench/full-size.toml, random weights, bf16.
#
#   bench/gpu_check.sh [LIMIT_SECONDS]        default 540 (the run is sized for 8 minutes)
#
# PYTHON picks the interpreter (default .venv/bin/python, else python3). With OUT set (the device
# machine's output folder) the table goes to $OUT/gpu_bench.md and the whole log to $OUT/gpu_bench.log.
# Exit status: the benchmark's (0 ok, 1 a model failed, 2 no CUDA GPU), 124 when the limit cut it short.
set -euo pipefail
cd "$(dirname "$0")/.."
limit="${1:-540}"
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python="python3"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
log="/dev/null"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    log="$OUT/gpu_bench.log"
fi
timeout --signal=INT --kill-after=30 "$limit" \
    "$python" -m bench.gpu_bench --registry bench/full-size.toml ${OUT:+--out "$OUT"} 2>&1 | tee "$log"
