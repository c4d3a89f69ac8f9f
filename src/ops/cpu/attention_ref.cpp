// Plain-loop causal GQA attention: the oracle the fast path is tested against. It materialises
// each head's full S x Sk probabilities and accumulates in double, so its own rounding is far
// below the f32 tolerances it judges. The backward is derived from the math alone. Dropout draws
// each keep bit with its own dropout_keep call and materialises the S x S factors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/check.h"
#include "ops/attention.h"

namespace moecore::ops {

// The op's argument checks, here beside the reference that every build (and the grid emulator's
// sanitizer build, which links the kernels' references alone) has.
void check_attention_dropout(const AttentionDropout* drop, const char* op) {
  if (drop == nullptr) return;
  MOE_CHECK(drop->p >= 0.0 && drop->p < 1.0,
            "[{}] attention dropout p={} outside [0, 1): pass e.g. 0.1, or 0 / no AttentionDropout "
            "for none",
            op, drop->p);
  MOE_CHECK(drop->p == 0.0 || drop->counters != nullptr,
            "[{}] attention dropout p={} without counters: pass the micro-batch's DropoutCounters",
            op, drop->p);
  MOE_CHECK(drop->head0 >= 0,
            "[{}] attention dropout head0={} < 0: pass the global index of the "
            "rank's first query head",
            op, drop->head0);
}

void check_attention_shape(const AttentionShape& s, const char* op) {
  MOE_CHECK(s.S >= 0 && s.B >= 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0,
            "[{}] bad shape S={} B={} Hq={} Hkv={} D={}: sizes must be >= 0 and Hq, Hkv, D > 0", op,
            s.S, s.B, s.Hq, s.Hkv, s.D);
  MOE_CHECK(s.Hq % s.Hkv == 0,
            "[{}] Hq={} not a multiple of Hkv={}: choose a number of query heads divisible by "
            "the number of key/value groups",
            op, s.Hq, s.Hkv);
  MOE_CHECK(s.Sk >= 0 && s.q_offset >= 0 && s.k_offset >= 0 && (s.S == 0 || s.keys() > 0),
            "[{}] bad block S={} Sk={} q_offset={} k_offset={}: sizes and offsets must be >= 0, "
            "with at least one key for the queries",
            op, s.S, s.Sk, s.q_offset, s.k_offset);
  MOE_CHECK(s.q_offset >= s.k_offset,
            "[{}] block q_offset={} < k_offset={}: query row 0 would see no key (a block whose "
            "rows all precede its keys is fully masked); skip such a block, or start the keys at "
            "or before the first query",
            op, s.q_offset, s.k_offset);
  MOE_CHECK(s.lse_stride == 0 || s.lse_stride >= s.S,
            "[{}] lse_stride={} < S={}: the lse rows of (b, h) would overlap; pass 0 (= S) or the "
            "length of the layer's lse rows",
            op, s.lse_stride, s.S);
}

namespace {

// P[i, j] for one (b, h): softmax over the visible keys (k_offset + j <= q_offset + i) of
// scale * q_i . k_j, zero elsewhere; lse_S[i] = log sum over those keys of exp(scale q_i . k_j).
// P is [S, Sk] row-major.
template <typename T>
void probabilities_ref(std::vector<double>& P_SS, std::vector<double>& lse_S, const T* q,
                       const T* k, const AttentionShape& s, int64_t b, int64_t h) {
  const int64_t S = s.S, Sk = s.keys(), B = s.B, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
  const int64_t g = h / (Hq / Hkv);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t i = 0; i < S; ++i) {
    const T* q_i = q + ((i * B + b) * Hq + h) * D;
    const int64_t last = std::min(Sk - 1, s.q_offset + i - s.k_offset);  // >= 0 (checked)
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < Sk; ++j) {
      double score = 0.0;
      if (j <= last) {
        const T* k_j = k + ((j * B + b) * Hkv + g) * D;
        for (int64_t d = 0; d < D; ++d) {
          score += static_cast<double>(q_i[d]) * static_cast<double>(k_j[d]);
        }
        score *= scale;
        mx = std::max(mx, score);
      }
      P_SS[i * Sk + j] = score;
    }
    double sum = 0.0;
    for (int64_t j = 0; j <= last; ++j) sum += std::exp(P_SS[i * Sk + j] - mx);
    lse_S[i] = mx + std::log(sum);
    for (int64_t j = 0; j < Sk; ++j) {
      P_SS[i * Sk + j] = j <= last ? std::exp(P_SS[i * Sk + j] - mx) / sum : 0.0;
    }
  }
}

