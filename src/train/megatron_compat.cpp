#include "train/megatron_compat.h"

#include <fmt/format.h>

#include <sstream>

#include "core/check.h"

namespace moecore::train {

namespace {
constexpr CompatKind I = CompatKind::Ignored;
constexpr CompatKind V = CompatKind::OnlyValue;
constexpr CompatKind R = CompatKind::Rejected;
}  // namespace

const std::vector<CompatFlag>& megatron_compat_flags() {
  static const std::vector<CompatFlag> kFlags = {
      // Kernel fusions and implementation choices: same math.
      {"--use-mcore-models", false, I, "", "moecore has one model implementation"},
      {"--transformer-impl", true, I, "", "moecore has its own kernels"},
      {"--attention-backend", true, I, "", "moecore has its own attention kernel"},
      {"--use-flash-attn", false, I, "", "the attention kernel is always memory-frugal"},
      {"--no-masked-softmax-fusion", false, I, "", "kernel fusion choice"},
      {"--no-bias-gelu-fusion", false, I, "", "kernel fusion choice"},
      {"--no-bias-swiglu-fusion", false, I, "", "kernel fusion choice"},
      {"--no-bias-dropout-fusion", false, I, "", "kernel fusion choice"},
      {"--no-rope-fusion", false, I, "", "kernel fusion choice"},
      {"--no-persist-layer-norm", false, I, "", "kernel fusion choice"},
      {"--no-gradient-accumulation-fusion", false, I, "", "kernel fusion choice"},
      {"--moe-permute-fusion", false, I, "", "kernel fusion choice"},
      {"--cross-entropy-loss-fusion", false, I, "", "the head and cross entropy are always fused"},
      {"--cross-entropy-fusion-impl", true, I, "", "kernel fusion choice"},
      {"--no-async-tensor-model-parallel-allreduce", false, I, "", "communication scheduling"},
      {"--overlap-param-gather", false, I, "",
       "no distributed optimizer yet: parameters are never gathered"},
      {"--moe-shared-expert-overlap", false, I, "", "communication scheduling (one rank)"},
      {"--use-cpu-initialization", false, I, "", "initialization is layout-independent anyway"},
      {"--no-create-attention-mask-in-dataloader", false, I, "", "masks are implicit (causal)"},
      {"--distributed-backend", true, I, "", "Open MPI on CPUs"},
      {"--dataloader-type", true, I, "", "samples are indexed deterministically"},
      {"--num-workers", true, I, "", "data is generated or read in-process"},
      {"--manual-gc", false, I, "", "no garbage collector"},
      {"--manual-gc-interval", true, I, "", "no garbage collector"},
      {"--no-check-for-nan-in-loss-and-grad", false, I, "", "a non-finite grad norm always stops"},
      {"--eval-iters", true, I, "", "evaluation is not implemented yet; training is unchanged"},
      {"--eval-interval", true, I, "", "evaluation is not implemented yet; training is unchanged"},
      {"--tensorboard-dir", true, I, "", "use --metrics-file (JSON lines)"},
      {"--wandb-project", true, I, "", "use --metrics-file (JSON lines)"},
      {"--wandb-exp-name", true, I, "", "use --metrics-file (JSON lines)"},
      {"--log-throughput", false, I, "", "throughput is always logged"},
      {"--log-timers-to-tensorboard", false, I, "", "use --metrics-file"},
      {"--log-memory-to-tensorboard", false, I, "", "peak memory is always logged"},
      {"--log-params-norm", false, I, "", "not logged yet"},
      {"--log-num-zeros-in-grad", false, I, "", "not logged yet"},
      {"--timing-log-level", true, I, "", "one timing level"},
      {"--moe-grouped-gemm", false, I, "", "experts always run as one grouped GEMM"},
      // Flags whose only implemented value is moecore's.
      {"--normalization", true, V, "RMSNorm", "only RMSNorm is implemented"},
      {"--position-embedding-type", true, V, "rope", "only RoPE is implemented"},
      {"--rotary-percent", true, V, "1.0,1", "partial rotary embeddings are not implemented"},
      {"--optimizer", true, V, "adam", "only AdamW is implemented"},
      {"--tokenizer-type", true, V, "ByteLevel", "only the byte-level tokenizer is implemented"},
      {"--attention-dropout", true, V, "0,0.0", "dropout is not implemented (moecore trains without)"},
      {"--hidden-dropout", true, V, "0,0.0", "dropout is not implemented (moecore trains without)"},
      // Flags that would change the model or the training math.
      {"--fp16", false, R, "", "fp16 with loss scaling is not implemented: train in fp32"},
      {"--fp8-format", true, R, "", "fp8 is not implemented"},
      {"--loss-scale", true, R, "", "loss scaling is for fp16, which is not implemented"},
      {"--initial-loss-scale", true, R, "", "loss scaling is for fp16, which is not implemented"},
      {"--use-distributed-optimizer", false, R, "", "the distributed optimizer is not implemented yet"},
      {"--save", true, R, "", "checkpointing is not implemented yet: nothing would be saved"},
      {"--load", true, R, "", "checkpointing is not implemented yet"},
      {"--save-interval", true, R, "", "checkpointing is not implemented yet"},
      {"--split", true, R, "", "train/valid/test splits are not implemented: all data trains"},
      {"--vocab-file", true, R, "", "BPE tokenizers are not implemented: use ByteLevel"},
      {"--merge-file", true, R, "", "BPE tokenizers are not implemented: use ByteLevel"},
      {"--tokenizer-model", true, R, "", "model-file tokenizers are not implemented: use ByteLevel"},
      {"--train-samples", true, R, "", "give --train-iters instead"},
      {"--exit-interval", true, R, "", "early exit is not implemented: set --train-iters"},
      {"--exit-duration-in-mins", true, R, "", "early exit is not implemented"},
      {"--apply-layernorm-1p", false, R, "", "zero-centred norm weights are not implemented"},
      {"--rotary-seq-len-interpolation-factor", true, R, "", "RoPE interpolation is not implemented"},
      {"--moe-shared-expert-gate", false, R, "", "the shared-expert gate is not implemented yet"},
      {"--moe-use-upcycling", false, R, "", "upcycling is not implemented yet"},
      {"--mtp-num-layers", true, R, "", "multi-token prediction is not implemented yet"},
      {"--num-layers-per-virtual-pipeline-stage", true, R, "", "pipeline parallelism is not implemented yet"},
      {"--start-weight-decay", true, R, "", "weight-decay schedules are not implemented"},
      {"--end-weight-decay", true, R, "", "weight-decay schedules are not implemented"},
      {"--weight-decay-incr-style", true, V, "constant", "weight-decay schedules are not implemented"},
  };
  return kFlags;
}

void MegatronCompat::add_to(CLI::App& app) {
  for (const CompatFlag& f : megatron_compat_flags()) {
    std::string name = f.name;
    bool defined = false;
    for (const CLI::Option* o : app.get_options()) defined |= o->check_lname(name.substr(2));
    if (defined) continue;
    std::string* value = &values_.emplace_back();
    CLI::Option* opt = f.takes_value ? app.add_option(name, *value) : app.add_flag(name);
    opt->group("");  // hidden from --help; docs/flags.md lists them
    entries_.push_back(Entry{&f, opt, value});
  }
}

std::vector<std::string> MegatronCompat::check() const {
  std::vector<std::string> notices;
  for (const Entry& e : entries_) {
    if (e.opt->count() == 0) continue;
    const CompatFlag& f = *e.flag;
    switch (f.kind) {
      case CompatKind::Ignored:
        notices.push_back(fmt::format("[flags] {} accepted and ignored: {}", f.name, f.why));
        break;
      case CompatKind::Rejected:
        MOE_FAIL("[flags] {} is not supported: {}. Remove it from the command line or config",
                 f.name, f.why);
      case CompatKind::OnlyValue: {
        std::stringstream allowed(f.allowed);
        std::string item;
        bool ok = false;
        while (std::getline(allowed, item, ',')) ok |= item == *e.value;
        MOE_CHECK(ok, "[flags] {} {} is not supported: {} (accepted: {})", f.name, *e.value, f.why,
                  f.allowed);
        break;
      }
    }
  }
  return notices;
}

}  // namespace moecore::train
