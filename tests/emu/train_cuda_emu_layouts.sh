#!/usr/bin/env bash
# Every parallel layout on `--device cuda` under mpirun in the emulated CUDA build: the device's
# collectives on the emulated NCCL (strict: device buffers only, no read of a receive buffer
# before its wait, no write of a send buffer before completion), the host's on MPI. Each layout
# is tests/emu/train_cuda_emu.sh --np N: 3 steps against --device cpu in the same layout within
# docs/numerics.md's row "emulated CUDA vs CPU backend", the CUDA run twice bitwise (the second
# under --sync-audit: clean, only documented points counted). An overlapped form is also
# required bitwise equal to its plain form (--equal-to). The tiny model shrunk (one layer, two
# where the layout needs them, one a virtual stage for the interleaved ones; hidden 32, 2 heads,
# sequence length 16, micro-batches of 1) keeps the emulator's time small: about 15 s a layout
# (the interleaved ones over 3 and 4 ranks about 100 s on a loaded machine).
# Usage: train_cuda_emu_layouts.sh MOECORE_BINARY NP [CONFIG]   (NP: 2, 3, 4 or 8)
set -euo pipefail
moecore=$1 np=$2 config=${3:-configs/tiny.toml}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A collective waiting over 2 minutes aborts its run naming what it waits for (the emulated
# NCCL: the running group's unmatched sends and receives, with their peers), so that a wait
# cycle fails the layout instead of holding the suite for the default 10 minutes a wait.
small=(--seq-length 16 --num-layers 1 --hidden-size 32 --num-attention-heads 2 --ffn-hidden-size 64
       --moe-ffn-hidden-size 32 --micro-batch-size 1 --global-batch-size 4
       --distributed-timeout-minutes 2)
padded=(--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity)
# The shared expert; --moe-shared-expert-overlap runs its pieces while the alltoall dispatcher's
# all-to-alls are in flight (fc1 / fc2 with the dispatch / combine, their backwards with the
# combine's / dispatch's backward), required bitwise equal to the same layout without it.
shared=(--moe-shared-expert-intermediate-size 32)
tp2ep2=(--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2
        --expert-tensor-parallel-size 2)
# One layout per line: a name, then its flags; "@record NAME" / "@equal NAME" keep or compare the
# CUDA run's per-step values and digest; "@sync-free" requires its audited steps to count no host
# sync at all (train_cuda_emu.sh --sync-free): every layout without a count exchange, EP's padded
# dispatch included, both dispatchers (static splits, token counts and capacities known on every
# rank; the grouped GEMMs from device tables). Dropless, the all-gather dispatcher keeps its
# documented token-count exchange (SyncAudit::kEpTokenCounts: the host sizes the gathers), and the
# all-to-all dispatcher its count exchange (kEpCountExchange), also over the expert-TP group of
# TP + SP.
layouts=()
# PP and CP need 2 layers (a stage each; the ring's chunks) and lengths divisible by 2 cp.
two=(--num-layers 2)
case "$np" in
  2) layouts=(
       "dp2 @sync-free"
       "ep2-alltoall --expert-model-parallel-size 2"
       "ep2-alltoall-padded @sync-free --expert-model-parallel-size 2 ${padded[*]}"
       "ep2-allgather --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"
       "ep2-allgather-padded @sync-free --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather ${padded[*]}"
       "tp2-sp --tensor-model-parallel-size 2 --sequence-parallel"
       "tp2-sp-dense-bf16 --tensor-model-parallel-size 2 --sequence-parallel ${two[*]} --moe-layer-freq [0,1] --bf16"
       "ep2-bf16 --expert-model-parallel-size 2 --bf16"
       "ep2-shared @record shared --expert-model-parallel-size 2 ${shared[*]}"
       "ep2-shared-overlap @equal shared --expert-model-parallel-size 2 ${shared[*]} --moe-shared-expert-overlap"
       "ep2-shared-gate-bf16 @record shared16 --expert-model-parallel-size 2 ${shared[*]} --moe-shared-expert-gate --bf16"
       "ep2-shared-gate-bf16-overlap @equal shared16 --expert-model-parallel-size 2 ${shared[*]} --moe-shared-expert-gate --bf16 --moe-shared-expert-overlap"
       "pp2 @sync-free ${two[*]} --pipeline-model-parallel-size 2"
       "pp2-mtp @sync-free ${two[*]} --pipeline-model-parallel-size 2 --mtp-num-layers 1"
       "pp2-vp2 @sync-free --num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
       "pp2-bf16 @sync-free ${two[*]} --pipeline-model-parallel-size 2 --bf16"
       "pp2-vp2-bf16 @sync-free --num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --bf16"
       "pp2-vp2-group4 @sync-free --num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --microbatch-group-size-per-virtual-pipeline-stage 4"
       "cp2-p2p @sync-free ${two[*]} --context-parallel-size 2 --cp-comm-type p2p"
       "cp2-allgather @sync-free ${two[*]} --context-parallel-size 2 --cp-comm-type allgather"
     ) ;;
  # The interleaved schedule over 3 stages in groups of 4 micro-batches (6 layers: one a virtual
  # stage).
  3) layouts=(
       "pp3-vp2-group4 @sync-free --num-layers 6 --pipeline-model-parallel-size 3 --num-layers-per-virtual-pipeline-stage 1 --microbatch-group-size-per-virtual-pipeline-stage 4"
     ) ;;
  4) layouts=(
       "pp4-vp2 @sync-free --num-layers 8 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1"
       "ep2-etp2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2"
       "tp2-sp-etp2-ep2-shared @record etpshared ${tp2ep2[*]} ${shared[*]}"
       "tp2-sp-etp2-ep2-shared-overlap @equal etpshared ${tp2ep2[*]} ${shared[*]} --moe-shared-expert-overlap"
       "dp2-ep2-distopt @record distopt --expert-model-parallel-size 2 --use-distributed-optimizer"
       "dp2-ep2-distopt-overlap @equal distopt --expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
       "dp2-ep2-distopt-overlap-bf16 --expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16"
     ) ;;
  # The folded layout of train_parity_mpi_8: attention TP 2 + SP x DP 4, experts EP 4 x EDP 2.
  8) layouts=(
       "tp2-sp-ep4-folded --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 --expert-tensor-parallel-size 1"
     ) ;;
  *) echo "train_cuda_emu_layouts.sh: no layouts for $np processes (2, 3, 4 or 8)" >&2; exit 2 ;;
esac
status=0
for l in "${layouts[@]}"; do
  read -r -a words <<< "$l"
  name=${words[0]}
  opts=()
  flags=()
  for ((i = 1; i < ${#words[@]}; ++i)); do
    case "${words[i]}" in
      @record) opts+=(--record "$work/${words[i + 1]}"); ((++i)) ;;
      @equal) opts+=(--equal-to "$work/${words[i + 1]}"); ((++i)) ;;
      @sync-free) opts+=(--sync-free) ;;
      *) flags+=("${words[i]}") ;;
    esac
  done
  start=$(date +%s.%N)
  if out=$(bash "$here/train_cuda_emu.sh" --np "$np" "${opts[@]}" "$moecore" "$config" "${small[@]}" \
             "${flags[@]}" 2>&1); then
    secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }')
    echo "[layouts] $name (np $np, ${secs} s): $(grep -o 'worst relative difference: .*' <<< "$out")"
    echo "[layouts]   $(grep -o 'counted in the last step: .*' <<< "$out")"
  else
    echo "[layouts] FAIL $name (np $np): ${flags[*]}"
    echo "$out" | tail -40
    status=1
  fi
done
exit $status