// M[i, j] = keep ? 1 / (1 - p) : 0 for one (b, h) at the global positions (q_offset + i,
// k_offset + j) of the visible keys (1 everywhere without dropout). [S, Sk] row-major.
void dropout_factors_ref(std::vector<double>& M_SS, const AttentionDropout* drop,
                         const AttentionShape& s, int64_t b, int64_t h) {
  std::fill(M_SS.begin(), M_SS.end(), 1.0);
  if (drop == nullptr || drop->p == 0.0) return;
  const int64_t S = s.S, Sk = s.keys();
  const DropoutCounters* c = raw_ptr(drop->counters);
  const uint64_t key = dropout_head_key(drop->key, static_cast<uint64_t>(drop->head0 + h));
  const uint32_t threshold = dropout_threshold(drop->p);
  const double scale = 1.0 / (1.0 - drop->p);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t last = std::min(Sk - 1, s.q_offset + i - s.k_offset);
    for (int64_t j = 0; j <= last; ++j) {
      const bool keep = dropout_keep(key, static_cast<uint64_t>(c->iteration),
                                     static_cast<uint64_t>(c->sample0 + b),
                                     static_cast<uint64_t>(s.q_offset + i),
                                     static_cast<uint64_t>(s.k_offset + j), threshold);
      M_SS[i * Sk + j] = keep ? scale : 0.0;
    }
  }
}

}  // namespace

template <typename T>
void attention_forward_ref(T* out, T* lse, const T* q, const T* k, const T* v,
                           const AttentionShape& s, const AttentionDropout* drop) {
  check_attention_shape(s, "attention_ref");
  check_attention_dropout(drop, "attention_ref");
  const int64_t S = s.S, Sk = s.keys(), B = s.B, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
  std::vector<double> P_SS(S * Sk), M_SS(S * Sk), lse_S(S);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      probabilities_ref(P_SS, lse_S, q, k, s, b, h);
      dropout_factors_ref(M_SS, drop, s, b, h);
      for (int64_t i = 0; i < S * Sk; ++i) P_SS[i] *= M_SS[i];  // lse_S stays undropped
      for (int64_t i = 0; i < S; ++i) {
        lse[(b * Hq + h) * s.lse_ld() + i] = static_cast<T>(lse_S[i]);
        T* o_i = out + ((i * B + b) * Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (int64_t j = 0; j < Sk; ++j) {
            acc += P_SS[i * Sk + j] * static_cast<double>(v[((j * B + b) * Hkv + g) * D + d]);
          }
          o_i[d] = static_cast<T>(acc);
        }
      }
    }
  }
}

