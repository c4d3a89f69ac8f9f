// Test-only plain-loop interpreter of cuDNN's SDPA forward and backward as documented
// (https://docs.nvidia.com/deeplearning/cudnn/frontend/latest/operations/Attention.html; the
// semantics are restated in ops/desc/sdpa_desc.h): every tensor addressed through the
// descriptor's [B, H, S, D] dims and strides over the raw buffers the backend passes, query
// head h on key/value head h / (h_q / h_k), S = attn_scale Q K^T under the diagonal band
// (TOP_LEFT: j <= i + right_bound; BOTTOM_RIGHT: j <= i + s_kv - s_q + right_bound), P the
// softmax over the visible keys, O = P V, Stats = max + ln(sum exp(S - max)) (log2 of the same
// with stats_log2). Backward (FlashAttention-2 from the given O and Stats): P = exp(S - Stats),
// delta_i = sum_d dO_id O_id, dV = P^T dO, dP = dO V^T, dS = P o (dP - delta),
// dQ = attn_scale dS K, dK = attn_scale dS^T Q, the query heads of a group summed into their
// key/value head. It checks what cuDNN checks on the graph (dims agree across tensors, h_k == h_v
// divides h_q, D's stride 1, f32 Stats) and sums in double; loads and stores follow each
// tensor's type (bf16 rounds to nearest even on store, as the kernels' epilogues).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "ops/desc/sdpa_desc.h"

namespace moecore::testing {

using ops::desc::SdpaAlignment;
using ops::desc::SdpaDataType;
using ops::desc::SdpaDesc;
using ops::desc::SdpaTensor;

inline double sdpa_load(const SdpaTensor& t, const void* p, int64_t i) {
  switch (t.type) {
    case SdpaDataType::Bf16:
      return bf16_to_float(static_cast<const bf16*>(p)[i]);
    case SdpaDataType::F32:
      return static_cast<const float*>(p)[i];
    case SdpaDataType::F64:
      return static_cast<const double*>(p)[i];
  }
  throw std::runtime_error("sdpa_load: bad type");
}

inline void sdpa_store(const SdpaTensor& t, void* p, int64_t i, double v) {
  switch (t.type) {
    case SdpaDataType::Bf16:
      static_cast<bf16*>(p)[i] = float_to_bf16(static_cast<float>(v));
      return;
    case SdpaDataType::F32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      return;
    case SdpaDataType::F64:
      static_cast<double*>(p)[i] = v;
      return;
  }
}

inline int64_t sdpa_at(const SdpaTensor& t, int64_t b, int64_t h, int64_t s, int64_t d) {
  return b * t.stride[0] + h * t.stride[1] + s * t.stride[2] + d * t.stride[3];
}

// The graph checks cuDNN makes (validate / check_support), as far as the interpreter depends on
// them; a refused descriptor must never reach the library.
inline void sdpa_check(const SdpaDesc& d) {
  auto check = [](bool ok, const std::string& what) {
    if (!ok) throw std::runtime_error("cuDNN SDPA: CUDNN_STATUS_BAD_PARAM: " + what);
  };
  check(d.refusal.empty(), "a refused descriptor reached the library: " + d.refusal);
  auto dims = [](const SdpaTensor& t, int64_t b, int64_t h, int64_t s, int64_t dd) {
    return t.dim[0] == b && t.dim[1] == h && t.dim[2] == s && t.dim[3] == dd && t.stride[3] == 1;
  };
  check(dims(d.q, d.b, d.h_q, d.s_q, d.d_qk), "Q is not [b, h_q, s_q, d_qk] with D stride 1");
  check(dims(d.k, d.b, d.h_k, d.s_kv, d.d_qk), "K is not [b, h_k, s_kv, d_qk] with D stride 1");
  check(dims(d.v, d.b, d.h_v, d.s_kv, d.d_v), "V is not [b, h_v, s_kv, d_v] with D stride 1");
  check(dims(d.o, d.b, d.h_q, d.s_q, d.d_v), "O is not [b, h_q, s_q, d_v] with D stride 1");
  check(dims(d.stats, d.b, d.h_q, d.s_q, 1) && d.stats.type == SdpaDataType::F32,
        "Stats is not f32 [b, h_q, s_q, 1]");
  check(d.h_k == d.h_v && d.h_k > 0 && d.h_q % d.h_k == 0, "h_k == h_v must divide h_q");
  check(d.right_bound >= 0, "negative diagonal band right bound");
}

inline bool sdpa_visible(const SdpaDesc& d, int64_t i, int64_t j) {
  if (!d.masked) return true;
  const int64_t shift = d.alignment == SdpaAlignment::BottomRight ? d.s_kv - d.s_q : 0;
  return j <= i + shift + d.right_bound;
}

// S (scaled, -inf where masked) of one (b, h) as [s_q, s_kv].
inline std::vector<double> sdpa_scores(const SdpaDesc& d, const void* q, const void* k, int64_t b,
                                       int64_t h) {
  const int64_t g = h / (d.h_q / d.h_k);
  std::vector<double> S(static_cast<size_t>(d.s_q * d.s_kv));
  for (int64_t i = 0; i < d.s_q; ++i) {
    for (int64_t j = 0; j < d.s_kv; ++j) {
      double acc = -std::numeric_limits<double>::infinity();
      if (sdpa_visible(d, i, j)) {
        acc = 0.0;
        for (int64_t x = 0; x < d.d_qk; ++x)
          acc += sdpa_load(d.q, q, sdpa_at(d.q, b, h, i, x)) *
                 sdpa_load(d.k, k, sdpa_at(d.k, b, g, j, x));
        acc *= static_cast<double>(d.attn_scale);
      }
      S[i * d.s_kv + j] = acc;
    }
  }
  return S;
}

// The forward with generate_stats: O and Stats.
inline void sdpa_forward(const SdpaDesc& d, const void* q, const void* k, const void* v, void* o,
                         void* stats) {
  sdpa_check(d);
  if (d.empty) return;
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h_q; ++h) {
      const int64_t g = h / (d.h_q / d.h_v);
      std::vector<double> P = sdpa_scores(d, q, k, b, h);
      for (int64_t i = 0; i < d.s_q; ++i) {
        double* row = &P[i * d.s_kv];
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < d.s_kv; ++j) mx = std::max(mx, row[j]);
        if (!std::isfinite(mx)) throw std::runtime_error("cuDNN SDPA: a query row sees no key");
        double sum = 0.0;
        for (int64_t j = 0; j < d.s_kv; ++j) sum += std::exp(row[j] - mx);
        const double lse = mx + std::log(sum);
        sdpa_store(d.stats, stats, sdpa_at(d.stats, b, h, i, 0),
                   d.stats_log2 ? lse / std::log(2.0) : lse);
        for (int64_t j = 0; j < d.s_kv; ++j) row[j] = std::exp(row[j] - mx) / sum;
        for (int64_t x = 0; x < d.d_v; ++x) {
          double acc = 0.0;
          for (int64_t j = 0; j < d.s_kv; ++j)
            acc += row[j] * sdpa_load(d.v, v, sdpa_at(d.v, b, g, j, x));
          sdpa_store(d.o, o, sdpa_at(d.o, b, h, i, x), acc);
        }
      }
    }
  }
}

