#!/usr/bin/env bash
# Checkpoints of runs with --use-distributed-optimizer (ZeRO-1) under mpirun on 4 ranks, at EP 2 x
# expert-DP 2 (DP 4: dense and expert moments both sharded), docs/checkpoint_format.md:
# - resume: 3 steps, save, resume to 6 == an uninterrupted 6-step run, bitwise (per-step losses
#   and grad norms, weights digest, both runs' checkpoints of iteration 6 byte-equal);
# - the format: the checkpoint is the one the same run writes without the distributed optimizer
#   (`moecore checkpoint compare`-equal, AdamW moments included: they are bitwise the same);
# - across: a checkpoint saved without it resumes with it and vice versa, bitwise;
# - at EP 4 (expert-DP 1: only the dense moments sharded, the expert ones whole on their rank):
#   the same checkpoint as without it, and a resume from that one bitwise.
# Usage: checkpoint_distopt.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
common=(--config "$config" --lr-warmup-iters 1 --lr-decay-iters 20 --micro-batch-size 2
        --global-batch-size 16 --log-interval 1 --peak-tflops 100)
ep=2
train() {  # train ARGS...: `moecore train` on 4 ranks at EP $ep
  "$mpiexec" --oversubscribe --allow-run-as-root -np 4 -x OMP_NUM_THREADS=1 \
    "$moecore" train "${common[@]}" --expert-model-parallel-size "$ep" "$@" 2>&1
}
dist=(--use-distributed-optimizer)

# ---- resume with the distributed optimizer ----
out=$(train "${dist[@]}" --train-iters 6 --metrics-file "$work/whole.jsonl" --save "$work/wd") ||
  fail "the uninterrupted run stopped" "$out"
whole=$(digest "$out")
[ -n "$whole" ] || fail "no weights digest" "$out"
out=$(train "${dist[@]}" --train-iters 3 --save "$work/rd") || fail "the first half stopped" "$out"
out=$(train "${dist[@]}" --train-iters 6 --load "$work/rd" --save "$work/rd" --async-save \
      --metrics-file "$work/resumed.jsonl") || fail "the resumed run stopped" "$out"
grep -q "loaded iteration 3 from" <<< "$out" || fail "the resume did not load iteration 3" "$out"
[ "$(digest "$out")" = "$whole" ] || fail "resumed weights $(digest "$out") != $whole" "$out"
[ "$(steps "$work/resumed.jsonl")" = "$(tail -n 3 "$work/whole.jsonl" | steps /dev/stdin)" ] ||
  fail "the resumed steps 4-6 differ" "$(cat "$work/resumed.jsonl" "$work/whole.jsonl")"
compare "$work/wd" "$work/rd"
# The moments were sharded (else this tests the plain optimizer).
mem_optim() { grep -o '"mem_optimizer_bytes":[0-9]*' "$1" | head -n 1 | cut -d: -f2; }
echo "[checkpoint] distributed optimizer, 4 ranks (EP 2 x EDP 2): resumed steps 4-6, weights" \
     "and AdamW moments bitwise"

# ---- the same checkpoint as without it ----
# Without it the grad norm's f64 sum is associated otherwise (docs/numerics.md): the plain run's
# per-step values are its own uninterrupted run's.
out=$(train --train-iters 6 --metrics-file "$work/plain.jsonl") || fail "the plain run stopped" "$out"
plain=$(digest "$out")
[ "$(mem_optim "$work/whole.jsonl")" -lt "$(mem_optim "$work/plain.jsonl")" ] ||
  fail "the optimizer state was not sharded: $(mem_optim "$work/whole.jsonl") bytes with" \
       "--use-distributed-optimizer, $(mem_optim "$work/plain.jsonl") without"
out=$(train --train-iters 3 --save "$work/rp") || fail "the plain first half stopped" "$out"
compare "$work/rd/iter_0000003" "$work/rp/iter_0000003"
echo "[checkpoint] iteration 3 with and without the distributed optimizer: byte-equal"

# ---- across: plain -> distributed, distributed -> plain ----
out=$(train "${dist[@]}" --train-iters 6 --load "$work/rp" --metrics-file "$work/p2d.jsonl") ||
  fail "plain -> distributed stopped" "$out"
