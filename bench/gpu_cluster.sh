#!/usr/bin/env bash
# The clustered-mode benchmark on one NVIDIA GPU (MLX's CUDA backend), in one command, from the
# project root, after the kit is set up:
#
#   source .gpu/kit/setup-on-gpu.sh PART_AA KITDIR && bash bench/gpu_cluster.sh
#
# Builds the random-weight Qwen3-4B-shaped bf16 model under /tmp (bench/gpu_model.py, ~1 min),
# records what MLX's distributed runtime offers here, then runs bench/cluster.py --model, one
# run after another, every rank a process on this machine (two ranks share the one GPU), each
# admitted on its own slice given on its command line (ceiling = total = budget: the Linux
# probes would see the host's RAM, not the GPU), its MLX memory limit set to what it was
# admitted:
#   one      one rank of RANK_GIB
#   ring     two ranks of RANK_GIB each over ring on 127.0.0.1
#   too-big  a per-rank budget (TOO_BIG_GIB; auto: halfway between the least at which two
#            ranks commit at 8 streams and the least at which one rank commits at all) that
#            one rank refuses (its refusal recorded) and two ranks (ring) serve
#   nccl     two ranks over MLX's nccl; where it refuses two ranks on one device (or there is
#            no CUDA build) the refusal, with every rank's reasons and log, is the figure
# at 1, 8 and 32 streams (1 and 8 for too-big) of TOKENS tokens released together, REPEATS
# rounds: aggregate and per-stream tok/s, TTFT, each rank's GPU memory (nvidia-smi per process)
# and RSS against its admitted footprint, the GPU's used memory against the footprints' sum.
# Everything (JSON, markdown, every rank's log, progress log) goes under $OUT (bench/results
# here if unset); the report is rewritten after every run. The whole script keeps to $BUDGET
# seconds (default 520): no run starts with less than 40 s left, no round past the deadline,
# and bench/cluster.py is stopped (its ranks follow it: parent watchdog) at the budget.
#
# Environment:
#   PHASES (one,ring,too-big,nccl), STAGE (engine: every rank on the worker's engine, batched
#   decodes; loop for the per-layer loop; engine falls back to loop by itself if its first run
#   fails), MICRO_BATCHES (2: the engine stage pipelined; 1: one step at a time), PARALLEL (pipeline | tensor), RANK_GIB (24), TOO_BIG_GIB (auto), STREAMS (1,8,32), TOO_BIG_STREAMS (1,8),
#   TOKENS (128), REPEATS (3), CONTEXT (2048), MAX_TOKENS (512), NAME (default
#   cluster-<machine>-<date>), MODEL_DIR (/tmp/qwen3-4b-shaped), BUDGET (520), PRELOAD (''; the
#   OpenBLAS library on the CPU box), MODEL_ARGS (gpu_model.py flags, e.g. --shape small for
#   a dry run), EXTRA (more bench/cluster.py flags: they come last, so they win).
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/bench/results}
MODEL=${MODEL_DIR:-/tmp/qwen3-4b-shaped}
BUDGET=${BUDGET:-520}
NAME_ARGS=()
if [ -n "${NAME:-}" ]; then NAME_ARGS=(--name "$NAME"); fi
LOG=${NAME:-gpu_cluster-$(date -u +%Y%m%dT%H%M%S)}
mkdir -p "$OUT/logs"
say() { echo "[gpu_cluster $(date -u +%T) +$(( $(date +%s) - start ))s] $*"; }

say "python $($PY -c 'import sys; print(sys.version.split()[0])'), PHASES=${PHASES:-one,ring,too-big,nccl}"
timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv \
  > "$OUT/logs/nvidia-smi.csv" 2>&1 || say "no nvidia-smi here"
# shellcheck disable=SC2086
timeout -k 10 200 "$PY" bench/gpu_model.py "$MODEL" ${MODEL_ARGS:-} 2>&1 | tee "$OUT/logs/gpu_model.log"
if [ "${PIPESTATUS[0]}" != 0 ]; then say "model build failed"; exit 1; fi
timeout -k 5 60 "$PY" -c 'from plimsoll.cluster.backend import read_availability
print(read_availability().summary())' 2>&1 | tee "$OUT/logs/backends.txt"

left=$(( BUDGET - ($(date +%s) - start) ))
say "model ready; bench/cluster.py gets ${left}s"
# shellcheck disable=SC2086
timeout -k 30 "$left" "$PY" bench/cluster.py --model "$MODEL" ${NAME_ARGS[@]+"${NAME_ARGS[@]}"} \
  --out-dir "$OUT" --log-dir "$OUT/logs/cluster-ranks" --preload "${PRELOAD:-}" \
  --phases "${PHASES:-one,ring,too-big,nccl}" --stage "${STAGE:-engine}" \
  --micro-batches "${MICRO_BATCHES:-2}" --parallel "${PARALLEL:-pipeline}" \
  --rank-gib "${RANK_GIB:-24}" --too-big-gib "${TOO_BIG_GIB:-auto}" \
  --streams "${STREAMS:-1,8,32}" --too-big-streams "${TOO_BIG_STREAMS:-1,8}" \
  --tokens "${TOKENS:-128}" --repeats "${REPEATS:-3}" --context "${CONTEXT:-2048}" \
  --max-tokens "${MAX_TOKENS:-512}" --deadline-s $(( left - 25 )) --min-run-s 40 \
  --start-timeout 150 ${EXTRA:-} 2>&1 | tee "$OUT/logs/$LOG.log"
rc=${PIPESTATUS[0]}
say "bench/cluster.py exit $rc; results in $OUT"
exit "$rc"
