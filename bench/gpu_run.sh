#!/usr/bin/env bash
# Issue 14's scale benchmark on the NVIDIA H200 (MLX's CUDA backend), in one command, from the
# project root, after the kit is set up:
#
#   source .gpu/kit/setup-on-gpu.sh PART_AA KITDIR && bash bench/gpu_run.sh
#
# Builds the random-weight Qwen3-4B-shaped bf16 model under /tmp (bench/gpu_model.py, ~1 min),
# then runs bench/scale.py: mlx_lm.server (defaults) against `plimsoll launch … --concurrency 8
# --context 40960 --max-tokens 2048` (and `--concurrency 32 --context 4096` for 32 streams);
# agentic session 12 turns to ~29k tokens, 1-stream decode, 8 and 32 streams × 256 tokens,
# 4 streams stalled by a ~31.6k-token prompt, 8 sub-agents sharing a 16k system prompt.
# Everything (JSON, markdown, server logs, progress log) goes under $OUT (bench/results here
# if unset). The whole script keeps to $BUDGET seconds (default 530): scale.py starts no
# server group with less than 45 s left, and is stopped (servers and all) at the budget; what
# it measured by then is written.
#
# Environment:
#   PHASES  comma list, run in this order (default decode,streams8,stall,streams32,subagents,
#           agentic: the figures issue 14 marks as misses first, so a deadline skips the
#           agentic session, whose memory figures are already known). If the whole run does
#           not fit, two calls:
#             PHASES=decode,streams8,stall,streams32 NAME=scale-h200-a bash bench/gpu_run.sh
#             PHASES=subagents,agentic NAME=scale-h200-b bash bench/gpu_run.sh
#   ORDER   anchor-first (default) | candidate-first
#   NAME    output base name (default scale-h200; add the order/phases if you split runs)
#   MODEL_DIR (default /tmp/qwen3-4b-shaped), BUDGET (530), EXTRA (more scale.py flags: they
#   come last, so they win), MODEL_ARGS (gpu_model.py flags, e.g. --shape small for a dry run)
#
# PHASES=overhead runs bench/overhead.py instead of scale.py (the serving stack's overhead
# per decode step: the engine and the scheduler in process, mlx-lm's generators in process,
# plimsoll's worker and mlx_lm.server over HTTP; 1, 8, 32 streams; NAME default
# overhead-h200; OVERHEAD_ARGS adds overhead.py flags, e.g. --tokens 128 --rounds 1):
#   PHASES=overhead bash bench/gpu_run.sh
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/bench/results}
NAME=${NAME:-scale-h200}
MODEL=${MODEL_DIR:-/tmp/qwen3-4b-shaped}
PHASES=${PHASES:-decode,streams8,stall,streams32,subagents,agentic}
ORDER=${ORDER:-anchor-first}
BUDGET=${BUDGET:-530}
mkdir -p "$OUT/logs"
say() { echo "[gpu_run $(date -u +%T) +$(( $(date +%s) - start ))s] $*"; }

say "python $($PY -c 'import sys; print(sys.version.split()[0])'), PHASES=$PHASES ORDER=$ORDER"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/logs/nvidia-smi.csv" 2>&1
# shellcheck disable=SC2086
timeout -k 10 200 "$PY" bench/gpu_model.py "$MODEL" ${MODEL_ARGS:-} 2>&1 | tee "$OUT/logs/gpu_model.log"
if [ "${PIPESTATUS[0]}" != 0 ]; then say "model build failed"; exit 1; fi

left=$(( BUDGET - ($(date +%s) - start) ))
if [ "$PHASES" = overhead ]; then
  [ "$NAME" = scale-h200 ] && NAME=overhead-h200
  say "model ready; overhead.py gets ${left}s"
  # shellcheck disable=SC2086
  timeout -k 30 "$left" "$PY" bench/overhead.py --model "$MODEL" --name "$NAME" \
    --out-dir "$OUT" --log-dir "$OUT/logs" --preload '' --tokens 256 --rounds 2 --ready-timeout 150 \
    --request-timeout 120 --py-spy "$OUT/logs/py-spy" ${OVERHEAD_ARGS:-} \
    2>&1 | tee "$OUT/logs/$NAME.log"
  rc=${PIPESTATUS[0]}
  say "overhead.py exit $rc; results: $OUT/$NAME.json $OUT/$NAME.md"
  exit "$rc"
fi
say "model ready; scale.py gets ${left}s"
# shellcheck disable=SC2086
timeout -k 30 "$left" "$PY" bench/scale.py --model "$MODEL" --name "$NAME" \
  --out-dir "$OUT" --log-dir "$OUT/logs" --phases "$PHASES" --order "$ORDER" --preload '' \
  --candidate-cmd '{python} -m plimsoll.cli launch {model} --host {host} --port {port} --concurrency 8 --context 40960 --max-tokens 2048' \
  --candidate-wide-cmd '{python} -m plimsoll.cli launch {model} --host {host} --port {port} --concurrency 32 --context 4096 --max-tokens 512' \
  --turns 12 --tool-tokens 2400 --decode-tokens 256 --streams 8,32 --stream-tokens 256 \
  --stall-streams 4 --stall-prompt-tokens 31500 --stall-stream-tokens 2048 \
  --sub-agents 8 --sub-prefix-tokens 16000 --sub-task-tokens 500 --sub-max-tokens 32 \
  --warmup-tokens 1024 --copy-gib 4 --mem-source auto --sample-interval 0.1 --ready-timeout 150 \
  --request-timeout 120 --deadline-s $(( left - 15 )) --min-group-s 45 ${EXTRA:-} \
  2>&1 | tee "$OUT/logs/$NAME.log"
rc=${PIPESTATUS[0]}
say "scale.py exit $rc; results: $OUT/$NAME.json $OUT/$NAME.md"
exit "$rc"
