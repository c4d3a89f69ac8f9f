// Cases: the model's ops around the experts: embedding (repeated ids), the fused head + cross
// entropy (ignored targets, chunks that do not divide the tokens), causal GQA attention (with and
// without dropout; S = 1, S not a multiple of the 64-row block, MQA and GQA groups) and RoPE (D =
// 2, D = 128, both ends of the position table, in place). Every backward takes the reference
// forward's saved values.
#include <omp.h>
#include <algorithm>
#include <array>
#include <limits>
#include <span>

#include <random>

#include "backend_case.h"
#include "core/rng.h"
#include "ops/attention.h"
#include "ops/attention_merge.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/mla_layout.h"
#include "ops/rope.h"
#include "ops/rope_mla.h"
#include "ops/vocab_parallel_ce.h"

namespace moecore::backend_test {
namespace {

std::vector<int32_t> random_ids(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(gen() % static_cast<uint32_t>(V));
  return ids;
}

// Same copies and additions in the same order as the reference: bitwise.
template <typename T>
void embedding_one(const Exec& ex) {
  struct Shape {
    int64_t n_tok, H, V;
  };
  uint32_t seed = 1;
  // V = 1 (every token the same id), V < T (many repeats), a parallel shape.
  for (Shape s :
       {Shape{1, 1, 1}, Shape{1, 7, 5}, Shape{13, 37, 1}, Shape{13, 37, 4}, Shape{300, 130, 50}}) {
    BACKEND_TRACE(dtype_name<T>() << " T=" << s.n_tok << " H=" << s.H << " V=" << s.V);
    const auto ids = random_ids(s.n_tok, s.V, seed++);
    const auto w = random_vec<T>(s.V * s.H, seed++), dy = random_vec<T>(s.n_tok * s.H, seed++);
    const auto dw0 = random_vec<T>(s.V * s.H, seed++);
    std::vector<T> y_ref(s.n_tok * s.H), dw_ref = dw0;
    ops::embedding_forward_ref(y_ref.data(), ids.data(), w.data(), s.n_tok, s.H, s.V);
    ops::embedding_backward_ref(dw_ref.data(), dy.data(), ids.data(), s.n_tok, s.H, s.V);
    Guarded<T> y = nan_out<T>(s.n_tok * s.H), dw = guarded(dw0);
    {
      Staging st(ex);
      ops::embedding_forward<T>(ex, st.out(y), st.in(ids), st.in(w), s.n_tok, s.H, s.V);
      ops::embedding_backward<T>(ex, st.out(dw), st.in(dy), st.in(ids), s.n_tok, s.H, s.V);
      st.back();
    }
    expect_bitwise(y, y_ref.data(), "y");
    expect_bitwise(dw, dw_ref.data(), "dw (accumulated)");
  }
}

// Ids for a slice of the table: every row of the slice (so every row range a kernel splits the
// slice into gets tokens), a few rows again (repeats add in token order), the rows just outside
// the slice and other rows of the vocabulary (zeros, no gradient), shuffled.
std::vector<int32_t> slice_ids(int64_t v0, int64_t rows, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < rows; ++r) ids.push_back(static_cast<int32_t>(v0 + r));
  for (int64_t k = 0; k < 6; ++k) {
    if (rows > 0)
      ids.push_back(
          static_cast<int32_t>(v0 + int64_t(gen() % uint64_t(std::min<int64_t>(rows, 3)))));
    ids.push_back(static_cast<int32_t>(gen() % static_cast<uint32_t>(V)));
  }
  if (v0 > 0 && v0 - 1 < V) ids.push_back(static_cast<int32_t>(v0 - 1));
  if (v0 + rows < V) ids.push_back(static_cast<int32_t>(v0 + rows));
  std::shuffle(ids.begin(), ids.end(), gen);
  return ids;
}

// A TP rank's slice of the table (rows [v0, v0 + rows) of V): ids of other slices give zeros
// and no gradient. Slices at the start, middle and end of the vocabulary, and one of more rows
// than a GPU's backward has row ranges (1100 rows at H = 260: ranges of several rows), and empty
// slices (a TP rank of padding only: zeros, no gradient) at and past the vocabulary's end.
// Bitwise the reference.
template <typename T>
void embedding_shard_one(const Exec& ex) {
  uint32_t seed = 70;
  for (auto [H, v0, rows, V] :
       {std::array<int64_t, 4>{1, 0, 1, 1}, std::array<int64_t, 4>{37, 4, 4, 12},
        std::array<int64_t, 4>{5, 0, 25, 50}, std::array<int64_t, 4>{130, 25, 25, 50},
        std::array<int64_t, 4>{260, 300, 1100, 1500}, std::array<int64_t, 4>{37, 12, 0, 12},
        std::array<int64_t, 4>{5, 60, 0, 50}}) {
    const auto ids = slice_ids(v0, rows, V, seed++);
    const int64_t n_tok = static_cast<int64_t>(ids.size());
    BACKEND_TRACE(dtype_name<T>() << " T=" << n_tok << " H=" << H << " rows [" << v0 << ", "
                                  << v0 + rows << ") of " << V);
    const auto w = random_vec<T>(rows * H, seed++), dy = random_vec<T>(n_tok * H, seed++);
    const auto dw0 = random_vec<T>(rows * H, seed++);
    std::vector<T> y_ref(n_tok * H), dw_ref = dw0;
    ops::embedding_forward_shard_ref(y_ref.data(), ids.data(), w.data(), n_tok, H, v0, rows, V);
    ops::embedding_backward_shard_ref(dw_ref.data(), dy.data(), ids.data(), n_tok, H, v0, rows, V);
    Guarded<T> y = nan_out<T>(n_tok * H), dw = guarded(dw0);
    {
      Staging st(ex);
      ops::embedding_forward_shard<T>(ex, st.out(y), st.in(ids), st.in(w), n_tok, H, v0, rows, V);
      ops::embedding_backward_shard<T>(ex, st.out(dw), st.in(dy), st.in(ids), n_tok, H, v0, rows,
                                       V);
      st.back();
    }
    expect_bitwise(y, y_ref.data(), "y");
    expect_bitwise(dw, dw_ref.data(), "dw (accumulated)");
  }
}

// The vocab-parallel cross entropy rows of one slice: the maxima and the finish bitwise (exact
// and the same formula), the exp sums and gradient rows within the dtype's tolerance. Empty
// slices (a TP rank of padding only) give -inf maxima and zero sums.
template <typename T>
void vocab_ce_one(const Exec& ex) {
  uint32_t seed = 90;
  for (auto [m, v0, Vl, V] :
       {std::array<int64_t, 4>{1, 0, 1, 1}, std::array<int64_t, 4>{7, 37, 37, 111},
        std::array<int64_t, 4>{5, 0, 300, 600}, std::array<int64_t, 4>{5, 600, 0, 600},
        std::array<int64_t, 4>{4, 700, 0, 600}}) {
    BACKEND_TRACE(dtype_name<T>() << " m=" << m << " columns [" << v0 << ", " << v0 + Vl << ") of "
                                  << V);
    const ops::VocabSlice vs{v0, Vl, V};
    auto z = random_vec<T>(m * Vl, seed++);
    for (auto& x : z) x *= T(3);
    auto tg = random_ids(m, V, seed++);
    if (m > 2) tg[1] = -1;
    if (m > 3 && Vl > 0) tg[2] = int32_t(v0);  // on this slice
    std::vector<T> mx_ref(m), loss_ref(m), lse_ref(m), g_ref = z;
    std::vector<double> sums_ref(2 * m);
    double sum_ref = 0.25;
    ops::vocab_ce_row_max_ref(mx_ref.data(), z.data(), m, vs);
    ops::vocab_ce_row_sums_ref(sums_ref.data(), z.data(), mx_ref.data(), tg.data(), m, vs);
    ops::vocab_ce_finish_ref(&sum_ref, loss_ref.data(), lse_ref.data(), mx_ref.data(),
                             sums_ref.data(), tg.data(), m);
    const T dloss = T(0.5);
    ops::vocab_ce_grad_ref(g_ref.data(), tg.data(), lse_ref.data(), dloss, m, vs);
    Guarded<T> mx = nan_out<T>(m), loss = nan_out<T>(m), lse = nan_out<T>(m), g = guarded(z);
    Guarded<double> sums = nan_out<double>(2 * m), sum = guarded(std::vector<double>{0.25});
    {
      Staging st(ex);
      ops::vocab_ce_row_max<T>(ex, st.out(mx), st.in(z), m, vs);
      ops::vocab_ce_row_sums<T>(ex, st.out(sums), st.in(z), st.in(mx_ref), st.in(tg), m, vs);
      ops::vocab_ce_finish<T>(ex, st.out(sum), st.out(loss), st.out(lse), st.in(mx_ref),
                              st.in(sums_ref), st.in(tg), m);
      ops::vocab_ce_grad<T>(ex, st.out(g), st.in(tg), st.in(lse_ref), st.in(&dloss, 1), m, vs);
      st.back();
    }
    expect_bitwise(mx, mx_ref.data(), "max");
    expect_close(sums, sums_ref.data(), "sums", Tol<T>::rtol, Tol<T>::atol);
    expect_bitwise(loss, loss_ref.data(), "loss");
    expect_bitwise(lse, lse_ref.data(), "lse");
    expect_bitwise(sum, &sum_ref, "sum (accumulated)");
    expect_close(g, g_ref.data(), "dlogits", Tol<T>::rtol, Tol<T>::atol);
  }
}

// --bf16's lookup from the table's bf16 values: exact, bitwise the reference.
void embedding_bf16_case(const Exec& ex) {
  uint32_t seed = 40;
  for (auto [n_tok, H, V] : {std::array<int64_t, 3>{1, 1, 1}, std::array<int64_t, 3>{13, 37, 4},
                             std::array<int64_t, 3>{300, 130, 50}}) {
    BACKEND_TRACE("T=" << n_tok << " H=" << H << " V=" << V);
    const auto ids = random_ids(n_tok, V, seed++);
    const auto w32 = random_vec<float>(V * H, seed++);
    std::vector<bf16> w(static_cast<size_t>(V * H));
    for (int64_t i = 0; i < V * H; ++i) w[i] = float_to_bf16(w32[i]);
    std::vector<float> y_ref(n_tok * H);
    ops::embedding_forward_bf16_ref(y_ref.data(), ids.data(), w.data(), n_tok, H, V);
    Guarded<float> y = nan_out<float>(n_tok * H);
    {
      Staging st(ex);
      ops::embedding_forward_bf16(ex, st.out(y), st.in(ids), st.in(w), n_tok, H, V);
      st.back();
    }
    expect_bitwise(y, y_ref.data(), "y");
  }
}

// Targets in [0, V), every `ignore_every`-th one -1 (ignored); all of them for kAllIgnored.
constexpr int kAllIgnored = -1;
std::vector<int32_t> targets(int64_t T, int64_t V, int ignore_every, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> tg(T);
  for (int64_t t = 0; t < T; ++t) {
    const bool ignored = ignore_every == kAllIgnored || (ignore_every > 0 && t % ignore_every == 1);
    tg[t] = ignored ? -1 : static_cast<int32_t>(gen() % uint32_t(V));
  }
  return tg;
}

// T = 1, V = 1, odd T and H, chunk 1 / not dividing T / larger than T, every target ignored,
// and a shape with a parallel branch. The total loss compares as tests/ops/test_cross_entropy.cpp
// does: the per-token tolerance summed over the tokens.
template <typename T>
void head_loss_case(const Exec& ex) {
  struct Shape {
    ops::HeadLossShape s;
    int ignore_every;
  };
  uint32_t seed = 10;
  for (Shape c : {Shape{{1, 1, 1, 1}, 4}, Shape{{1, 5, 7, 256}, 4}, Shape{{13, 7, 11, 3}, 4},
                  Shape{{13, 37, 50, 256}, 4}, Shape{{64, 24, 300, 16}, 4}, Shape{{5, 3, 1, 2}, 4},
                  Shape{{11, 5, 13, 4}, kAllIgnored}, Shape{{29, 9, 17, 8}, 3}}) {
    const ops::HeadLossShape& s = c.s;
    BACKEND_TRACE("T=" << s.n_tok << " H=" << s.H << " V=" << s.V << " chunk=" << s.chunk
                       << " ignore_every=" << c.ignore_every);
    const auto h = random_vec<T>(s.n_tok * s.H, seed++), w = random_vec<T>(s.V * s.H, seed++);
    const auto dw0 = random_vec<T>(s.V * s.H, seed++);
    const auto tg = targets(s.n_tok, s.V, c.ignore_every, seed++);
    const T dloss = T(0.25);
    std::vector<T> loss_ref(s.n_tok), lse_ref(s.n_tok), dh_ref(s.n_tok * s.H), dw_ref = dw0;
    const double total_ref = ops::head_loss_forward_ref(loss_ref.data(), lse_ref.data(), h.data(),
                                                        w.data(), tg.data(), s);
    ops::head_loss_backward_ref(dh_ref.data(), dw_ref.data(), h.data(), w.data(), tg.data(),
                                lse_ref.data(), dloss, s);
    Guarded<T> loss = nan_out<T>(s.n_tok), lse = nan_out<T>(s.n_tok),
               dh = nan_out<T>(s.n_tok * s.H), dw = guarded(dw0),
               ws = nan_out<T>(ops::head_loss_workspace_elems(s));
    Guarded<double> total(1, std::nan(""));
    {
      Staging st(ex);
      ops::head_loss_forward<T>(ex, st.out(total), st.out(loss), st.out(lse), st.in(h), st.in(w),
                                st.in(tg), s, st.out(ws));
      ops::head_loss_backward<T>(ex, st.out(dh), st.out(dw), st.in(h), st.in(w), st.in(tg),
                                 st.in(lse_ref), st.in(&dloss, 1), s, st.out(ws));
      st.back();
    }
    expect_intact(total, "total");
    EXPECT_NEAR(total[0], total_ref, Tol<T>::atol * s.n_tok + Tol<T>::rtol * std::abs(total_ref))
        << "total loss";
    for (int64_t t = 0; t < s.n_tok; ++t) {
      if (tg[t] < 0) {
        EXPECT_EQ(loss[t], T(0)) << "ignored target " << t;
      }
    }
    expect_close(loss, loss_ref.data(), "loss_T");
    // lse is the log-sum-exp of every token, ignored or not.
    expect_close(lse, lse_ref.data(), "lse_T");
    expect_close(dh, dh_ref.data(), "dh");
    expect_close(dw, dw_ref.data(), "dw (accumulated)");
    expect_intact(ws, "workspace");
  }
}

// S = 1 (one key), odd S, S crossing the 64-row block (70, 129), MHA, MQA (Hkv = 1), GQA groups
// of 3 and of 4, D of each register-tile width of the f32 kernels (8, 16, 32, 40, 64, 128).
const ops::AttentionShape kAttentionShapes[] = {
    {1, 1, 1, 1, 8},    {1, 3, 4, 1, 16},  {7, 2, 2, 2, 8},    {33, 2, 6, 2, 8},
    {33, 1, 3, 3, 16},  {70, 2, 6, 2, 8},  {129, 1, 4, 1, 8},  {65, 2, 2, 2, 32},
    {100, 1, 4, 2, 40}, {70, 1, 8, 2, 64}, {50, 1, 2, 1, 128},
};

// drop: the attention dropout of the whole table (nullptr: none). The backward takes the
// reference forward's out and lse (lse is that of the undropped scores either way).
// The block form (ops/attention.h, context parallelism's chunk pairs): a full block (keys 5..9
// before queries 10..14), a diagonal at an offset with lse rows of 2 S, a prefix of 3 chunks, a
// key range shorter than the rows see, one crossing the 64-row blocks; lse a strided part.
ops::AttentionShape attention_block(ops::AttentionShape s, int64_t Sk, int64_t q_offset,
                                    int64_t k_offset, int64_t lse_stride) {
  s.Sk = Sk, s.q_offset = q_offset, s.k_offset = k_offset, s.lse_stride = lse_stride;
  return s;
}
const ops::AttentionShape kAttentionBlocks[] = {
    attention_block({5, 2, 4, 2, 8}, 5, 10, 5, 10),
    attention_block({17, 1, 2, 1, 16}, 17, 17, 17, 34),
    attention_block({9, 1, 6, 2, 8}, 27, 18, 0, 18),
    attention_block({20, 2, 3, 1, 40}, 7, 3, 0, 0),
    attention_block({70, 1, 4, 1, 32}, 70, 140, 70, 140),
};

template <typename T>
void attention_one(const Exec& ex, const ops::AttentionDropout* drop,
                   std::span<const ops::AttentionShape> shapes = kAttentionShapes) {
  uint32_t seed = 100;
  for (const ops::AttentionShape& s : shapes) {
    BACKEND_TRACE("S=" << s.S << " B=" << s.B << " Hq=" << s.Hq << " Hkv=" << s.Hkv << " D=" << s.D
                       << " Sk=" << s.keys() << " q_offset=" << s.q_offset
                       << " k_offset=" << s.k_offset << " dropout p=" << (drop ? drop->p : 0.0));
    const int64_t n_q = s.S * s.B * s.Hq * s.D, n_kv = s.keys() * s.B * s.Hkv * s.D,
                  n_lse = s.B * s.Hq * s.lse_ld();
    // q, k in [-2, 2]: scores of O(1), the softmax neither flat nor one-hot.
    const auto q = random_vec<T>(n_q, seed++, -2.0, 2.0),
               k = random_vec<T>(n_kv, seed++, -2.0, 2.0);
    const auto v = random_vec<T>(n_kv, seed++), dout = random_vec<T>(n_q, seed++);
    std::vector<T> out_ref(n_q), lse_ref(n_lse), dq_ref(n_q), dk_ref(n_kv), dv_ref(n_kv);
    ops::attention_forward_ref<T>(out_ref.data(), lse_ref.data(), q.data(), k.data(), v.data(), s,
                                  drop);
    ops::attention_backward_ref<T>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(),
                                   q.data(), k.data(), v.data(), out_ref.data(), lse_ref.data(), s,
                                   drop);
    Guarded<T> ws = nan_out<T>(ops::attention_workspace_elems(s, omp_get_max_threads()));
    Guarded<T> out = nan_out<T>(n_q), lse = nan_out<T>(n_lse), dq = nan_out<T>(n_q),
               dk = nan_out<T>(n_kv), dv = nan_out<T>(n_kv);
    {
      Staging st(ex);
      ops::AttentionDropout drop_dev;  // the same dropout, its counters staged
      if (drop != nullptr) {
        drop_dev = *drop;
        drop_dev.counters = st.in(raw_ptr(drop->counters), 1);
      }
      const ops::AttentionDropout* d = drop != nullptr ? &drop_dev : nullptr;
      ops::attention_forward<T>(ex, st.out(out), st.out(lse), st.in(q), st.in(k), st.in(v), s,
                                st.out(ws), d);
      ops::attention_backward<T>(ex, st.out(dq), st.out(dk), st.out(dv), st.in(dout), st.in(q),
                                 st.in(k), st.in(v), st.in(out_ref), st.in(lse_ref), s, st.out(ws),
                                 d);
      st.back();
    }
    expect_close(out, out_ref.data(), "out");
    if (s.lse_ld() == s.S) {
      expect_close(lse, lse_ref.data(), "lse");
    } else {  // the rows' first S; the rest never written (NaN as poisoned)
      for (int64_t row = 0; row < s.B * s.Hq; ++row) {
        const int64_t at = row * s.lse_ld();
        EXPECT_TRUE(testing::all_close(lse.data() + at, lse_ref.data() + at, s.S, Tol<T>::rtol,
                                       Tol<T>::atol))
            << "lse row " << row;
        for (int64_t i = s.S; i < s.lse_ld(); ++i) EXPECT_TRUE(std::isnan(lse[at + i])) << i;
      }
      expect_intact(lse, "lse");
    }
    expect_close(dq, dq_ref.data(), "dq");
    expect_close(dk, dk_ref.data(), "dk");
    expect_close(dv, dv_ref.data(), "dv");
    expect_intact(ws, "workspace");
  }
}

