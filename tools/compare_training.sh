#!/usr/bin/env bash
# Bitwise before/after check of a change that must not change training: two `moecore` binaries
# (e.g. the commit before and after, built side by side on this machine) train the same fixed
# runs and every logged value of every step must be identical (lm, aux and z losses, grad norm,
# expert loads, dropped tokens), and so must the final weights' digest. Committed fixtures cannot
# serve here: oneDNN picks ISA-specific kernels, so the bits differ between CPU models.
#
#   bash tools/compare_training.sh BEFORE/moecore AFTER/moecore [--quick]
#
# Building the commit before the change: git worktree add /tmp/before HEAD~1 &&
#   (cd /tmp/before && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release &&
#    cmake --build build --target moecore)
# --quick runs 8 steps instead of 30. Exit status 0: identical; 1: a run differs (named).
set -euo pipefail
before=$(realpath "$1")
after=$(realpath "$2")
iters=30
[[ "${3:-}" == "--quick" ]] && iters=8
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# Fixed runs: the tiny model with explicit flags (no dependence on the defaults of either
# binary). The load balancing is given per run, not by the config file, so no list flag is
# given twice.
grep -v -e '^moe-router-load-balancing-type' -e '^moe-aux-loss-coeff' configs/tiny.toml \
  > "$work/tiny.toml"
base=(--config "$work/tiny.toml" --train-iters "$iters" --lr-warmup-iters 2
      --lr-decay-iters "$iters" --log-interval 1)
aux="--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01"
declare -A runs=(
  [tiny]="$aux"
  [tiny_bf16]="$aux --bf16"
  [sigmoid_bias_groups]="--moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-load-balancing-type none --moe-aux-loss-coeff 0"
  [quantile_bf16]="--bf16 --moe-router-load-balancing-type quantile_balancing
    --moe-aux-loss-coeff 0"
  [shared_dense_recompute_bf16]="$aux --bf16 --moe-shared-expert-intermediate-size 64
    --moe-layer-freq ([0]*1+[1]*1) --recompute-granularity selective
    --recompute-modules layernorm moe_act shared_experts mlp"
  [capacity_padding]="$aux --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"
  [capacity_dropping_bf16]="$aux --moe-expert-capacity-factor 0.8 --bf16"
  [gqa_qkv_bias_qk_norm]="$aux --group-query-attention --num-query-groups 2 --add-qkv-bias
    --qk-layernorm"
  [jitter_z_full_recompute_eval]="$aux --moe-input-jitter-eps 0.01 --moe-z-loss-coeff 1e-3
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --mock-data --eval-interval 4 --eval-iters 2"
)
mpi_runs=(ep2_alltoall ep2_alltoall_bf16 ep2_allgather ep2_alltoall_capacity)
declare -A mpi_flags=(
  [ep2_alltoall_capacity]="$aux --expert-model-parallel-size 2 --micro-batch-size 4
    --moe-expert-capacity-factor 0.8"
  [ep2_alltoall]="$aux --expert-model-parallel-size 2 --micro-batch-size 4"
  [ep2_allgather]="$aux --expert-model-parallel-size 2 --micro-batch-size 4
    --moe-token-dispatcher-type allgather"
  [ep2_alltoall_bf16]="$aux --expert-model-parallel-size 2 --micro-batch-size 4 --bf16"
)

run_one() {  # name binary tag [mpi] flags...
  local name=$1 bin=$2 tag=$3 mpi=$4
  shift 4
  local out="$work/$name.$tag"
  local cmd=("$bin" train "${base[@]}" "$@" --metrics-file "$out.jsonl")
  if [[ "$mpi" == 1 ]]; then
    cmd=(mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1
         $( [[ $(id -u) == 0 ]] && echo --allow-run-as-root ) "${cmd[@]}")
  fi
  if ! "${cmd[@]}" > "$out.log" 2>&1; then
    echo "FAILED to run ($tag): ${cmd[*]}"
    tail -5 "$out.log"
    return 1
  fi
}

status=0
compare() {  # name
  local name=$1
  python3 - "$work/$name.before" "$work/$name.after" "$name" <<'EOF' || status=1
import json, sys
a_path, b_path, name = sys.argv[1:]
# Training steps, and the evaluations' records (valid_* / test_*) where a run evaluates.
keys = ("lm_loss", "aux_loss", "z_loss", "grad_norm", "max_over_mean_load", "dropped_tokens",
        "valid_lm_loss", "test_lm_loss")
a = [json.loads(l) for l in open(a_path + ".jsonl")]
b = [json.loads(l) for l in open(b_path + ".jsonl")]
if len(a) != len(b) or not a:
    sys.exit(f"{name}: {len(a)} vs {len(b)} logged steps")
for x, y in zip(a, b):
    for k in keys:
        if k in x and x[k] != y.get(k):
            sys.exit(f"{name}: step {x['iteration']} {k}: {x[k]!r} before, {y.get(k)!r} after")
def digest(path):
    for line in open(path + ".log"):
        if "weights digest" in line:
            return line.split("weights digest")[1].strip()
    return None
da, db = digest(a_path), digest(b_path)
if da is not None and db is not None and da != db:
    sys.exit(f"{name}: final weights digest {da} before, {db} after")
note = "" if da is not None and db is not None else " (no weights digest printed: losses only)"
print(f"{name}: {len(a)} steps bitwise identical{note}")
EOF
}

for name in "${!runs[@]}"; do
  # shellcheck disable=SC2086  # the flags are word lists
  run_one "$name" "$before" before 0 ${runs[$name]} && run_one "$name" "$after" after 0 ${runs[$name]} \
    && compare "$name" || status=1
done
if command -v mpirun > /dev/null; then
  for name in "${mpi_runs[@]}"; do
    # shellcheck disable=SC2086
    run_one "$name" "$before" before 1 ${mpi_flags[$name]} \
      && run_one "$name" "$after" after 1 ${mpi_flags[$name]} && compare "$name" || status=1
  done
else
  echo "mpirun not found: the EP = 2 runs were not compared"
fi
exit $status
