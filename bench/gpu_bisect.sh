#!/usr/bin/env bash
# On a GPU lease: which custom kernel makes a family's batched greedy tokens differ from
# mlx-lm's where the reference's margin is not a near tie (bench/conformance_margin.py)?
# Runs the families once with every kernel that passes its start-time check, once more with
# MLX's TF32 products off (MLX_ENABLE_TF32=0: on the CPU, bench/lib/tf32.py's emulation
# reproduced qwen3_5's difference exactly), once with mixture-of-experts products unsorted
# (--gather-unsorted), then once with each kernel refused in turn
# (--refuse), then with all of them refused; the verdicts land in
# $OUT/bisect-*.{json,md} and a summary line each in $OUT/bisect.txt. A kernel whose refusal
# alone makes the family equal is the one to read.
#
#   FAMILIES=qwen3_5,gpt_oss CHUNK=32 OUT=/tmp/out bash bench/gpu_bisect.sh
#
# Bounded: each run has its own timeout (EACH_S, default 90 s) and the whole script stops
# starting runs once BUDGET (default 540 s) is spent.
set -u
cd "$(dirname "$0")"
FAMILIES=${FAMILIES:-qwen3_5,gpt_oss}
KERNELS=${KERNELS:-paged_decode_cuda,pool_write_cuda,pool_gather_cuda,skinny_matmul_cuda,paged_decode_writing_cuda}
OUT=${OUT:-/tmp/out}; EACH_S=${EACH_S:-90}; BUDGET=${BUDGET:-540}
PY=${PY:-python3}
mkdir -p "$OUT/logs"
start=$(date +%s)
summary="$OUT/bisect.txt"
: > "$summary"
one() {  # name, refuse-list ('' for none)[, environment assignment[, more arguments]]
  local name=$1 refuse=$2 envs=${3:-MLX_ENABLE_TF32=1} more=${4:-}
  if [ $(( $(date +%s) - start + EACH_S )) -gt "$BUDGET" ]; then
    echo "$name: skipped (budget)" >> "$summary"; return
  fi
  local args=(--families "$FAMILIES" --chunk "${CHUNK:-32}" --out-dir "$OUT" --name "bisect-$name")
  [ -n "$refuse" ] && args+=(--refuse "$refuse")
  [ -n "$more" ] && args+=($more)
  env "$envs" PYTHONPATH=../python timeout -k 5 "$EACH_S" $PY conformance_margin.py "${args[@]}" \
    > "$OUT/logs/bisect-$name.log" 2>&1
  local rc=$?
  echo "$name (refused: ${refuse:-none}) rc $rc: $($PY - "$OUT/bisect-$name.json" <<'PYEOF'
import json, sys
try:
    fams = [f for f in json.load(open(sys.argv[1]))["families"] if f.get("served")]
except (OSError, ValueError, KeyError) as err:
    print(f"no result ({type(err).__name__})")
else:
    print("defects: " + (", ".join(f["family"] for f in fams if f["defect"]) or "none")
          + "; kernels used: " + "; ".join(f"{f['family']} {','.join(f['kernels']) or '-'}"
                                           for f in fams))
PYEOF
)" >> "$summary"
}
one all ""
one no-tf32 "" MLX_ENABLE_TF32=0
one moe-unsorted "" MLX_ENABLE_TF32=1 --gather-unsorted
IFS=, read -ra ks <<< "$KERNELS"
for k in "${ks[@]}"; do one "no-$k" "$k"; done
one none "$KERNELS"
cat "$summary"