template <typename T>
void attention_case(const Exec& ex) {
  attention_one<T>(ex, nullptr);
}

// A --bf16 run's attention (AttentionShape::bf16), its graphs prepared first as the layers do:
// the whole sequence and the blocks. The CPU, the emulated build and a device without cuDNN run
// the own kernel (the f32 row); where the start-up line says cuDNN fused, the calls cuDNN takes
// round q, k, v, out, dout and the results to bf16 (2^-9 relative each) with f32 softmax and
// sums inside, so they are held to kBf16AttentionTol (outputs of O(1), sums over at most 140
// keys of bf16-rounded terms).
constexpr double kBf16AttentionTol = 3e-2;

void attention_bf16_case(const Exec& ex) {
  const std::string line = ops::attention_path_line(ex, true, 0.0);
  BACKEND_TRACE(line);
  if (ex.on_cpu()) {
    EXPECT_EQ(line, "[attention] own kernel (CPU)");
  }
  const bool fused = line.find("cuDNN fused") != std::string::npos;
  const double rtol = fused ? kBf16AttentionTol : Tol<float>::rtol;
  const double atol = fused ? kBf16AttentionTol : Tol<float>::atol;
  std::vector<ops::AttentionShape> shapes(std::begin(kAttentionShapes), std::end(kAttentionShapes));
  shapes.insert(shapes.end(), std::begin(kAttentionBlocks), std::end(kAttentionBlocks));
  uint32_t seed = 300;
  for (ops::AttentionShape s : shapes) {
    s.bf16 = true;
    BACKEND_TRACE("S=" << s.S << " B=" << s.B << " Hq=" << s.Hq << " Hkv=" << s.Hkv << " D=" << s.D
                       << " Sk=" << s.keys() << " q_offset=" << s.q_offset
                       << " k_offset=" << s.k_offset);
    const int64_t n_q = s.S * s.B * s.Hq * s.D, n_kv = s.keys() * s.B * s.Hkv * s.D,
                  n_lse = s.B * s.Hq * s.lse_ld();
    const auto q = random_vec<float>(n_q, seed++, -2.0, 2.0),
               k = random_vec<float>(n_kv, seed++, -2.0, 2.0);
    const auto v = random_vec<float>(n_kv, seed++), dout = random_vec<float>(n_q, seed++);
    std::vector<float> out_ref(n_q), lse_ref(n_lse), dq_ref(n_q), dk_ref(n_kv), dv_ref(n_kv);
    ops::attention_forward_ref<float>(out_ref.data(), lse_ref.data(), q.data(), k.data(), v.data(),
                                      s, nullptr);
    ops::attention_backward_ref<float>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(),
                                       q.data(), k.data(), v.data(), out_ref.data(), lse_ref.data(),
                                       s, nullptr);
    Guarded<float> ws = nan_out<float>(ops::attention_workspace_elems(s, omp_get_max_threads()));
    Guarded<float> out = nan_out<float>(n_q), lse = nan_out<float>(n_lse), dq = nan_out<float>(n_q),
                   dk = nan_out<float>(n_kv), dv = nan_out<float>(n_kv);
    {
      Staging st(ex);
      ops::attention_prepare(ex, s, nullptr);
      ops::attention_forward<float>(ex, st.out(out), st.out(lse), st.in(q), st.in(k), st.in(v), s,
                                    st.out(ws), nullptr);
      ops::attention_backward<float>(ex, st.out(dq), st.out(dk), st.out(dv), st.in(dout), st.in(q),
                                     st.in(k), st.in(v), st.in(out_ref), st.in(lse_ref), s,
                                     st.out(ws), nullptr);
      st.back();
    }
    EXPECT_TRUE(testing::all_close(out.data(), out_ref.data(), n_q, rtol, atol)) << "out";
    for (int64_t row = 0; row < s.B * s.Hq; ++row) {
      const int64_t at = row * s.lse_ld();
      EXPECT_TRUE(testing::all_close(lse.data() + at, lse_ref.data() + at, s.S, rtol, atol))
          << "lse row " << row;
      for (int64_t i = s.S; i < s.lse_ld(); ++i) EXPECT_TRUE(std::isnan(lse[at + i])) << i;
    }
    EXPECT_TRUE(testing::all_close(dq.data(), dq_ref.data(), n_q, rtol, atol)) << "dq";
    EXPECT_TRUE(testing::all_close(dk.data(), dk_ref.data(), n_kv, rtol, atol)) << "dk";
    EXPECT_TRUE(testing::all_close(dv.data(), dv_ref.data(), n_kv, rtol, atol)) << "dv";
  }
}

