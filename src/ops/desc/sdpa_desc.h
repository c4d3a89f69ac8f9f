// The cuDNN SDPA (fused flash attention) graph of one call of ops::attention_forward / backward:
// a pure function from the op's arguments to exactly what the CUDA backend hands the cuDNN
// frontend (src/ops/cuda/attention_cudnn.cpp), tested on the CPU through a plain-loop
// interpreter of cuDNN's documented SDPA semantics (tests/common/sdpa_interpreter.h) against
// ops::attention_forward_ref / attention_backward_ref.
//
// cuDNN's SDPA
// (https://docs.nvidia.com/deeplearning/cudnn/frontend/latest/operations/Attention.html) names
// every tensor in the logical order [B, H, S, D] with arbitrary strides (the last, D's, 1):
//   Q [b, h_q, s_q, d_qk], K [b, h_k, s_kv, d_qk], V [b, h_v, s_kv, d_v], O and dO [b, h_q, s_q,
//   d_v], Stats [b, h_q, s_q, 1] (f32); dQ, dK, dV as Q, K, V.
// Query head h reads key/value head h / (h_q / h_k) (GQA / MQA: h_k == h_v divides h_q), and
// S = attn_scale Q K^T is masked by the diagonal band: with TOP_LEFT alignment key j is visible to
// query i iff j <= i + right_bound, with BOTTOM_RIGHT iff j <= i + (s_kv - s_q) + right_bound
// (set_causal_mask is TOP_LEFT with right bound 0, set_causal_mask_bottom_right BOTTOM_RIGHT with
// 0). P = softmax(S) over the visible keys, O = P V, and Stats = max_j S_ij + ln sum_j
// exp(S_ij - max) -- the natural log of the scaled scores (log2 only with set_stats_use_log2,
// cuDNN >= 9.27). The backward (FlashAttention-2) recomputes P = exp(S - Stats) and takes
// delta_i = sum_d dO_id O_id from the O and Stats it is given.
//
// The project's op (ops/attention.h) stores q, out [S, B, Hq, D] and k, v [Sk, B, Hkv, D]
// (sequence-major): element (s, b, h, d) at ((s B + b) H + h) D + d, i.e. strides
// {H D, D, B H D, 1} in cuDNN's [B, H, S, D] order; lse [B, Hq, lse_stride] is Stats with strides
// {Hq ld, ld, 1, 1}, and the op's lse is the same quantity (natural log, scaled scores), so it is
// passed through unconverted. Its scale is 1/sqrt(D); its mask (key j visible to query i iff
// k_offset + j <= q_offset + i) is the TOP_LEFT band with right bound q_offset - k_offset, named
// as cuDNN's plain causal (bound 0) or bottom-right causal where it is one, and no mask at all
// where every key is visible.
#pragma once

#include <cstdint>
#include <string>

#include "ops/attention.h"

namespace moecore::ops::desc {

// Element types of the SDPA graph's tensors (cudnn_frontend::DataType_t's, by name: the
// frontend's enum is a C++ enum of its own, mapped in the CUDA translation unit).
enum class SdpaDataType : uint8_t { Bf16, F32, F64 };

// cudnn_frontend::DiagonalAlignment_t.
enum class SdpaAlignment : uint8_t { TopLeft, BottomRight };

// One tensor of the graph: dims and strides (elements) in cuDNN's logical [B, H, S, D] order.
struct SdpaTensor {
  int64_t dim[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};
  SdpaDataType type = SdpaDataType::Bf16;
};

// One attention call as the op states it: the op's shape (q_offset / k_offset / lse_stride of the
// block form included), the element type the buffers handed to cuDNN hold, and the dropout.
// d_v: the value (and output) head width (0: shape.D), for multi-latent attention's unequal q/k
// and v heads, stored [Sk, B, Hkv, d_v] and [S, B, Hq, d_v]; scale: the softmax scale
// (0: 1/sqrt(shape.D), the op's).
struct SdpaCall {
  AttentionShape shape;
  SdpaDataType storage = SdpaDataType::Bf16;
  double dropout_p = 0.0;
  int64_t d_v = 0;
  double scale = 0.0;
};

struct SdpaDesc {
  // Empty when it is expressible as a cuDNN SDPA graph; otherwise why not (the backend then runs
  // its own kernel and says so). The fields below are filled either way where they are defined.
  std::string refusal;
  bool empty = false;  // no query row, batch item or head: nothing to compute, no call
  int64_t b = 0, h_q = 0, h_k = 0, h_v = 0, s_q = 0, s_kv = 0, d_qk = 0, d_v = 0;
  SdpaTensor q, k, v, o, stats;  // dO as o, dQ as q, dK as k, dV as v
  float attn_scale = 0.0f;
  bool masked = false;  // false: every key visible to every query (no diagonal band)
  SdpaAlignment alignment = SdpaAlignment::TopLeft;
  int64_t right_bound = 0;
  bool stats_log2 = false;  // set_stats_use_log2: never (the op's lse is natural log)
  bool causal_top_left() const {
    return masked && alignment == SdpaAlignment::TopLeft && right_bound == 0;
  }
  bool causal_bottom_right() const {
    return masked && alignment == SdpaAlignment::BottomRight && right_bound == 0;
  }
};

// cuDNN's limits this descriptor refuses outside of (Hopper, cuDNN 9; the support matrix of the
// page above): head widths at most 256 and a multiple of 8 (16-byte rows of bf16), fp16 / bf16 /
// fp8 storage only (the f32 and f64 runs keep the own kernel), no dropout (the op's dropout draws
// layout-independent keep bits from global indices, cuDNN's Philox draws its own), sizes and
// the band's bound within int32.
inline constexpr int64_t kSdpaMaxHeadDim = 256;

// The descriptor of a call. Throws naming the values when the call itself is impossible (the
// op's shape check, d_v < 0, scale < 0); a call that is possible but not expressible in cuDNN
// returns with `refusal` set.
SdpaDesc sdpa_desc(const SdpaCall& call);

const char* sdpa_data_type_name(SdpaDataType t);

}  // namespace moecore::ops::desc
