#include "nn/recompute.h"

#include "core/check.h"

namespace moecore {

RecomputeModules RecomputeConfig::modules() const {
  RecomputeModules m;
  if (!selective()) return m;
  for (const std::string& name : module_names) {
    if (name == "core_attn") m.core_attn = true;
    else if (name == "layernorm") m.layernorm = true;
    else if (name == "moe_act") m.moe_act = true;
    else if (name == "moe") m.moe = true;
    else if (name == "shared_experts") m.shared_experts = true;
    else if (name == "mlp") m.mlp = true;
    else if (name == "mla_up_proj") m.mla_up_proj = true;
  }
  return m;
}

int64_t RecomputeConfig::chunk_of(int64_t layer) const {
  if (!full()) return -1;
  if (method == RecomputeMethod::Uniform) return layer / num_layers;
  return layer < num_layers ? layer : -1;  // block
}

void RecomputeConfig::validate(int64_t model_layers) const {
  if (granularity == RecomputeGranularity::None) {
    MOE_CHECK(method == RecomputeMethod::None && num_layers == 0,
              "[model] --recompute-method / --recompute-num-layers need "
              "--recompute-granularity full");
    return;
  }
  if (full()) {
    MOE_CHECK(method != RecomputeMethod::None,
              "[model] --recompute-granularity full needs --recompute-method uniform or block");
    MOE_CHECK(num_layers >= 1 && num_layers <= model_layers,
              "[model] --recompute-num-layers={} must be between 1 and --num-layers={} with "
              "--recompute-granularity full",
              num_layers, model_layers);
    return;
  }
  MOE_CHECK(method == RecomputeMethod::None && num_layers == 0,
            "[model] --recompute-method and --recompute-num-layers apply to "
            "--recompute-granularity full only; selective recomputation takes "
            "--recompute-modules");
  MOE_CHECK(!module_names.empty(),
            "[model] --recompute-granularity selective with no --recompute-modules");
  for (const std::string& name : module_names) {
    MOE_CHECK(name == "core_attn" || name == "layernorm" || name == "moe_act" || name == "moe" ||
                  name == "shared_experts" || name == "mlp" || name == "mla_up_proj",
              "[model] unknown --recompute-modules entry '{}': choose from core_attn, layernorm, "
              "moe_act, moe, shared_experts, mlp, mla_up_proj",
              name);
  }
}

}  // namespace moecore