// Dropout p = 0.1 and 0.3 of the probabilities, heads offset as on a tensor-parallel rank. The
// counters are the host's here (the reference reads them); attention_one stages them for the op.
template <typename T>
void attention_dropout_case(const Exec& ex) {
  const ops::DropoutCounters counters{41, 12};
  for (double p : {0.1, 0.3}) {
    const ops::AttentionDropout drop{p, rng_key(7, "attention_dropout"), &counters, 2};
    attention_one<T>(ex, &drop);
  }
}

// The block form, with and without dropout (the bits at the global (query, key)). The
// reference's backward of a block given the block's own out and lse is that block's gradient.
template <typename T>
void attention_block_case(const Exec& ex) {
  attention_one<T>(ex, nullptr, kAttentionBlocks);
  const ops::DropoutCounters counters{41, 12};
  const ops::AttentionDropout drop{0.3, rng_key(7, "attention_dropout"), &counters, 2};
  attention_one<T>(ex, &drop, kAttentionBlocks);
}

// The log-sum-exp merge of two partials: lse far apart, a side at -inf (weight 0), lse a strided
// part of a longer row (the rest untouched).
template <typename T>
void attention_merge_one(const Exec& ex) {
  ops::AttentionShape strided{33, 2, 3, 1, 13};
  strided.lse_stride = 40;
  uint32_t seed = 900;
  for (const ops::AttentionShape& s :
       {ops::AttentionShape{1, 1, 1, 1, 4}, ops::AttentionShape{70, 1, 4, 1, 32}, strided}) {
    BACKEND_TRACE("S=" << s.S << " B=" << s.B << " H=" << s.Hq << " D=" << s.D
                       << " lse_stride=" << s.lse_ld());
    const int64_t n_o = s.S * s.B * s.Hq * s.D, n_l = s.B * s.Hq * s.lse_ld();
    const auto o1 = random_vec<T>(n_o, seed++), o2 = random_vec<T>(n_o, seed++);
    auto l1 = random_vec<T>(n_l, seed++, -20.0, 20.0), l2 = random_vec<T>(n_l, seed++, -3.0, 3.0);
    l1[0] = -std::numeric_limits<T>::infinity();
    std::vector<T> o_ref = o1, l_ref = l1;
    ops::attention_merge_ref<T>(o_ref.data(), l_ref.data(), o2.data(), l2.data(), s);
    Guarded<T> o(n_o), l(n_l);
    std::copy(o1.begin(), o1.end(), o.data());
    std::copy(l1.begin(), l1.end(), l.data());
    {
      Staging st(ex);
      ops::attention_merge<T>(ex, st.out(o), st.out(l), st.in(o2), st.in(l2), s);
      st.back();
    }
    expect_close(o, o_ref.data(), "out");
    expect_close(l, l_ref.data(), "lse");
  }
}