[ "$(digest "$out")" = "$whole" ] || fail "plain -> distributed: $(digest "$out") != $whole" "$out"
[ "$(steps "$work/p2d.jsonl")" = "$(tail -n 3 "$work/whole.jsonl" | steps /dev/stdin)" ] ||
  fail "plain -> distributed: steps 4-6 differ" "$(cat "$work/p2d.jsonl")"
out=$(train --train-iters 6 --load "$work/rd" --ckpt-step 3 --metrics-file "$work/d2p.jsonl") ||
  fail "distributed -> plain stopped" "$out"
[ "$(digest "$out")" = "$plain" ] || fail "distributed -> plain: $(digest "$out") != $plain" "$out"
[ "$(steps "$work/d2p.jsonl")" = "$(tail -n 3 "$work/plain.jsonl" | steps /dev/stdin)" ] ||
  fail "distributed -> plain: steps 4-6 differ" "$(cat "$work/d2p.jsonl")"
echo "[checkpoint] saved without the distributed optimizer resumed with it, and the reverse:" \
     "bitwise"

# ---- EP 4: the expert moments are not sharded (one rank per expert-DP group) ----
ep=4
out=$(train "${dist[@]}" --train-iters 5) || fail "EP 4: the uninterrupted run stopped" "$out"
whole4=$(digest "$out")
out=$(train "${dist[@]}" --train-iters 3 --save "$work/d4") || fail "EP 4: distributed" "$out"
out=$(train --train-iters 3 --save "$work/p4") || fail "EP 4: plain" "$out"
compare "$work/d4" "$work/p4"
out=$(train "${dist[@]}" --train-iters 5 --load "$work/p4") || fail "EP 4: resume" "$out"
[ "$(digest "$out")" = "$whole4" ] || fail "EP 4: resumed $(digest "$out") != $whole4" "$out"
echo "[checkpoint] EP 4 (dense moments sharded, expert whole): the same checkpoint as without" \
     "it, resumed bitwise"

# ---- resharding with it: DP 2 -> DP 4 -> EP 2 x EDP 2 -> one rank without it ----
# Iteration 4 saved at DP 2 with the distributed optimizer, loaded at each next layout and saved
# again (the same iteration): every global tensor, weights and both AdamW moments, byte-equal to
# the source's; resumed there to 6: bitwise the run resumed at that layout from the source itself
# (the same bytes, the same reduction order), and steps 5-6 within the layout-parity tolerance
# (f32 per-step values: rtol 1e-5, docs/numerics.md) of an uninterrupted 6-step run at that layout
# (whose steps 1-4 summed in another order).
on() { train_on "$@"; }  # on NP ARGS... (lib.sh)
# within A B: the per-step lm losses and grad norms of metrics files A and B (the same steps)
# within rtol 1e-5 of B's.
within() {
  paste <(grep -o '"lm_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2) \
        <(grep -o '"lm_loss":[^,}]*\|"grad_norm":[^,}]*' "$2" | cut -d: -f2) |
    awk 'NF != 2 { exit 1 } { d = $1 - $2; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2
         if (d > 1e-5 * m) exit 1; n++ } END { exit n == 0 }'
}
out=$(on 2 --expert-model-parallel-size 1 "${dist[@]}" --train-iters 4 --save "$work/s") ||
  fail "DP 2: the source run stopped" "$out"
hops=("4 --expert-model-parallel-size 1 --use-distributed-optimizer"
      "4 --expert-model-parallel-size 2 --use-distributed-optimizer"
      "1")
