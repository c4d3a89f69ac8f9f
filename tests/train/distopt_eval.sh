#!/usr/bin/env bash
# Evaluation with the distributed optimizer's deferred gathers (--overlap-param-gather) on 2
# ranks, fp32 and --bf16 (the fp32 master weights in the optimizer's shards there): every
# validation loss (mid-run, and the final valid and test ones) and the weights digest bitwise
# equal to the same run without the flag, so an evaluation always reads the gathered weights.
# Usage: distopt_eval.sh MPIEXEC MOECORE_BINARY CONFIG
set -euo pipefail
mpiexec=$1 moecore=$2 config=$3
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
common=(--config "$config" --mock-data --split 90,5,5 --train-iters 4 --eval-interval 2
        --eval-iters 1 --lr-warmup-iters 0 --lr-decay-iters 10 --micro-batch-size 2
        --global-batch-size 4 --log-interval 1 --peak-tflops 100 --use-distributed-optimizer
        --overlap-grad-reduce)
# The validation lines and the digest of a run's output.
evals() { grep -E '^ ?validation loss at iteration|weights digest' <<< "$1"; }
for precision in fp32 bf16; do
  extra=()
  [ "$precision" = bf16 ] && extra=(--bf16)
  plain=$(train_on 2 "${extra[@]}") || fail "$precision: the run without the flag stopped" "$plain"
  over=$(train_on 2 "${extra[@]}" --overlap-param-gather) ||
    fail "$precision: the run with --overlap-param-gather stopped" "$over"
  [ "$(evals "$plain" | grep -c 'validation loss')" -eq 4 ] ||
    fail "$precision: not 4 validation losses" "$plain"
  [ "$(evals "$over")" = "$(evals "$plain")" ] ||
    fail "$precision: the evaluations differ with --overlap-param-gather" \
         "$(evals "$over"; echo ---; evals "$plain")"
  echo "[distopt-eval] $precision: 4 validation losses and the digest bitwise with and without" \
       "--overlap-param-gather"
done