// The fast path reads the f64 cos / sin cache, the reference computes the angles from base.
template <typename T>
void rope_one(const Exec& ex) {
  struct Shape {
    int64_t n_tok, n_heads, D;
    double base;
  };
  constexpr int64_t kMaxPos = 4096;
  uint32_t seed = 200;
  for (Shape s : {Shape{1, 1, 2, 10000.0}, Shape{7, 3, 8, 10000.0}, Shape{33, 2, 16, 10000.0},
                  Shape{5, 4, 128, 500000.0}, Shape{300, 4, 32, 10000.0}}) {
    BACKEND_TRACE(dtype_name<T>() << " n_tok=" << s.n_tok << " n_heads=" << s.n_heads
                                  << " D=" << s.D << " base=" << s.base);
    const ops::RopeTables cache(kMaxPos, s.D, s.base, ex);
    const int64_t n = s.n_tok * s.n_heads * s.D;
    const auto x = random_vec<T>(n, seed++), dy = random_vec<T>(n, seed++);
    auto pos = random_ids(s.n_tok, kMaxPos, seed++);
    if (s.n_tok > 1) pos[0] = 0, pos[s.n_tok - 1] = kMaxPos - 1;  // both ends of the table
    std::vector<T> y_ref(n), dx_ref(n);
    ops::rope_forward_ref<T>(y_ref.data(), x.data(), pos.data(), s.n_tok, s.n_heads, s.D, s.base);
    ops::rope_backward_ref<T>(dx_ref.data(), dy.data(), pos.data(), s.n_tok, s.n_heads, s.D,
                              s.base);
    Guarded<T> y = nan_out<T>(n), dx = nan_out<T>(n), y_in_place = guarded(x),
               dx_in_place = guarded(dy);
    {
      Staging st(ex);
      ops::rope_forward<T>(ex, st.out(y), st.in(x), st.in(pos), s.n_tok, s.n_heads, cache);
      ops::rope_backward<T>(ex, st.out(dx), st.in(dy), st.in(pos), s.n_tok, s.n_heads, cache);
      T* const yi = st.out(y_in_place);  // staged once: y and x the same backend buffer
      ops::rope_forward<T>(ex, yi, yi, st.in(pos), s.n_tok, s.n_heads, cache);
      T* const dxi = st.out(dx_in_place);
      ops::rope_backward<T>(ex, dxi, dxi, st.in(pos), s.n_tok, s.n_heads, cache);
      st.back();
    }
    expect_close(y, y_ref.data(), "y");
    expect_close(dx, dx_ref.data(), "dx");
    expect_bitwise(y_in_place, y, "y in place");
    expect_bitwise(dx_in_place, dx, "dx in place");
  }
}

