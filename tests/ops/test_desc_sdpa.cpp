// The cuDNN SDPA descriptor of the attention op (ops/desc/sdpa_desc.h) through a plain-loop
// interpreter of cuDNN's documented SDPA semantics (common/sdpa_interpreter.h) over the raw
// [S, B, H, D] buffers, against ops::attention_forward_ref / attention_backward_ref: out and lse
// forward, dq / dk / dv backward, for causal MHA, GQA and MQA with B > 1, multi-latent
// attention's unequal q/k and v head widths (the reference given v zero-padded to the q/k width,
// as ops/mla_layout.h does), context parallelism's blocks (diagonal, all keys visible,
// bottom-right, a band) with a padded lse row stride; and the calls cuDNN cannot take.
//
// The index tests run the interpreter on f32 buffers (the descriptor's storage type replaced by
// f32 in the test, every dim, stride, scale, mask and Stats field as the descriptor gives them),
// so they compare within f32 rounding; one test runs the descriptor as it is, on bf16 buffers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/sdpa_interpreter.h"
#include "common/testing.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/exec.h"
#include "ops/attention.h"
#include "ops/desc/sdpa_desc.h"

namespace moecore::ops::desc {
namespace {

using moecore::testing::random_vec;
using moecore::testing::sdpa_backward;
using moecore::testing::sdpa_forward;

constexpr float kLsePad = 12345.0f;  // the lse rows' padding: must stay as it was

// Every element within tol * max(1, |want|).
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = want[i], g = got[i];
    ASSERT_LE(std::abs(g - w), tol * std::max(1.0, std::abs(w)))
        << what << " element " << i << ": got " << g << " want " << w;
  }
}

// [n, Dv] rows of a [n, D] buffer (the first Dv of each row).
std::vector<float> narrow(const std::vector<float>& x, int64_t D, int64_t Dv) {
  const int64_t n = static_cast<int64_t>(x.size()) / D;
  std::vector<float> y(static_cast<size_t>(n * Dv));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < Dv; ++c) y[r * Dv + c] = x[r * D + c];
  return y;
}

// [n, D] rows from [n, Dv] rows, zero-padded.
std::vector<float> widen(const std::vector<float>& x, int64_t Dv, int64_t D) {
  const int64_t n = static_cast<int64_t>(x.size()) / Dv;
  std::vector<float> y(static_cast<size_t>(n * D), 0.0f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < Dv; ++c) y[r * D + c] = x[r * Dv + c];
  return y;
}

void set_io_type(SdpaDesc& d, SdpaDataType t) {
  d.q.type = d.k.type = d.v.type = d.o.type = t;
}

