#!/usr/bin/env bash
# The serving benchmark on an NVIDIA GPU (MLX's CUDA backend), in one command, from the project
# root, after the kit is set up:
#
#   source .gpu/kit/setup-on-gpu.sh PART_AA KITDIR && bash bench/gpu_run.sh
#
# Builds the random-weight Qwen3-4B-shaped bf16 model under /tmp (bench/gpu_model.py, ~1 min),
# then runs bench/serving.py: mlx_lm.server (defaults) against `plimsoll launch … --concurrency 8
# --context 40960 --max-tokens 2048` (and `--concurrency 32 --context 4096` for 32 streams);
# agentic session 12 turns to ~29k tokens, 1-stream decode, 8 and 32 streams × 256 tokens,
# 4 streams stalled by a ~31.6k-token prompt, 8 sub-agents sharing a 16k system prompt.
# Everything (JSON, markdown, server logs, progress log) goes under $OUT (bench/results here
# if unset). The whole script keeps to $BUDGET seconds (default 530): serving.py starts no
# server group with less than 45 s left, and is stopped (servers and all) at the budget; what
# it measured by then is written.
#
# Environment:
#   PHASES  comma list, run in this order (default decode,streams8,stall,streams32,subagents,
#           agentic: the throughput figures first, so a deadline skips the agentic session,
#           whose memory figures are the slowest to gather). If the whole run does not fit,
#           two calls:
#             PHASES=decode,streams8,stall,streams32 NAME=serving-h200-DATE-a bash bench/gpu_run.sh
#             PHASES=subagents,agentic NAME=serving-h200-DATE-b bash bench/gpu_run.sh
#   ORDER   anchor-first (default) | candidate-first
#   NAME    output base name (default: the script's, <measurement>-<machine>-<date>)
#   MODEL_DIR (default /tmp/qwen3-4b-shaped; REUSE_MODEL=1 skips the build where one is there),
#   BUDGET (530), EXTRA (more serving.py flags: they
#   come last, so they win), MODEL_ARGS (gpu_model.py flags, e.g. --shape small for a dry run)
#   KV_QUANT=1  the quantized-KV comparison instead (bench/serving.py --kv): the agentic
#           session, 1-stream decode and 8 streams on mlx_lm.server (defaults), then plimsoll at
#           the model's dtype (bf16), q8 and q4 (`launch --kv-dtype`), all phases on one server
#           each; KV (default auto,q8,q4) picks the plimsoll runs, TURNS (12) and TOOL_TOKENS
#           (2400: ~29k tokens at turn 12) size the session; EXTRA adds serving.py flags
#           (EXTRA='--only candidate' skips mlx_lm.server: a second call when one run does not
#           fit the budget).
#
# PHASES=overhead runs bench/overhead.py instead (the serving stack's overhead per decode
# step: the engine and the scheduler in process, mlx-lm's generators in process, plimsoll's
# worker and mlx_lm.server over HTTP; 1, 8, 32 streams; OVERHEAD_ARGS adds overhead.py flags,
# e.g. --tokens 128 --rounds 1):
#   PHASES=overhead bash bench/gpu_run.sh
#
# STEP=1 first runs bench/gpu_step.py on the same model (~80 s: the linear layers at 1-32
# rows, cuBLAS against the engine's few-row kernel; the engine's decode and verifying steps at
# 1, 4 and 8 rows with in-place and with scatter pool writes, compiled decode too):
#   STEP=1 PHASES=decode,streams8 bash bench/gpu_run.sh
#
# SPECULATIVE=SECONDS keeps the budget's last SECONDS for bench/speculative.py on the same
# model after serving.py (prompt lookup at ~100 % and ~0.8 acceptance, 1 and 8 streams, beside
# plimsoll plain and mlx_lm.server; SPEC_ARGS adds flags, e.g. --before-code DIR). It writes
# its results only at its end: give it ~240 s.
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/bench/results}
MODEL=${MODEL_DIR:-/tmp/qwen3-4b-shaped}
PHASES=${PHASES:-decode,streams8,stall,streams32,subagents,agentic}
ORDER=${ORDER:-anchor-first}
BUDGET=${BUDGET:-530}
NAME_ARGS=()
if [ -n "${NAME:-}" ]; then NAME_ARGS=(--name "$NAME"); fi
LOG=${NAME:-gpu_run-$(date -u +%Y%m%dT%H%M%S)}
mkdir -p "$OUT/logs"
say() { echo "[gpu_run $(date -u +%T) +$(( $(date +%s) - start ))s] $*"; }

say "python $($PY -c 'import sys; print(sys.version.split()[0])'), PHASES=$PHASES ORDER=$ORDER"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/logs/nvidia-smi.csv" 2>&1
if [ "${REUSE_MODEL:-0}" = 1 ] && [ -f "$MODEL/config.json" ]; then
  say "reusing the model at $MODEL"