// MLA's RoPE: interleaved and half-split pairs, plain and YaRN (the factor on cos / sin), rows
// wider than the rotary dim on both sides; the output's other elements keep their values.
template <typename T>
void rope_mla_one(const Exec& ex) {
  struct Shape {
    int64_t n_tok, n_heads, D, ldx, ldy;
    ops::RopePairing pairing;
    ops::RopeType type;
  };
  constexpr int64_t kMaxPos = 512;
  using ops::RopePairing;
  using ops::RopeType;
  uint32_t seed = 300;
  for (Shape s : {Shape{1, 1, 2, 2, 2, RopePairing::Interleaved, RopeType::Rope},
                  Shape{7, 3, 8, 8, 11, RopePairing::Interleaved, RopeType::Yarn},
                  Shape{33, 1, 16, 24, 16, RopePairing::HalfSplit, RopeType::Yarn},
                  Shape{300, 4, 64, 96, 70, RopePairing::Interleaved, RopeType::Yarn}}) {
    BACKEND_TRACE(dtype_name<T>() << " n_tok=" << s.n_tok << " n_heads=" << s.n_heads
                                  << " D=" << s.D << " ldx=" << s.ldx << " ldy=" << s.ldy);
    ops::RopeMlaSpec spec{s.D, 10000.0, s.pairing, {s.type, {40.0, 64, 32.0, 1.0, 1.0, 0.5}}};
    const ops::RopeMlaTables cache(kMaxPos, spec, ex);
    const int64_t rows = s.n_tok * s.n_heads, nx = rows * s.ldx, ny = rows * s.ldy;
    const auto x = random_vec<T>(nx, seed++), dy = random_vec<T>(ny, seed++);
    const auto y0 = random_vec<T>(ny, seed++), dx0 = random_vec<T>(nx, seed++);
    auto pos = random_ids(s.n_tok, kMaxPos, seed++);
    if (s.n_tok > 1) pos[0] = 0, pos[s.n_tok - 1] = kMaxPos - 1;
    std::vector<T> y_ref = y0, dx_ref = dx0;
    ops::rope_mla_forward_ref<T>(y_ref.data(), x.data(), pos.data(), s.n_tok, s.n_heads, s.ldy,
                                 s.ldx, spec);
    ops::rope_mla_backward_ref<T>(dx_ref.data(), dy.data(), pos.data(), s.n_tok, s.n_heads, s.ldx,
                                  s.ldy, spec);
    Guarded<T> y = guarded(y0), dx = guarded(dx0);
    {
      Staging st(ex);
      ops::rope_mla_forward<T>(ex, st.out(y), st.in(x), st.in(pos), s.n_tok, s.n_heads, s.ldy,
                               s.ldx, cache);
      ops::rope_mla_backward<T>(ex, st.out(dx), st.in(dy), st.in(pos), s.n_tok, s.n_heads, s.ldx,
                                s.ldy, cache);
      st.back();
    }
    expect_close(y, y_ref.data(), "y");
    expect_close(dx, dx_ref.data(), "dx");
  }
}

