#!/usr/bin/env bash
# Checkpoints, stopping, eval and the stream-wait watchdog of `moecore train --device cuda` under
# mpirun in the emulated CUDA build (strict device memory, the strict emulated NCCL; the tiny model
# shrunk as tests/emu/train_cuda_emu_layouts.sh shrinks it), on 2 ranks:
# - resume: a run saving at iteration 2 resumed to 3 equals the uninterrupted run bitwise (step
#   3's lm loss and grad norm, the weights digest, and its checkpoint of iteration 3 byte for byte:
#   weights, AdamW moments, router state): EP 2 with the distributed optimizer, overlapped
#   gradient reduce and parameter gather and --async-save; TP 2 + SP; PP 2;
# - SIGTERM to mpirun (--exit-signal-handler, EP 2): the ranks finish the step, save and end; the
#   checkpoint equals the uninterrupted run's of that iteration byte for byte, and the run resumed
#   from it to 5 equals the uninterrupted one bitwise (steps and digest);
# - across devices and layouts (docs/checkpoint_format.md, "What a save communicates and holds":
#   loaded at one layout and saved again, the two are equal): EP 2 on cuda -> one rank on cpu
#   -> EP 2 with the distributed optimizer on cuda, and EP 2 on cuda -> TP 2 + SP on cuda, each
#   saved again byte-equal to the source;
# - `moecore eval` on cuda against cpu (docs/numerics.md "emulated CUDA vs CPU backend", rtol
#   1e-5): --tokens-json at PP 2 and at CP 2 (each sequence through the evaluation's forward),
#   the validation split's loss at EP 2;
# - the stream-wait watchdog (core/exec.h): a planted stream that never ends
#   (MOECORE_FAULT stream_hang, the emulated device) is reported within the limit, naming the
#   wait, the iteration and the rank, and the job ends non-zero with no rank left.
# Usage: train_cuda_emu_ckpt.sh MPIEXEC MOECORE_BINARY [CONFIG]
set -euo pipefail
mpiexec=$1 moecore=$2 config=${3:-configs/tiny.toml}
source "$(dirname "${BASH_SOURCE[0]}")/../train/lib.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MOECORE_FAULT=""
# Strict device memory is the emulated device's default; said here for the reader.
export MOECORE_EMU_DEVICE_MEMORY=strict
small=(--seq-length 16 --num-layers 1 --hidden-size 32 --num-attention-heads 2 --ffn-hidden-size 64
       --moe-ffn-hidden-size 32 --micro-batch-size 1 --global-batch-size 4)
common=(--config "$config" --lr-warmup-iters 0 --lr-decay-iters 20 --log-interval 1
        --peak-tflops 100 "${small[@]}")
