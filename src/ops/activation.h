// The MLP activations Megatron offers (--swiglu, the default GeLU, --openai-gelu,
// --squared-relu). SwiGLU is gated: fc1 writes [gate | up] rows of 2F and ops/swiglu.h computes
// it; the others act element by element on F columns.
#pragma once

#include <cstdint>

namespace moecore::ops {

enum class Activation : uint8_t {
  SwiGLU,       // silu(gate) * up (--swiglu)
  GeLU,         // exact: 0.5 x (1 + erf(x / sqrt 2)), Megatron's default
  GeLUTanh,     // the tanh form GPT-2 uses (--openai-gelu, HF's gelu_new)
  SquaredReLU,  // max(x, 0)^2 (--squared-relu)
};

// Whether fc1 writes two halves (gate and up) per row.
constexpr bool activation_gated(Activation a) { return a == Activation::SwiGLU; }
// fc1's output width for an MLP of width F.
constexpr int64_t activation_fc1_width(Activation a, int64_t F) {
  return activation_gated(a) ? 2 * F : F;
}
// "swiglu", "gelu", "openai_gelu", "squared_relu": the names logs and docs use.
constexpr const char* activation_name(Activation a) {
  switch (a) {
    case Activation::SwiGLU: return "swiglu";
    case Activation::GeLU: return "gelu";
    case Activation::GeLUTanh: return "openai_gelu";
    case Activation::SquaredReLU: return "squared_relu";
  }
  return "?";
}

}  // namespace moecore::ops
