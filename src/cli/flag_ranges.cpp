#include "cli/flag_ranges.h"

#include <fmt/format.h>

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "core/check.h"

namespace moecore::cli {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// numpy's RandomState (Megatron's data order) takes seeds in [0, 2^32).
constexpr double kMaxSeed = 4294967295.0;

FlagRange at_least(const char* flag, double lo, const char* why = "") {
  return {flag, lo, false, kInf, true, why};
}
FlagRange above(const char* flag, double lo, const char* why = "") {
  return {flag, lo, true, kInf, true, why};
}
FlagRange fraction(const char* flag, const char* why = "") { return {flag, 0, false, 1, true, why}; }

std::string range_text(const FlagRange& r) {
  if (r.hi == kInf) return fmt::format("{} {}", r.lo_open ? ">" : ">=", r.lo);
  return fmt::format("in {}{}, {}{}", r.lo_open ? "(" : "[", r.lo, r.hi, r.hi_open ? ")" : "]");
}

bool matches(const GivenFlag& g, const char* flag) {
  if (g.name == flag) return true;
  if (g.megatron == nullptr) return false;
  for (const std::string& n : g.megatron->names) {
    if (n == flag) return true;
  }
  return false;
}

bool is_int_flag(const GivenFlag& g) {
  return g.megatron != nullptr && g.megatron->type == ArgType::Int;
}

}  // namespace

const std::vector<FlagRange>& flag_ranges() {
  static const std::vector<FlagRange> table = {
      // Model sizes: 0 is not "unset" when given.
      at_least("--num-layers", 1),
      at_least("--hidden-size", 1),
      at_least("--ffn-hidden-size", 1, "omit it for Megatron's default, 4 x --hidden-size"),
      at_least("--num-attention-heads", 1),
      at_least("--num-query-groups", 1),
      at_least("--kv-channels", 1, "omit it for --hidden-size / --num-attention-heads"),
      at_least("--seq-length", 1),
      at_least("--max-position-embeddings", 1),
      above("--rotary-base", 0),
      above("--norm-epsilon", 0, "the norms divide by sqrt(variance + epsilon)"),
      fraction("--hidden-dropout", "a probability; 1 would drop everything"),
      fraction("--attention-dropout", "a probability; 1 would drop everything"),
      at_least("--vocab-size", 2),
      at_least("--make-vocab-size-divisible-by", 1),
      at_least("--init-method-std", 0),
      at_least("--num-experts", 0, "0 or omitted: a dense model"),
      at_least("--moe-ffn-hidden-size", 1, "omit it for --ffn-hidden-size"),
      at_least("--moe-shared-expert-intermediate-size", 0, "0 or omitted: no shared expert"),
      at_least("--moe-layer-freq", 1),
      at_least("--moe-router-topk", 1),
      above("--moe-router-topk-scaling-factor", 0),
      at_least("--moe-aux-loss-coeff", 0),
      at_least("--moe-z-loss-coeff", 0),
      fraction("--moe-input-jitter-eps", "inputs are scaled by U(1 - eps, 1 + eps)"),
      at_least("--moe-router-num-groups", 1),
      at_least("--moe-router-group-topk", 1),
      at_least("--moe-router-bias-update-rate", 0),
      {"--moe-router-quantile-balancing-ema", 0, false, 1, false, "an EMA factor"},
      at_least("--moe-expert-rank-capacity-factor", 1,
               "below 1 an EP rank could not receive its balanced share"),
      // Training.
      at_least("--micro-batch-size", 1),
      at_least("--global-batch-size", 1),
      at_least("--train-iters", 1),
      {"--seed", 0, false, kMaxSeed, false, "numpy's RandomState orders Megatron's samples"},
      at_least("--clip-grad", 0, "0: no clipping"),
      at_least("--recompute-num-layers", 1),
      at_least("--lr", 0),
      at_least("--min-lr", 0),
      at_least("--lr-warmup-iters", 0),
      fraction("--lr-warmup-fraction"),
      at_least("--lr-warmup-init", 0),
      at_least("--lr-decay-iters", 1),
      at_least("--lr-wsd-decay-iters", 0),
      at_least("--weight-decay", 0),
      fraction("--adam-beta1"),
      fraction("--adam-beta2"),
      above("--adam-eps", 0, "Adam divides by sqrt(v) + eps"),
      at_least("--log-interval", 1),
      at_least("--peak-tflops", 0, "0 or omitted: measured at start-up"),
      at_least("--ddp-bucket-size", 0, "0 or omitted: one bucket per layer"),
      at_least("--eval-interval", 0, "0 or omitted: only after training"),
      at_least("--eval-iters", 0, "0: no evaluation"),
      at_least("--spike-check-samples", 1, "the history a spike is measured against"),
      at_least("--iterations-to-skip", 1, "iterations are 1-based"),
      // Checkpointing and stopping.
      at_least("--save-interval", 0, "0 or omitted: only when training ends or stops"),
      at_least("--ckpt-step", 0),
      at_least("--exit-interval", 0, "0 or omitted: no interval"),
      at_least("--exit-duration-in-mins", 0),
      // Parallelism.
      at_least("--tensor-model-parallel-size", 1),
      at_least("--pipeline-model-parallel-size", 1),
      at_least("--context-parallel-size", 1),
      at_least("--expert-model-parallel-size", 1),
      at_least("--expert-tensor-parallel-size", 1),
      at_least("--decoder-first-pipeline-num-layers", 0),
      at_least("--decoder-last-pipeline-num-layers", 0),
      at_least("--num-virtual-stages-per-pipeline-rank", 1),
      at_least("--num-layers-per-virtual-pipeline-stage", 1),
      at_least("--microbatch-group-size-per-virtual-pipeline-stage", 1),
      above("--distributed-timeout-minutes", 0),
  };
  return table;
}

void check_flag_ranges(const ParsedArgs& given) {
  for (const GivenFlag& g : given.flags) {
    const bool is_float = g.megatron != nullptr && g.megatron->type == ArgType::Float;
    const FlagRange* range = nullptr;
    for (const FlagRange& r : flag_ranges()) {
      if (matches(g, r.flag)) range = &r;
    }
    const bool is_int = is_int_flag(g);
    if (!is_float && !is_int && range == nullptr) continue;
    for (const std::string& v : g.values) {
      if (is_int) {
        int64_t i = 0;
        const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), i);
        MOE_CHECK(ec != std::errc::result_out_of_range,
                  "[flags] {} {} does not fit in 64 bits: give a realistic value", g.name, v);
      }
      char* end = nullptr;
      errno = 0;
      const double x = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0') continue;  // not a number: the parser says so
      // Python's float() takes "nan", "inf" and 1e400 (= inf); none is a meaningful value of
      // any flag, and each would surface steps later as a NaN loss or a silent default.
      MOE_CHECK(std::isfinite(x), "[flags] {} {} is not a finite number: give a finite value",
                g.name, v);
      if (range == nullptr) continue;
      const bool ok = (range->lo_open ? x > range->lo : x >= range->lo) &&
                      (range->hi_open ? x < range->hi : x <= range->hi);
      MOE_CHECK(ok, "[flags] {} {} is out of range: it must be {}{}{}", g.name, v,
                range_text(*range), *range->why != '\0' ? " (" : "",
                *range->why != '\0' ? fmt::format("{})", range->why) : "");
    }
  }
}

}  // namespace moecore::cli