prev="$work/s"
k=0
for l in "${hops[@]}"; do
  read -r -a layout <<< "$l"
  np=${layout[0]}
  flags=("${layout[@]:1}")
  what="$np ranks ${flags[*]:-(one rank, without it)}"
  k=$((k + 1))
  out=$(on "$np" "${flags[@]}" --train-iters 4 --load "$prev" --save "$work/h$k") ||
    fail "load into $what" "$out"
  grep -q "loaded iteration 4 from" <<< "$out" || fail "$what: did not load iteration 4" "$out"
  compare "$work/s/iter_0000004" "$work/h$k/iter_0000004"
  out=$(on "$np" "${flags[@]}" --train-iters 6 --load "$work/h$k" \
        --metrics-file "$work/h$k.jsonl") || fail "$what: resume to 6" "$out"
  resumed=$(digest "$out")
  out=$(on "$np" "${flags[@]}" --train-iters 6 --load "$work/s" \
        --metrics-file "$work/d$k.jsonl") || fail "$what: resume from the source" "$out"
  [ "$(digest "$out")" = "$resumed" ] &&
    [ "$(steps "$work/d$k.jsonl")" = "$(steps "$work/h$k.jsonl")" ] ||
    fail "$what: resumed from the reshard ($resumed) vs from the source ($(digest "$out"))" \
         "$(cat "$work/h$k.jsonl" "$work/d$k.jsonl")"
  if [ "$l" = "4 --expert-model-parallel-size 2 --use-distributed-optimizer" ]; then
    cp "$work/whole.jsonl" "$work/u$k.jsonl"  # the first section's uninterrupted run
  else
    out=$(on "$np" "${flags[@]}" --train-iters 6 --metrics-file "$work/u$k.jsonl") ||
      fail "$what: the uninterrupted run" "$out"
  fi
  within "$work/h$k.jsonl" <(tail -n 2 "$work/u$k.jsonl") ||
    fail "$what: steps 5-6 resumed from the reshard vs uninterrupted (rtol 1e-5)" \
         "$(cat "$work/h$k.jsonl" "$work/u$k.jsonl")"
  echo "[checkpoint] distributed optimizer, reshard -> $what: iteration 4 byte-equal;" \
       "resumed bitwise as from the source; steps 5-6 $(steps "$work/h$k.jsonl") vs" \
       "uninterrupted $(tail -n 2 "$work/u$k.jsonl" | steps /dev/stdin)"
  prev="$work/h$k"
done

# ---- --bf16: the fp32 master weights live in the optimizer's shards ----
# Each rank writes its pieces of every weight as flat slices (and loads its owned pieces back,
# the whole local tensors rounded to bf16 into its compute copy): resume bitwise; the checkpoint
# is byte-equal to the plain --bf16 run's (the master weights whole in the registry there:
# the same updates); resharded to one rank without it and back, bitwise as from the source.
ep=2
bf=(--bf16)
out=$(train "${bf[@]}" "${dist[@]}" --train-iters 5 --metrics-file "$work/bw.jsonl") ||
  fail "bf16: the uninterrupted run stopped" "$out"
grep -q "fp32 master weights too" <<< "$out" || fail "bf16: the master weights are not sharded" "$out"
bwhole=$(digest "$out")
out=$(train "${bf[@]}" "${dist[@]}" --train-iters 3 --save "$work/bd") ||
  fail "bf16: the first half stopped" "$out"
out=$(train "${bf[@]}" "${dist[@]}" --train-iters 5 --load "$work/bd" \
      --metrics-file "$work/br.jsonl") || fail "bf16: the resumed run stopped" "$out"
[ "$(digest "$out")" = "$bwhole" ] || fail "bf16: resumed $(digest "$out") != $bwhole" "$out"
[ "$(steps "$work/br.jsonl")" = "$(tail -n 2 "$work/bw.jsonl" | steps /dev/stdin)" ] ||
  fail "bf16: the resumed steps 4-5 differ" "$(cat "$work/br.jsonl" "$work/bw.jsonl")"
out=$(train "${bf[@]}" --train-iters 3 --save "$work/bp") || fail "bf16: plain" "$out"
compare "$work/bd/iter_0000003" "$work/bp/iter_0000003"
out=$(on 1 "${bf[@]}" --train-iters 3 --load "$work/bd" --save "$work/b1") ||
  fail "bf16: load into one rank" "$out"
compare "$work/bd/iter_0000003" "$work/b1/iter_0000003"
out=$(train "${bf[@]}" "${dist[@]}" --train-iters 5 --load "$work/b1") ||
  fail "bf16: back from one rank" "$out"
[ "$(digest "$out")" = "$bwhole" ] || fail "bf16: one rank -> 4: $(digest "$out") != $bwhole" "$out"
echo "[checkpoint] --bf16 with the master weights sharded: resumed bitwise; byte-equal to the" \
     "plain --bf16 checkpoint; one rank and back bitwise"