// MLA's q / k / v layout: copies, the q scale and dk_pe's sum over the heads, bitwise the
// reference on every backend; dv below and above qk + pe.
template <typename T>
void mla_layout_one(const Exec& ex) {
  uint32_t seed = 400;
  for (ops::MlaLayoutShape s :
       {ops::MlaLayoutShape{1, 1, 3, 2, 4}, ops::MlaLayoutShape{7, 3, 4, 2, 9},
        ops::MlaLayoutShape{65, 4, 16, 8, 16}}) {
    BACKEND_TRACE(dtype_name<T>() << " n=" << s.n_tok << " heads=" << s.heads << " qk=" << s.qk
                                  << " pe=" << s.pe << " dv=" << s.dv);
    const int64_t r = s.n_tok * s.heads, nD = r * s.Dp();
    const auto q_up = random_vec<T>(r * s.dq(), seed++), q_pe = random_vec<T>(r * s.pe, seed++),
               kv_up = random_vec<T>(r * s.dkv(), seed++),
               k_pe = random_vec<T>(s.n_tok * s.pe, seed++), dq = random_vec<T>(nD, seed++),
               dk = random_vec<T>(nD, seed++), dv = random_vec<T>(nD, seed++);
    const double c = 0.8;
    std::vector<T> q_r(nD), k_r(nD), v_r(nD), dq_up_r(r * s.dq(), T(2)), dq_pe_r(r * s.pe),
        dkv_up_r(r * s.dkv()), dk_pe_r(s.n_tok * s.pe);
    ops::mla_split_ref<T>(q_r.data(), k_r.data(), v_r.data(), q_up.data(), q_pe.data(),
                          kv_up.data(), k_pe.data(), s, c);
    ops::mla_merge_ref<T>(dq_up_r.data(), dq_pe_r.data(), dkv_up_r.data(), dk_pe_r.data(),
                          dq.data(), dk.data(), dv.data(), s, c);
    Guarded<T> q = nan_out<T>(nD), k = nan_out<T>(nD), v = nan_out<T>(nD),
               dq_up = guarded(std::vector<T>(r * s.dq(), T(2))), dq_pe = nan_out<T>(r * s.pe),
               dkv_up = nan_out<T>(r * s.dkv()), dk_pe = nan_out<T>(s.n_tok * s.pe);
    {
      Staging st(ex);
      ops::mla_split<T>(ex, st.out(q), st.out(k), st.out(v), st.in(q_up), st.in(q_pe), st.in(kv_up),
                        st.in(k_pe), s, c);
      ops::mla_merge<T>(ex, st.out(dq_up), st.out(dq_pe), st.out(dkv_up), st.out(dk_pe), st.in(dq),
                        st.in(dk), st.in(dv), s, c);
      st.back();
    }
    expect_bitwise(q, q_r.data(), "q");
    expect_bitwise(k, k_r.data(), "k");
    expect_bitwise(v, v_r.data(), "v");
    expect_bitwise(dq_up, dq_up_r.data(), "dq_up");
    expect_bitwise(dq_pe, dq_pe_r.data(), "dq_pe");
    expect_bitwise(dkv_up, dkv_up_r.data(), "dkv_up");
    expect_bitwise(dk_pe, dk_pe_r.data(), "dk_pe");
  }
}

}  // namespace