else
  # shellcheck disable=SC2086
  timeout -k 10 200 "$PY" bench/gpu_model.py "$MODEL" ${MODEL_ARGS:-} 2>&1 | tee "$OUT/logs/gpu_model.log"
  if [ "${PIPESTATUS[0]}" != 0 ]; then say "model build failed"; exit 1; fi
fi

if [ "${STEP:-0}" = 1 ]; then
  say "gpu_step.py"
  (cd bench && timeout -k 10 150 "$PY" gpu_step.py --model "$MODEL" --rows 1,4,8 --compile off,on \
    --steps 40 --reps 5 --out-dir "$OUT" ${NAME:+--name "$NAME-step"}) 2>&1 | tee "$OUT/logs/$LOG-step.log"
fi
SPEC_S=${SPECULATIVE:-0}
left=$(( BUDGET - ($(date +%s) - start) - SPEC_S ))
if [ "${KV_QUANT:-0}" = 1 ]; then
  say "model ready; serving.py --kv gets ${left}s (KV=${KV:-auto,q8,q4})"
  # shellcheck disable=SC2086
  timeout -k 30 "$left" "$PY" bench/serving.py --model "$MODEL" ${NAME_ARGS[@]+"${NAME_ARGS[@]}"} \
    --kv "${KV:-auto,q8,q4}" --out-dir "$OUT" --log-dir "$OUT/logs" --preload '' \
    --phases agentic,decode,streams8 --fresh-phases '' --targets none --copy-gib 4 \
    --candidate-cmd '{python} -m plimsoll.cli launch {model} --host {host} --port {port} --concurrency 8 --context 40960 --max-tokens 2048' \
    --turns "${TURNS:-12}" --tool-tokens "${TOOL_TOKENS:-2400}" --decode-tokens 256 \
    --streams 8 --stream-tokens 256 --ready-timeout 150 --request-timeout 120 \
    --deadline-s $(( left - 15 )) --min-group-s 45 ${EXTRA:-} 2>&1 | tee "$OUT/logs/$LOG.log"
  rc=${PIPESTATUS[0]}
  say "serving.py exit $rc; results in $OUT"
  exit "$rc"
fi
if [ "$PHASES" = overhead ]; then
  say "model ready; overhead.py gets ${left}s"
  # shellcheck disable=SC2086
  timeout -k 30 "$left" "$PY" bench/overhead.py --model "$MODEL" ${NAME_ARGS[@]+"${NAME_ARGS[@]}"} \
    --out-dir "$OUT" --log-dir "$OUT/logs" --preload '' --tokens 256 --rounds 2 --ready-timeout 150 \
    --request-timeout 120 --py-spy "$OUT/logs/py-spy" ${OVERHEAD_ARGS:-} \
    2>&1 | tee "$OUT/logs/$LOG.log"
  rc=${PIPESTATUS[0]}
  say "overhead.py exit $rc; results in $OUT"
  exit "$rc"
fi
say "model ready; serving.py gets ${left}s"
# shellcheck disable=SC2086
timeout -k 30 "$left" "$PY" bench/serving.py --model "$MODEL" ${NAME_ARGS[@]+"${NAME_ARGS[@]}"} \
  --out-dir "$OUT" --log-dir "$OUT/logs" --phases "$PHASES" --order "$ORDER" --preload '' \
  --candidate-cmd '{python} -m plimsoll.cli launch {model} --host {host} --port {port} --concurrency 8 --context 40960 --max-tokens 2048' \
  --candidate-wide-cmd '{python} -m plimsoll.cli launch {model} --host {host} --port {port} --concurrency 32 --context 4096 --max-tokens 512' \
  --turns 12 --tool-tokens 2400 --decode-tokens 256 --streams 8,32 --stream-tokens 256 \
  --stall-streams 4 --stall-prompt-tokens 31500 --stall-stream-tokens 2048 \
  --sub-agents 8 --sub-prefix-tokens 16000 --sub-task-tokens 500 --sub-max-tokens 32 \
  --warmup-tokens 1024 --copy-gib 4 --mem-source auto --sample-interval 0.1 --ready-timeout 150 \
  --request-timeout 120 --deadline-s $(( left - 15 )) --min-group-s 45 ${EXTRA:-} \
  2>&1 | tee "$OUT/logs/$LOG.log"
rc=${PIPESTATUS[0]}
say "serving.py exit $rc; results in $OUT"
if [ "$SPEC_S" -gt 0 ]; then
  left=$(( BUDGET - ($(date +%s) - start) ))
  say "speculative.py gets ${left}s"
  # shellcheck disable=SC2086
  timeout -k 10 "$left" "$PY" bench/speculative.py --model "$MODEL" --runs 2 \
    --regimes repeat --noise 0.2 --streams 1,8 --out-dir "$OUT" --dir /tmp/speculative \
    ${NAME:+--name "$NAME-speculative"} ${SPEC_ARGS:-} 2>&1 | tee "$OUT/logs/$LOG-speculative.log"
  say "speculative.py exit ${PIPESTATUS[0]}"
fi
exit "$rc"