// Forward and backward of one call through the descriptor (on f32 buffers) vs the reference.
void check_call(const AttentionShape& s, int64_t dv_width, uint32_t seed) {
  SCOPED_TRACE("S=" + std::to_string(s.S) + " Sk=" + std::to_string(s.keys()) +
               " B=" + std::to_string(s.B) + " Hq=" + std::to_string(s.Hq) +
               " Hkv=" + std::to_string(s.Hkv) + " D=" + std::to_string(s.D) +
               " Dv=" + std::to_string(dv_width) + " q_offset=" + std::to_string(s.q_offset) +
               " k_offset=" + std::to_string(s.k_offset) + " lse_ld=" + std::to_string(s.lse_ld()));
  const int64_t D = s.D, Dv = dv_width == 0 ? D : dv_width, Sk = s.keys();
  SdpaCall call;
  call.shape = s;
  call.d_v = dv_width;
  SdpaDesc d = sdpa_desc(call);
  ASSERT_EQ(d.refusal, "");
  // The buffers below are sized by the call: a descriptor naming other head widths would make
  // the interpreter read and write outside them.
  ASSERT_EQ(d.q.dim[3], D);
  ASSERT_EQ(d.k.dim[3], D);
  ASSERT_EQ(d.v.dim[3], Dv);
  ASSERT_EQ(d.o.dim[3], Dv);
  set_io_type(d, SdpaDataType::F32);

  const int64_t n_q = s.S * s.B * s.Hq, n_kv = Sk * s.B * s.Hkv, n_lse = s.B * s.Hq * s.lse_ld();
  std::vector<float> q = random_vec<float>(n_q * D, seed, -2.0, 2.0);
  std::vector<float> k = random_vec<float>(n_kv * D, seed + 1, -2.0, 2.0);
  std::vector<float> v = random_vec<float>(n_kv * Dv, seed + 2);
  std::vector<float> dout = random_vec<float>(n_q * Dv, seed + 3);

  // The reference at the q/k width, v and dout zero-padded (its out's pad columns come out 0).
  std::vector<float> v_ref = widen(v, Dv, D), dout_ref = widen(dout, Dv, D);
  std::vector<float> out_ref(static_cast<size_t>(n_q * D)), lse_ref(n_lse, kLsePad);
  attention_forward_ref(out_ref.data(), lse_ref.data(), q.data(), k.data(), v_ref.data(), s,
                        nullptr);
  std::vector<float> out(static_cast<size_t>(n_q * Dv), -1.0f), lse(n_lse, kLsePad);
  sdpa_forward(d, q.data(), k.data(), v.data(), out.data(), lse.data());
  expect_close(out, narrow(out_ref, D, Dv), 1e-5, "out");
  expect_close(lse, lse_ref, 1e-5, "lse");  // padding included: both kLsePad

  // Backward from the reference's out and lse (the merged ones, for a block).
  std::vector<float> dq_ref(n_q * D), dk_ref(n_kv * D), dv_ref(n_kv * D);
  attention_backward_ref(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout_ref.data(), q.data(),
                         k.data(), v_ref.data(), out_ref.data(), lse_ref.data(), s, nullptr);
  std::vector<float> out_v = narrow(out_ref, D, Dv);
  std::vector<float> dq(n_q * D, -1.0f), dk(n_kv * D, -1.0f), dv(n_kv * Dv, -1.0f);
  sdpa_backward(d, q.data(), k.data(), v.data(), out_v.data(), dout.data(), lse_ref.data(),
                dq.data(), dk.data(), dv.data());
  expect_close(dq, dq_ref, 1e-5, "dq");
  expect_close(dk, dk_ref, 1e-5, "dk");
  expect_close(dv, narrow(dv_ref, D, Dv), 1e-5, "dv");
}

AttentionShape shape(int64_t S, int64_t B, int64_t Hq, int64_t Hkv, int64_t D) {
  AttentionShape s;
  s.S = S;
  s.B = B;
  s.Hq = Hq;
  s.Hkv = Hkv;
  s.D = D;
  return s;
}

AttentionShape block(AttentionShape s, int64_t Sk, int64_t q_offset, int64_t k_offset,
                     int64_t lse_stride) {
  s.Sk = Sk;
  s.q_offset = q_offset;
  s.k_offset = k_offset;
  s.lse_stride = lse_stride;
  return s;
}

TEST(SdpaDesc, CausalMhaThroughInterpreter) {
  check_call(shape(5, 1, 2, 2, 8), 0, 11);
}

TEST(SdpaDesc, GqaBatchedThroughInterpreter) {
  check_call(shape(6, 2, 4, 2, 8), 0, 21);
}

TEST(SdpaDesc, MqaBatchedThroughInterpreter) {
  check_call(shape(4, 3, 3, 1, 16), 0, 31);
}

TEST(SdpaDesc, MlaUnequalHeadWidthsThroughInterpreter) {
  check_call(shape(5, 2, 2, 2, 24), 16, 41);
  check_call(shape(4, 2, 4, 2, 16), 8, 43);
}