void add_model_cases(std::vector<OpCase>& out) {
  out.push_back(
      {"embedding_repeated_ids", {"embedding_forward", "embedding_backward"}, [](const Exec& ex) {
         embedding_one<float>(ex);
         embedding_one<double>(ex);
       }});
  out.push_back({"embedding_bf16", {"embedding_forward_bf16"}, embedding_bf16_case});
  out.push_back({"embedding_shard",
                 {"embedding_forward_shard", "embedding_backward_shard"},
                 [](const Exec& ex) {
                   embedding_shard_one<float>(ex);
                   embedding_shard_one<double>(ex);
                 }});
  out.push_back({"vocab_parallel_ce",
                 {"vocab_ce_row_max", "vocab_ce_row_sums", "vocab_ce_finish", "vocab_ce_grad"},
                 [](const Exec& ex) {
                   vocab_ce_one<float>(ex);
                   vocab_ce_one<double>(ex);
                 }});
  out.push_back(
      {"head_loss_f32", {"head_loss_forward", "head_loss_backward"}, head_loss_case<float>});
  out.push_back(
      {"head_loss_f64", {"head_loss_forward", "head_loss_backward"}, head_loss_case<double>});
  out.push_back(
      {"attention_f32", {"attention_forward", "attention_backward"}, attention_case<float>});
  out.push_back(
      {"attention_f64", {"attention_forward", "attention_backward"}, attention_case<double>});
  out.push_back(
      {"attention_bf16",
       {"attention_forward", "attention_backward", "attention_prepare", "attention_path_line"},
       attention_bf16_case});
  out.push_back({"attention_dropout_f32",
                 {"attention_forward", "attention_backward"},
                 attention_dropout_case<float>});
  out.push_back({"attention_dropout_f64",
                 {"attention_forward", "attention_backward"},
                 attention_dropout_case<double>});
  out.push_back({"attention_block_f32",
                 {"attention_forward", "attention_backward"},
                 attention_block_case<float>});
  out.push_back({"attention_block_f64",
                 {"attention_forward", "attention_backward"},
                 attention_block_case<double>});
  out.push_back({"attention_merge", {"attention_merge"}, [](const Exec& ex) {
                   attention_merge_one<float>(ex);
                   attention_merge_one<double>(ex);
                 }});
  out.push_back({"rope", {"make_rope_cache", "rope_forward", "rope_backward"}, [](const Exec& ex) {
                   rope_one<float>(ex);
                   rope_one<double>(ex);
                 }});
  out.push_back({"rope_mla",
                 {"make_rope_mla_cache", "rope_mla_forward", "rope_mla_backward"},
                 [](const Exec& ex) {
                   rope_mla_one<float>(ex);
                   rope_mla_one<double>(ex);
                 }});
  out.push_back({"mla_layout", {"mla_split", "mla_merge"}, [](const Exec& ex) {
                   mla_layout_one<float>(ex);
                   mla_layout_one<double>(ex);
                 }});
}

}  // namespace moecore::backend_test