// Recomputes P from q and k and takes delta_i = sum_j P_ij (M o dP)_ij (== rowsum(dO * O)), so
// the oracle of the whole sequence depends on nothing the forward saved: `out` and `lse` are
// accepted for signature parity with the fast path and unused there. With dropout (M the factors
// above), out = (P o M) V gives dV = (P o M)^T dO and, through the softmax,
// dS = P o (M o dP - delta). A block (AttentionShape::is_block) is one part of a larger softmax:
// its P is rescaled from the block's own normaliser to the given (merged) lse,
// P_ij *= exp(lse_block_i - lse_i), and delta_i = rowsum(dO o O) over the given (merged) out.
template <typename T>
void attention_backward_ref(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                            const T* out, const T* lse, const AttentionShape& s,
                            const AttentionDropout* drop) {
  check_attention_shape(s, "attention_ref");
  check_attention_dropout(drop, "attention_ref");
  const int64_t S = s.S, Sk = s.keys(), B = s.B, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
  const bool block = s.is_block();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> P_SS(S * Sk), dP_SS(S * Sk), M_SS(S * Sk), lse_S(S);
  // GQA: dK/dV of a kv head sum over the query heads of its group; accumulate in double.
  std::vector<double> dk_acc(Sk * B * Hkv * D, 0.0), dv_acc(Sk * B * Hkv * D, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      probabilities_ref(P_SS, lse_S, q, k, s, b, h);
      if (block) {
        for (int64_t i = 0; i < S; ++i) {
          const double f =
              std::exp(lse_S[i] - static_cast<double>(lse[(b * Hq + h) * s.lse_ld() + i]));
          for (int64_t j = 0; j < Sk; ++j) P_SS[i * Sk + j] *= f;
        }
      }
      dropout_factors_ref(M_SS, drop, s, b, h);
      // dP = dO V^T
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t j = 0; j < Sk; ++j) {
          double acc = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            acc += static_cast<double>(dout[((i * B + b) * Hq + h) * D + d]) *
                   static_cast<double>(v[((j * B + b) * Hkv + g) * D + d]);
          }
          dP_SS[i * Sk + j] = acc * M_SS[i * Sk + j];  // M o dP
        }
      }
      // dS = P * (M o dP - delta), in place of dP
      for (int64_t i = 0; i < S; ++i) {
        double delta = 0.0;
        if (block) {
          for (int64_t d = 0; d < D; ++d) {
            delta += static_cast<double>(dout[((i * B + b) * Hq + h) * D + d]) *
                     static_cast<double>(out[((i * B + b) * Hq + h) * D + d]);
          }
        } else {
          for (int64_t j = 0; j < Sk; ++j) delta += P_SS[i * Sk + j] * dP_SS[i * Sk + j];
        }
        for (int64_t j = 0; j < Sk; ++j) {
          dP_SS[i * Sk + j] = P_SS[i * Sk + j] * (dP_SS[i * Sk + j] - delta);
        }
      }
      // dQ = scale * dS K;  dK += scale * dS^T Q;  dV += P^T dO
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (int64_t j = 0; j < Sk; ++j) {
            acc += dP_SS[i * Sk + j] * static_cast<double>(k[((j * B + b) * Hkv + g) * D + d]);
          }
          dq[((i * B + b) * Hq + h) * D + d] = static_cast<T>(scale * acc);
        }
      }
      for (int64_t j = 0; j < Sk; ++j) {
        for (int64_t d = 0; d < D; ++d) {
          double acc_k = 0.0, acc_v = 0.0;
          for (int64_t i = 0; i < S; ++i) {
            acc_k += dP_SS[i * Sk + j] * static_cast<double>(q[((i * B + b) * Hq + h) * D + d]);
            acc_v += P_SS[i * Sk + j] * M_SS[i * Sk + j] *
                     static_cast<double>(dout[((i * B + b) * Hq + h) * D + d]);
          }
          dk_acc[((j * B + b) * Hkv + g) * D + d] += scale * acc_k;
          dv_acc[((j * B + b) * Hkv + g) * D + d] += acc_v;
        }
      }
    }
  }
  for (int64_t i = 0; i < Sk * B * Hkv * D; ++i) {
    dk[i] = static_cast<T>(dk_acc[i]);
    dv[i] = static_cast<T>(dv_acc[i]);
  }
}

#define MOECORE_INSTANTIATE_ATTENTION_REF(T)                                                  \
  template void attention_forward_ref<T>(T*, T*, const T*, const T*, const T*,                \
                                         const AttentionShape&, const AttentionDropout*);     \
  template void attention_backward_ref<T>(T*, T*, T*, const T*, const T*, const T*, const T*, \
                                          const T*, const T*, const AttentionShape&,          \
                                          const AttentionDropout*);
MOECORE_INSTANTIATE_ATTENTION_REF(float)
MOECORE_INSTANTIATE_ATTENTION_REF(double)
#undef MOECORE_INSTANTIATE_ATTENTION_REF

}  // namespace moecore::ops