// The backward: dQ, dK, dV (laid out as Q, K, V) from Q, K, V, O, dO (laid out as O), Stats.
inline void sdpa_backward(const SdpaDesc& d, const void* q, const void* k, const void* v,
                          const void* o, const void* dout, const void* stats, void* dq, void* dk,
                          void* dv) {
  sdpa_check(d);
  if (d.empty) return;
  const double scale = static_cast<double>(d.attn_scale);
  for (int64_t b = 0; b < d.b; ++b) {
    // dK, dV of this batch item accumulated over the query heads of each group, then stored.
    std::vector<double> dK(static_cast<size_t>(d.h_k * d.s_kv * d.d_qk), 0.0);
    std::vector<double> dV(static_cast<size_t>(d.h_v * d.s_kv * d.d_v), 0.0);
    for (int64_t h = 0; h < d.h_q; ++h) {
      const int64_t g = h / (d.h_q / d.h_k);
      std::vector<double> P = sdpa_scores(d, q, k, b, h);
      for (int64_t i = 0; i < d.s_q; ++i) {
        double lse = sdpa_load(d.stats, stats, sdpa_at(d.stats, b, h, i, 0));
        if (d.stats_log2) lse *= std::log(2.0);
        double delta = 0.0;
        for (int64_t x = 0; x < d.d_v; ++x)
          delta += sdpa_load(d.o, dout, sdpa_at(d.o, b, h, i, x)) *
                   sdpa_load(d.o, o, sdpa_at(d.o, b, h, i, x));
        std::vector<double> dq_row(static_cast<size_t>(d.d_qk), 0.0);
        for (int64_t j = 0; j < d.s_kv; ++j) {
          const double p = std::exp(P[i * d.s_kv + j] - lse);  // 0 where masked (-inf)
          double dp = 0.0;
          for (int64_t x = 0; x < d.d_v; ++x) {
            const double g_o = sdpa_load(d.o, dout, sdpa_at(d.o, b, h, i, x));
            dp += g_o * sdpa_load(d.v, v, sdpa_at(d.v, b, g, j, x));
            dV[(g * d.s_kv + j) * d.d_v + x] += p * g_o;
          }
          const double ds = p * (dp - delta);
          for (int64_t x = 0; x < d.d_qk; ++x) {
            dq_row[x] += scale * ds * sdpa_load(d.k, k, sdpa_at(d.k, b, g, j, x));
            dK[(g * d.s_kv + j) * d.d_qk + x] +=
                scale * ds * sdpa_load(d.q, q, sdpa_at(d.q, b, h, i, x));
          }
        }
        for (int64_t x = 0; x < d.d_qk; ++x)
          sdpa_store(d.q, dq, sdpa_at(d.q, b, h, i, x), dq_row[x]);
      }
    }
    for (int64_t g = 0; g < d.h_k; ++g) {
      for (int64_t j = 0; j < d.s_kv; ++j) {
        for (int64_t x = 0; x < d.d_qk; ++x)
          sdpa_store(d.k, dk, sdpa_at(d.k, b, g, j, x), dK[(g * d.s_kv + j) * d.d_qk + x]);
        for (int64_t x = 0; x < d.d_v; ++x)
          sdpa_store(d.v, dv, sdpa_at(d.v, b, g, j, x), dV[(g * d.s_kv + j) * d.d_v + x]);
      }
    }
  }
}

}  // namespace moecore::testing
