#!/usr/bin/env bash
# How MLX's CUDA backend batching its kernels into CUDA graphs sets an engine step's cost.
#
# MLX (mlx/backend/cuda/device.cpp) records kernels into a CUDA graph and launches it once the
# graph holds MLX_MAX_OPS_PER_BUFFER nodes or its inputs MLX_MAX_MB_PER_BUFFER megabytes (100
# and 1000 on an H100/H200: a 7.49 GiB model's decode step launches ~10-20 graphs, each
# updated and launched from the host). This runs bench/gpu_step.py's in-process engine steps
# (eager and compiled decode, verifying steps; 1 and 8 rows) once per setting of those knobs,
# and mlx_lm's own generator at 1 stream under the same settings (does the anchor gain too?).
# From the project root, after the kit is set up (the model built by bench/gpu_model.py):
#
#   source .gpu/kit/setup-on-gpu.sh PART_AA KITDIR && bash bench/gpu_graphs.sh
#
# Environment: OUT (bench/results), MODEL_DIR (/tmp/qwen3-4b-shaped), NAME (gpu-graphs-DATE),
# SETTINGS (space-separated; each a comma list of VAR=VALUE, "default" for none), ROUNDS (1: the
# settings' list run this many times over, interleaved), STEPS (40), COMPILE (off,on).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/bench/results}
MODEL=${MODEL_DIR:-/tmp/qwen3-4b-shaped}
NAME=${NAME:-gpu-graphs-$(date -u +%Y-%m-%d)}
SETTINGS=${SETTINGS:-"default MLX_MAX_MB_PER_BUFFER=1000000,MLX_MAX_OPS_PER_BUFFER=250 MLX_USE_CUDA_GRAPHS=0"}
ROUNDS=${ROUNDS:-1}
STEPS=${STEPS:-40}
COMPILE=${COMPILE:-off,on}
mkdir -p "$OUT/logs"
if [ ! -f "$MODEL/config.json" ]; then
  timeout -k 10 200 "$PY" bench/gpu_model.py "$MODEL" 2>&1 | tail -3
fi
i=0
for s in $(for _ in $(seq "$ROUNDS"); do echo $SETTINGS; done); do
  i=$((i + 1))
  envs=()
  if [ "$s" != default ]; then IFS=, read -r -a envs <<< "$s"; fi
  echo "== setting $i: $s (load $(cut -d" " -f1-3 /proc/loadavg))"
  (cd bench && env ${envs[@]+"${envs[@]}"} timeout -k 10 150 "$PY" gpu_step.py --model "$MODEL" \
    --parts engine --rows 1,8 --compile "$COMPILE" --steps "$STEPS" --out-dir "$OUT" --name "$NAME-$i") \
    2>&1 | grep -v "^kernels" | tee "$OUT/logs/$NAME-$i.log"
  env ${envs[@]+"${envs[@]}"} timeout -k 10 90 "$PY" -m mlx_lm generate --model "$MODEL" \
    --prompt "the quick brown fox jumps over the lazy dog" --max-tokens 300 \
    --ignore-chat-template 2>&1 | grep -i "generation\|prompt:" | tee -a "$OUT/logs/$NAME-$i.log"
done