ep2=(--expert-model-parallel-size 2)
tp2=(--tensor-model-parallel-size 2 --sequence-parallel)
pp2=(--num-layers 2 --pipeline-model-parallel-size 2)
distopt=(--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
train() { local np=$1 dev=$2; shift 2; train_on "$np" --device "$dev" "$@"; }  # (lib.sh)
# lib.sh's compare, its report printed only when the checkpoints differ.
compare() {
  local out
  out=$("$moecore" checkpoint compare "$1" "$2" 2>&1) || fail "checkpoints $1 and $2 differ" "$out"
}
iter_dir() { printf '%s/iter_%07d' "$1" "$2"; }
# The lines of a metrics file from iteration N on.
from_iter() { awk -v n="$2" -F'"iteration":' '{ split($2, a, /[,}]/); if (a[1] + 0 >= n) print }' "$1"; }
t0=$SECONDS
passed() { echo "[cuda-ckpt] $1 ($((SECONDS - t0)) s)"; }

# ---- resume: save at 2, resume to 3, bitwise the uninterrupted run ----
resume_case() {  # resume_case NAME FLAGS...
  local name=$1 out whole
  shift
  local w="$work/$name.whole" r="$work/$name.resumed"
  out=$(train 2 cuda "$@" --train-iters 3 --save "$w" --save-interval 2 \
        --metrics-file "$w.jsonl") || fail "$name: the uninterrupted run stopped" "$out"
  whole=$(digest "$out")
  out=$(train 2 cuda "$@" --train-iters 3 --load "$w" --ckpt-step 2 --save "$r" \
        --metrics-file "$r.jsonl") || fail "$name: the resumed run stopped" "$out"
  grep -q "loaded iteration 2 from" <<< "$out" || fail "$name: iteration 2 not loaded" "$out"
  [ -n "$whole" ] && [ "$(digest "$out")" = "$whole" ] ||
    fail "$name: resumed weights $(digest "$out") != $whole" "$out"
  [ "$(steps "$r.jsonl")" = "$(from_iter "$w.jsonl" 3 | steps /dev/stdin)" ] ||
    fail "$name: the resumed step 3 differs" "$(cat "$r.jsonl"; echo ---; cat "$w.jsonl")"
  compare "$(iter_dir "$w" 3)" "$(iter_dir "$r" 3)"
  passed "resume $name: saved at 2 on --device cuda, resumed to 3: step, digest $whole and the checkpoint (weights, moments) bitwise"
}
resume_case ep2-distopt-async "${ep2[@]}" "${distopt[@]}" --async-save
resume_case tp2-sp "${tp2[@]}"
resume_case pp2 "${pp2[@]}"

# ---- SIGTERM to mpirun: finish the step, save, stop; resume bitwise ----
# The uninterrupted run saves every iteration: the stop's checkpoint is compared with its own.
u="$work/ep2.whole"
out=$(train 2 cuda "${ep2[@]}" --train-iters 5 --save "$u" --save-interval 1 \
      --metrics-file "$u.jsonl") || fail "EP 2: the uninterrupted run stopped" "$out"
ep2_whole=$(digest "$out")
s="$work/ep2.sigterm"
# mpirun as this job's process (its pid is $!); its grace for the ranks raised from 1 s to 3 s
# (the step in flight and the save must end within twice that on a loaded machine; the ranks end
# when mpirun's SIGTERM comes, so the grace is also what the stop costs: docs/checkpoint_format.md
# "Stopping a job").
(exec "$mpiexec" --mca odls_base_sigkill_timeout 3 --oversubscribe --allow-run-as-root -np 2 \
   -x OMP_NUM_THREADS=1 "$moecore" train "${common[@]}" --device cuda "${ep2[@]}" \
   --train-iters 2000 --save "$s" --exit-signal-handler > "$s.log" 2>&1) &
launcher=$!
until grep -q ' iteration *2/' "$s.log" 2> /dev/null; do
  kill -0 "$launcher" 2> /dev/null || fail "SIGTERM: the run ended before its step 2" "$(cat "$s.log")"
  sleep 0.05
done
kill -TERM "$launcher"
rc=0
wait "$launcher" || rc=$?
[ "$rc" -eq 1 ] || fail "SIGTERM: mpirun's status $rc instead of 1 (Open MPI's after SIGTERM)" \
                        "$(cat "$s.log")"
for _ in $(seq 100); do [ -z "$(ranks_of "--save $s ")" ] && break; sleep 0.1; done
[ -z "$(ranks_of "--save $s ")" ] || fail "SIGTERM: ranks left behind" "$(cat "$s.log")"
stopped=$(grep -o 'stopping after iteration [0-9]*' "$s.log" | awk '{print $4}' || true)
[ -n "$stopped" ] || fail "SIGTERM: no early stop" "$(cat "$s.log")"
grep -q '^\[train\] final lm loss' "$s.log" || fail "SIGTERM: rank 0 did not finish" "$(cat "$s.log")"
[ "$stopped" -lt 5 ] || fail "SIGTERM: stopped only after iteration $stopped (5 is the end)" \
                             "$(cat "$s.log")"
[ "$(cat "$s/latest_checkpointed_iteration.txt")" = "$stopped" ] ||
  fail "SIGTERM: the tracker does not name iteration $stopped" "$(cat "$s.log")"
compare "$(iter_dir "$u" "$stopped")" "$(iter_dir "$s" "$stopped")"
out=$(train 2 cuda "${ep2[@]}" --train-iters 5 --load "$s" --metrics-file "$s.jsonl") ||
  fail "SIGTERM: the resume stopped" "$out"
[ "$(digest "$out")" = "$ep2_whole" ] ||
  fail "SIGTERM: resumed from $stopped: $(digest "$out") != $ep2_whole" "$out"
[ "$(steps "$s.jsonl")" = "$(from_iter "$u.jsonl" $((stopped + 1)) | steps /dev/stdin)" ] ||
  fail "SIGTERM: the resumed steps differ" "$(cat "$s.jsonl"; echo ---; cat "$u.jsonl")"
passed "SIGTERM to mpirun at EP 2: stopped after iteration $stopped, saved (byte-equal to the uninterrupted run's), resumed to 5 bitwise"

# ---- across devices and layouts: load, save again, byte-equal ----
src=$(iter_dir "$u" 3)
reshard() {  # reshard NAME SOURCE_DIR NP DEVICE FLAGS...: loads iteration 3, saves it again
  local name=$1 from=$2 np=$3 dev=$4 out
  shift 4
  out=$(train "$np" "$dev" "$@" --train-iters 3 --load "$from" --ckpt-step 3 \
        --save "$work/$name") || fail "$name: load and save" "$out"
  grep -q "loaded iteration 3 from" <<< "$out" || fail "$name: iteration 3 not loaded" "$out"
  compare "$src" "$(iter_dir "$work/$name" 3)"
}
reshard cpu1 "$u" 1 cpu
reshard cpu1-cuda-ep2-distopt "$work/cpu1" 2 cuda "${ep2[@]}" "${distopt[@]}"
reshard cuda-tp2-sp "$u" 2 cuda "${tp2[@]}"
passed "EP 2 on cuda -> 1 rank on cpu -> EP 2 + distributed optimizer on cuda, and -> TP 2 + SP on cuda: each saved again byte-equal to the source"

# ---- moecore eval: cuda against cpu ----
evaluate() {  # evaluate DEVICE ARGS...: `moecore eval` on 2 ranks
  local dev=$1
  shift
  "$mpiexec" --oversubscribe --allow-run-as-root -np 2 -x OMP_NUM_THREADS=1 "$moecore" eval \
    --config "$config" "${small[@]}" --device "$dev" "$@" 2>&1
}
# The numbers of rank 0's "[eval]" lines but the first (the checkpoint's iteration and path).
numbers() { grep '^\[eval\]' <<< "$1" | grep -v '^\[eval\] iteration' | grep -oE '[0-9.]+(E[-+][0-9]+)?'; }
# close NAME CUDA_OUTPUT CPU_OUTPUT: the same lines, each number within rtol 1e-5 (docs/numerics.md
# "emulated CUDA vs CPU backend"; the layouts' f32 row is the same 1e-5).
close() {
  local name=$1 a=$2 b=$3
  [ "$(numbers "$a" | wc -l)" -ge 2 ] && [ "$(numbers "$a" | wc -l)" = "$(numbers "$b" | wc -l)" ] ||
    fail "eval $name: not the same lines on cuda and cpu" "$a"$'\n---\n'"$b"
  paste <(numbers "$a") <(numbers "$b") | awk -v name="$name" '
    { d = $1 - $2; if (d < 0) d = -d; r = ($2 == 0) ? d : d / ($2 < 0 ? -$2 : $2); if (r > w) w = r
      if (r > 1e-5) { printf "FAIL: eval %s: cuda %s, cpu %s: relative %.3g > 1e-5\n", name, $1, $2, r; bad = 1 } }
    END { printf "%.2g", w; exit bad }' > "$work/worst" ||
    fail "eval $name" "$(cat "$work/worst")"$'\n'"$a"$'\n---\n'"$b"
  passed "eval $name: worst relative difference $(cat "$work/worst")"
}
# Sequences of 16 (--seq-length), 3, 1 (nothing to score) and 5 tokens.
printf '[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [40, 41, 42], [7], [9, 8, 7, 6, 5]]' \
  > "$work/tokens.json"
tokens=(--load "$work/pp2.whole" --tokens-json "$work/tokens.json")
cpu_pp2=$(evaluate cpu "${pp2[@]}" "${tokens[@]}") || fail "eval --tokens-json at PP 2 on cpu" "$cpu_pp2"
out=$(evaluate cuda "${pp2[@]}" "${tokens[@]}") || fail "eval --tokens-json at PP 2 on cuda" "$out"
close "--tokens-json, PP 2 on cuda vs PP 2 on cpu" "$out" "$cpu_pp2"
# Context parallelism scores each sequence whole (its chunks' losses summed over cp).
out=$(evaluate cuda --num-layers 2 --context-parallel-size 2 "${tokens[@]}") ||
  fail "eval --tokens-json at CP 2 on cuda" "$out"
close "--tokens-json, CP 2 on cuda vs PP 2 on cpu" "$out" "$cpu_pp2"
# (--train-iters 1: the mock data's training split, which eval builds and never reads, small.)
valid=(--load "$u" --mock-data --split 90,5,5 --eval-iters 2 --train-iters 1 --lr-warmup-iters 0
       "${ep2[@]}")
a=$(evaluate cuda "${valid[@]}") || fail "eval of the validation split at EP 2 on cuda" "$a"
b=$(evaluate cpu "${valid[@]}") || fail "eval of the validation split at EP 2 on cpu" "$b"
close "of the validation split, EP 2 on cuda vs cpu" "$a" "$b"

# ---- the stream-wait watchdog: a stream that never ends ----
log="$work/hang.log"
start=$SECONDS
rc=0
(MOECORE_FAULT="comm_timeout:seconds=3;stream_hang:iter=2" timeout 60 \
   "$mpiexec" --oversubscribe --allow-run-as-root -np 2 -x OMP_NUM_THREADS=1 -x MOECORE_FAULT \
   "$moecore" train "${common[@]}" --device cuda "${ep2[@]}" --train-iters 4 \
   --save "$work/hang") > "$log" 2>&1 || rc=$?
took=$((SECONDS - start))
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] ||
  fail "hang: status $rc (0: the planted hang was not seen; 124: nothing ended the job)" "$(cat "$log")"
grep -qE "error: \[exec\] timeout: world rank [01] waited [0-9.]+ s for its device stream in the step's report \(StepBuffers::download\), at iteration 2, over the 3.0 s limit" "$log" ||
  fail "hang: no report naming the wait, the iteration and the rank" "$(cat "$log")"
[ "$took" -lt 60 ] || fail "hang: the job took $took s to end (limit 3 s)" "$(cat "$log")"
for _ in $(seq 100); do [ -z "$(ranks_of "--save $work/hang ")" ] && break; sleep 0.1; done
[ -z "$(ranks_of "--save $work/hang ")" ] || fail "hang: ranks left behind" "$(cat "$log")"
passed "watchdog: a stream that never ends at iteration 2 reported (the wait, the iteration, the rank), status $rc after $took s, no rank left"