TEST(SdpaDesc, ContextParallelBlocksThroughInterpreter) {
  const AttentionShape base = shape(4, 2, 2, 1, 8);
  check_call(block(base, 4, 4, 4, 7), 0, 51);  // a diagonal block: causal
  check_call(block(base, 4, 8, 0, 6), 0, 52);  // every key before every query: no mask
  check_call(block(shape(3, 2, 2, 1, 8), 5, 2, 0, 0), 0, 53);  // bottom-right causal
  check_call(block(shape(5, 1, 2, 2, 8), 5, 2, 0, 9), 0, 54);  // a band (right bound 2)
}

TEST(SdpaDesc, MasksNamed) {
  auto desc = [](const AttentionShape& s) {
    SdpaCall c;
    c.shape = s;
    return sdpa_desc(c);
  };
  EXPECT_TRUE(desc(shape(8, 1, 2, 2, 8)).causal_top_left());
  EXPECT_TRUE(desc(block(shape(4, 1, 2, 2, 8), 4, 4, 4, 0)).causal_top_left());
  EXPECT_TRUE(desc(block(shape(3, 1, 2, 2, 8), 5, 2, 0, 0)).causal_bottom_right());
  EXPECT_FALSE(desc(block(shape(4, 1, 2, 2, 8), 4, 3, 0, 0)).masked);
  const SdpaDesc band = desc(block(shape(5, 1, 2, 2, 8), 5, 2, 0, 0));
  EXPECT_TRUE(band.masked && band.alignment == SdpaAlignment::TopLeft && band.right_bound == 2);
  // The scale: 1/sqrt(D) by default, the caller's otherwise; Stats natural log, f32.
  EXPECT_EQ(desc(shape(8, 1, 2, 2, 64)).attn_scale, 0.125f);
  SdpaCall c;
  c.shape = shape(8, 1, 2, 2, 64);
  c.scale = 0.25;
  EXPECT_EQ(sdpa_desc(c).attn_scale, 0.25f);
  EXPECT_FALSE(sdpa_desc(c).stats_log2);
  EXPECT_EQ(sdpa_desc(c).stats.type, SdpaDataType::F32);
}

// The descriptor as the backend uses it (bf16 buffers, f32 Stats): the forward within bf16's
// rounding of the reference on bf16-representable inputs.
TEST(SdpaDesc, Bf16BuffersThroughInterpreter) {
  const AttentionShape s = shape(6, 2, 4, 2, 16);
  SdpaCall call;
  call.shape = s;
  const SdpaDesc d = sdpa_desc(call);
  ASSERT_EQ(d.refusal, "");
  ASSERT_EQ(d.q.type, SdpaDataType::Bf16);
  ASSERT_EQ(d.o.type, SdpaDataType::Bf16);
  const int64_t n_q = s.S * s.B * s.Hq * s.D, n_kv = s.S * s.B * s.Hkv * s.D;
  auto bf16_values = [](std::vector<float> x, std::vector<bf16>& out) {
    out.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      out[i] = float_to_bf16(x[i]);
      x[i] = bf16_to_float(out[i]);
    }
    return x;
  };
  std::vector<bf16> qb, kb, vb;
  const std::vector<float> q = bf16_values(random_vec<float>(n_q, 61, -2.0, 2.0), qb);
  const std::vector<float> k = bf16_values(random_vec<float>(n_kv, 62, -2.0, 2.0), kb);
  const std::vector<float> v = bf16_values(random_vec<float>(n_kv, 63), vb);
  std::vector<float> out_ref(n_q), lse_ref(s.B * s.Hq * s.S);
  attention_forward_ref(out_ref.data(), lse_ref.data(), q.data(), k.data(), v.data(), s, nullptr);
  std::vector<bf16> ob(n_q);
  std::vector<float> lse(lse_ref.size());
  sdpa_forward(d, qb.data(), kb.data(), vb.data(), ob.data(), lse.data());
  for (int64_t i = 0; i < n_q; ++i) {
    const double got = bf16_to_float(ob[i]), want = out_ref[i];
    ASSERT_LE(std::abs(got - want), std::ldexp(std::abs(want), -8) + 1e-6) << "out " << i;
  }
  expect_close(lse, lse_ref, 1e-5, "lse");
}

