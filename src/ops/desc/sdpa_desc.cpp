// The attention op -> cuDNN SDPA graph translation (see sdpa_desc.h for the semantics).
#include "ops/desc/sdpa_desc.h"

#include <cmath>
#include <limits>

#include "core/check.h"

namespace moecore::ops::desc {

namespace {

// A sequence-major [S, B, H, D] buffer in cuDNN's [B, H, S, D] order.
SdpaTensor sequence_major(SdpaDataType type, int64_t S, int64_t B, int64_t H, int64_t D) {
  SdpaTensor t;
  t.type = type;
  t.dim[0] = B;
  t.dim[1] = H;
  t.dim[2] = S;
  t.dim[3] = D;
  t.stride[0] = H * D;
  t.stride[1] = D;
  t.stride[2] = B * H * D;
  t.stride[3] = 1;
  return t;
}

}  // namespace

const char* sdpa_data_type_name(SdpaDataType t) {
  switch (t) {
    case SdpaDataType::Bf16:
      return "bf16";
    case SdpaDataType::F32:
      return "f32";
    case SdpaDataType::F64:
      return "f64";
  }
  return "?";
}

SdpaDesc sdpa_desc(const SdpaCall& call) {
  const AttentionShape& s = call.shape;
  check_attention_shape(s, "sdpa_desc");
  MOE_CHECK(call.d_v >= 0, "[sdpa_desc] d_v={} must be >= 0 (0: the q/k head width D={})", call.d_v,
            s.D);
  MOE_CHECK(call.scale >= 0.0 && std::isfinite(call.scale),
            "[sdpa_desc] scale={} must be finite and >= 0 (0: 1/sqrt(D))", call.scale);
  SdpaDesc d;
  d.b = s.B;
  d.h_q = s.Hq;
  d.h_k = d.h_v = s.Hkv;
  d.s_q = s.S;
  d.s_kv = s.keys();
  d.d_qk = s.D;
  d.d_v = call.d_v == 0 ? s.D : call.d_v;
  d.q = sequence_major(call.storage, d.s_q, d.b, d.h_q, d.d_qk);
  d.k = sequence_major(call.storage, d.s_kv, d.b, d.h_k, d.d_qk);
  d.v = sequence_major(call.storage, d.s_kv, d.b, d.h_v, d.d_v);
  d.o = sequence_major(call.storage, d.s_q, d.b, d.h_q, d.d_v);
  // Stats [B, Hq, S, 1] over lse [B, Hq, lse_stride]: f32 whatever the storage (cuDNN's).
  d.stats.type = SdpaDataType::F32;
  d.stats.dim[0] = d.b;
  d.stats.dim[1] = d.h_q;
  d.stats.dim[2] = d.s_q;
  d.stats.dim[3] = 1;
  d.stats.stride[0] = d.h_q * s.lse_ld();
  d.stats.stride[1] = s.lse_ld();
  d.stats.stride[2] = 1;
  d.stats.stride[3] = 1;
  const double scale = call.scale == 0.0 ? 1.0 / std::sqrt(static_cast<double>(s.D)) : call.scale;
  d.attn_scale = static_cast<float>(scale);
  d.stats_log2 = false;
  d.empty = d.s_q == 0 || d.b == 0 || d.h_q == 0;

  // The mask: key j visible to query i iff j <= i + delta, delta = q_offset - k_offset >= 0.
  const int64_t delta = s.q_offset - s.k_offset;
  if (delta >= d.s_kv - 1) {
    d.masked = false;  // every key of the block is before (or at) every query
  } else if (delta == 0) {
    d.masked = true;  // cuDNN's causal mask
    d.alignment = SdpaAlignment::TopLeft;
    d.right_bound = 0;
  } else if (delta == d.s_kv - d.s_q) {
    d.masked = true;  // cuDNN's bottom-right causal mask
    d.alignment = SdpaAlignment::BottomRight;
    d.right_bound = 0;
  } else {
    d.masked = true;
    d.alignment = SdpaAlignment::TopLeft;
    d.right_bound = delta;
  }

  // What cuDNN cannot take: the backend keeps its own kernel for these.
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  auto refuse = [&d](std::string why) {
    if (d.refusal.empty()) d.refusal = std::move(why);
  };
  if (call.storage != SdpaDataType::Bf16)
    refuse(fmt::format("{} storage (cuDNN's SDPA takes fp16, bf16 and fp8 only)",
                       sdpa_data_type_name(call.storage)));
  if (call.dropout_p != 0.0)
    refuse(
        fmt::format("attention dropout {} (the op's keep bits are drawn from global indices; "
                    "cuDNN's dropout draws its own)",
                    call.dropout_p));
  if (d.d_qk > kSdpaMaxHeadDim || d.d_v > kSdpaMaxHeadDim)
    refuse(fmt::format("head width q/k {} v {} over cuDNN's {}", d.d_qk, d.d_v, kSdpaMaxHeadDim));
  if (d.d_qk % 8 != 0 || d.d_v % 8 != 0 || d.d_qk == 0 || d.d_v == 0)
    refuse(fmt::format("head width q/k {} v {} not a positive multiple of 8 (cuDNN's 16-byte rows)",
                       d.d_qk, d.d_v));
  if (d.b > kInt32Max || d.h_q > kInt32Max || d.s_q > kInt32Max || d.s_kv > kInt32Max ||
      d.right_bound > kInt32Max)
    refuse(fmt::format("sizes over cuDNN's int32 (B {} Hq {} S {} Sk {} band {})", d.b, d.h_q,
                       d.s_q, d.s_kv, d.right_bound));
  return d;
}

}  // namespace moecore::ops::desc
