// Activation recomputation settings, shared by the dense model and the MoE layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore {

// Activation recomputation (Megatron's --recompute-* flags; docs/design.md, "Memory").
// selective: the listed modules of every layer drop their saved activations after the forward
// and recompute them in the backward. full: whole layers are recomputed from their input;
// uniform splits the layers into chunks of num_layers and keeps only each chunk's input, block
// recomputes the first num_layers layers one by one and keeps the rest. Recomputation
// repeats the forward's arithmetic exactly: losses and gradients are bitwise unchanged.
enum class RecomputeGranularity : uint8_t { None, Selective, Full };
enum class RecomputeMethod : uint8_t { None, Uniform, Block };

struct RecomputeModules {
  bool core_attn = false;       // the attention core (out and lse) from q, k, v
  bool layernorm = false;       // the outputs of input_layernorm and pre_mlp_layernorm
  bool moe_act = false;         // the routed experts' SwiGLU output from fc1's output
  bool moe = false;             // the whole MoE layer (router, dispatch, experts, shared)
  bool shared_experts = false;  // the shared expert's fc1 output and activation
  bool mlp = false;             // a dense layer's MLP (fc1 output and activation)
  // Multi-latent attention's up projections, rotary and q / k / v layout (q, k, v) from the
  // saved latents (multi-latent attention only).
  bool mla_up_proj = false;
};

struct RecomputeConfig {
  RecomputeGranularity granularity = RecomputeGranularity::None;
  RecomputeMethod method = RecomputeMethod::None;  // --recompute-method (full only)
  int64_t num_layers = 0;                           // --recompute-num-layers (full only)
  // --recompute-modules (selective only); Megatron's default is core_attn.
  std::vector<std::string> module_names = {"core_attn"};

  bool selective() const { return granularity == RecomputeGranularity::Selective; }
  bool full() const { return granularity == RecomputeGranularity::Full; }
  // The modules in effect (all false unless selective).
  RecomputeModules modules() const;
  // Full recomputation: the chunk a layer is recomputed with (-1: its activations are kept).
  // Layers of one chunk are recomputed together from the chunk's input.
  int64_t chunk_of(int64_t layer) const;
  void validate(int64_t model_layers) const;
};

}  // namespace moecore