TEST(SdpaDesc, RefusesWhatCudnnCannotTake) {
  auto refusal = [](SdpaCall c) { return sdpa_desc(c).refusal; };
  SdpaCall ok;
  ok.shape = shape(16, 2, 8, 2, 128);
  EXPECT_EQ(refusal(ok), "");
  SdpaCall c = ok;
  c.dropout_p = 0.1;
  EXPECT_NE(refusal(c).find("dropout"), std::string::npos) << refusal(c);
  c = ok;
  c.storage = SdpaDataType::F32;
  EXPECT_NE(refusal(c).find("f32 storage"), std::string::npos) << refusal(c);
  c.storage = SdpaDataType::F64;
  EXPECT_NE(refusal(c).find("f64 storage"), std::string::npos) << refusal(c);
  c = ok;
  c.shape.D = 264;
  EXPECT_NE(refusal(c).find("over cuDNN's 256"), std::string::npos) << refusal(c);
  c.shape.D = 256;
  EXPECT_EQ(refusal(c), "");
  c.shape.D = 12;
  EXPECT_NE(refusal(c).find("multiple of 8"), std::string::npos) << refusal(c);
  c = ok;
  c.d_v = 20;
  EXPECT_NE(refusal(c).find("multiple of 8"), std::string::npos) << refusal(c);
  // Empty calls are expressible and make no call.
  c = ok;
  c.shape.S = 0;
  EXPECT_EQ(refusal(c), "");
  EXPECT_TRUE(sdpa_desc(c).empty);
  // Impossible calls throw, naming the values.
  c = ok;
  c.shape.Hkv = 3;
  EXPECT_THROW(sdpa_desc(c), std::exception);
  c = ok;
  c.d_v = -8;
  EXPECT_THROW(sdpa_desc(c), std::exception);
}

// A refused descriptor never reaches the library: the interpreter (as cuDNN would fail) says so.
TEST(SdpaDesc, InterpreterRejectsRefusedDescriptor) {
  SdpaCall c;
  c.shape = shape(4, 1, 2, 2, 8);
  c.dropout_p = 0.5;
  const SdpaDesc d = sdpa_desc(c);
  std::vector<bf16> buf(64);
  std::vector<float> lse(8);
  EXPECT_THROW(sdpa_forward(d, buf.data(), buf.data(), buf.data(), buf.data(), lse.data()),
               std::runtime_error);
}

// The start-up line names the path and why: the CPU, f32 runs and attention dropout always take
// the own kernel; a --bf16 run on CUDA takes cuDNN where the probe says so, and the builds
// without cuDNN (CPU, emulated) say why not.
TEST(SdpaPath, StartUpLineNamesThePathAndWhy) {
  EXPECT_EQ(attention_path_line(cpu_exec(), true, 0.0), "[attention] own kernel (CPU)");
  Exec cuda;
  cuda.device = Device::CUDA;
  EXPECT_NE(attention_path_line(cuda, false, 0.0).find("own kernel (f32/f64 run"),
            std::string::npos);
  EXPECT_NE(attention_path_line(cuda, true, 0.1).find("own kernel (attention dropout 0.1"),
            std::string::npos);
  const std::string bf16 = attention_path_line(cuda, true, 0.0);
  if (!cuda_built()) {
    EXPECT_EQ(bf16, "[attention] own kernel (emulated build: no cuDNN)");
  } else {
    EXPECT_TRUE(bf16.rfind("[attention] cuDNN fused (SDPA, cuDNN ", 0) == 0 ||
                bf16.rfind("[attention] own kernel (cuDNN ", 0) == 0 ||
                bf16 == "[attention] own kernel (MOECORE_CUDNN_ATTENTION=0)")
        << bf16;
  }
}

}  // namespace
}  // namespace moecore::ops::desc
