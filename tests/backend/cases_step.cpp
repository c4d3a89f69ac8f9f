// Cases: the step's bookkeeping ops: zero, copy and read_back (every dtype the layers clear,
// move or read, sizes 0 / 1 / odd / large, and the report structs), loss_grad_scale (no counted
// token, odd counts, both dtypes) and report_moe_layer (layers with and without an aux type, E = 1
// and an odd E, accumulation over layers). All exact: bitwise against the references, neighbours of
// every output untouched. The numeric guard's ops (flag_nonfinite over NaN / +-Inf at the
// first, last and a block-boundary element, flags that start raised; flag_at_least at, above and
// below its threshold and on NaN / Inf; skip_if_flagged): bitwise.
#include <cstring>
#include <limits>

#include "backend_case.h"
#include "ops/memory.h"
#include "ops/numeric_guard.h"
#include "ops/step_report.h"

namespace moecore::backend_test {
namespace {

template <typename T>
void zero_one(const Exec& ex) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{100003}}) {
    BACKEND_TRACE(n << " elements");
    auto v = random_vec<double>(n, 3);
    Guarded<T> got(n), want(n);
    for (int64_t i = 0; i < n; ++i) got[i] = want[i] = static_cast<T>(v[i] * 1000 + 1);
    Staging st(ex);
    ops::zero<T>(ex, st.out(got), n);
    st.back();
    ops::zero_ref(want.data(), n);
    expect_bitwise(got, want, "zeroed");
  }
}

template <typename T>
void copy_one(const Exec& ex) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{100003}}) {
    BACKEND_TRACE(n << " elements");
    auto v = random_vec<double>(n, 4);
    std::vector<T> src(n);
    for (int64_t i = 0; i < n; ++i) src[i] = static_cast<T>(v[i] * 1000 - 3);
    Guarded<T> got(n, T(7)), want(n, T(7));
    Staging st(ex);
    ops::copy<T>(ex, st.out(got), st.in(src), n);
    st.back();
    ops::copy_ref(want.data(), src.data(), n);
    expect_bitwise(got, want, "copied");
  }
}

// The host's read of device data: every element into guarded host memory, and one value (the
// destination is the host's by the op's contract: only the source is staged).
template <typename T>
void read_back_one(const Exec& ex) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{100003}}) {
    BACKEND_TRACE(n << " elements");
    auto v = random_vec<double>(n, 5);
    std::vector<T> src(n);
    for (int64_t i = 0; i < n; ++i) src[i] = static_cast<T>(v[i] * 1000 + 5);
    Guarded<T> got(n, T(9)), want(n, T(9));
    Staging st(ex);
    const T* src_d = st.in(src);
    ops::read_back<T>(ex, got.data(), src_d, n);
    ops::copy_ref(want.data(), src.data(), n);
    expect_bitwise(got, want, "read back");
    if (n > 0) {
      const T one = ops::read_value<T>(ex, src_d + n - 1);
      EXPECT_EQ(std::memcmp(&one, &src[n - 1], sizeof(T)), 0) << "read_value";
    }
  }
}

// The report structs: the middle one of three is cleared, its neighbours keep their bytes.
void zero_report(const Exec& ex) {
  ops::MicroBatchReport r[3];
  for (auto& x : r) x = ops::MicroBatchReport{1.5, 7, 2.5, 3.5, 4, 2};
  Staging st(ex);
  ops::zero<ops::MicroBatchReport>(ex, st.out(r, 3) + 1, 1);  // the neighbours staged too
  st.back();
  const ops::MicroBatchReport cleared{}, kept{1.5, 7, 2.5, 3.5, 4, 2};
  EXPECT_EQ(std::memcmp(r + 1, &cleared, sizeof cleared), 0) << "report not cleared";
  EXPECT_EQ(std::memcmp(r, &kept, sizeof kept), 0) << "the slot before was written";
  EXPECT_EQ(std::memcmp(r + 2, &kept, sizeof kept), 0) << "the slot after was written";
}

template <typename T>
void loss_grad_scale_one(const Exec& ex) {
  for (int64_t counted : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4093}}) {
    for (double scale : {1.0, 1.0 / 3.0, 0.125}) {
      BACKEND_TRACE(dtype_name<T>() << " counted=" << counted << " scale=" << scale);
      Guarded<int64_t> c(1, counted);
      Guarded<T> got(1, T(-5));
      T want = T(-5);
      Staging st(ex);
      // c is read only, staged with its guards (out()) so that a write past it shows.
      ops::loss_grad_scale<T>(ex, st.out(got), st.out(c), scale);
      st.back();
      ops::loss_grad_scale_ref(&want, c.data(), scale);
      expect_bitwise(got, &want, "dloss");
      expect_intact(c, "counted");
    }
  }
}

void report_moe_layer_case(const Exec& ex) {
  for (int64_t E : {int64_t{1}, int64_t{7}, int64_t{64}}) {
    BACKEND_TRACE("E=" << E);
    const ops::MicroBatchReport start{0.25, 11, 0.5, 0.75, 3, 1};
    ops::MicroBatchReport got = start, want = start;
    Guarded<int64_t> tokens(E), tokens_want(E);
    for (int64_t e = 0; e < E; ++e) tokens[e] = tokens_want[e] = e * 3;
    // The report and the token counts accumulate in the backend's memory over the layers; each
    // layer's values are staged per layer (their host buffers are the loop's).
    Staging acc(ex);
    ops::MicroBatchReport* got_d = acc.out(&got, 1);
    int64_t* tokens_d = acc.out(tokens);
    // Three layers: with an aux value, without one (no aux type listed), with one again.
    for (int layer = 0; layer < 3; ++layer) {
      const double aux = 1.0 + 0.1 * layer, z = 2.0 + 0.01 * layer;
      const int64_t dropped = 5 * layer;
      Guarded<int64_t> layer_tokens(E);
      for (int64_t e = 0; e < E; ++e) layer_tokens[e] = (e * 7 + layer) % 5;
      const double* a = layer == 1 ? nullptr : &aux;
      Staging st(ex);
      // layer_tokens is read only, staged with its guards (out()) so that a write past it shows.
      ops::report_moe_layer(ex, got_d, tokens_d, st.in_or_null(a, 1), st.in(&z, 1),
                            st.in(&dropped, 1), st.out(layer_tokens), E);
      st.back();
      ops::report_moe_layer_ref(&want, tokens_want.data(), a, &z, &dropped, layer_tokens.data(),
                                E);
      expect_intact(layer_tokens, "layer tokens");
    }
    acc.back();
    EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0)
        << "report: loss " << got.lm_loss_sum << " counted " << got.counted << " aux "
        << got.aux_value << " z " << got.z_value << " dropped " << got.dropped << " layers "
        << got.moe_layers;
    EXPECT_EQ(got.lm_loss_sum, start.lm_loss_sum) << "the layers wrote the loss";
    EXPECT_EQ(got.moe_layers, 4);
    expect_bitwise(tokens, tokens_want, "tokens per expert");
  }
}

template <typename T>
void flag_nonfinite_one(const Exec& ex) {
  const T bad[] = {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                   -std::numeric_limits<T>::infinity()};
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{32769}, int64_t{100003}}) {
    const auto v = random_vec<T>(n, 11, -1e3, 1e3);
    // -1: no bad element; else its position (first, last, one past the first 2^15 block).
    for (int64_t at : {int64_t{-1}, int64_t{0}, n - 1, int64_t{32768}}) {
      if (at >= n) continue;
      for (T b : bad) {
        for (int32_t start : {0, 1}) {
          BACKEND_TRACE(n << " elements, bad value " << b << " at " << at << ", flag " << start);
          Guarded<T> x(n);
          for (int64_t i = 0; i < n; ++i) x[i] = v[i];
          if (at >= 0) x[at] = b;
          Guarded<int32_t> got(1, start);
          int32_t want = start;
          Staging st(ex);
          // x is read only, staged with its guards (out()) so that a write past it shows.
          ops::flag_nonfinite<T>(ex, st.out(got), st.out(x), n);
          st.back();
          ops::flag_nonfinite_ref(&want, x.data(), n);
          expect_bitwise(got, &want, "flag");
          expect_intact(x, "x");
          if (at < 0) break;  // one pass is enough for a clean tensor
        }
      }
    }
  }
}

void flag_at_least_case(const Exec& ex) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double cases[][2] = {{5, inf}, {5, 5}, {-5, 5}, {4.999, 5}, {nan, 0},
                             {inf, 0}, {-inf, 1}, {0, 0}, {1e300, 1e299}};
  for (const auto& c : cases) {
    for (int32_t start : {0, 1}) {
      BACKEND_TRACE("value " << c[0] << " threshold " << c[1] << " flag " << start);
      Guarded<int32_t> got(1, start);
      int32_t want = start;
      Staging st(ex);
      ops::flag_at_least(ex, st.out(got), st.in(&c[0], 1), st.in(&c[1], 1));
      st.back();
      ops::flag_at_least_ref(&want, &c[0], &c[1]);
      expect_bitwise(got, &want, "flag");
    }
  }
}

void skip_if_flagged_case(const Exec& ex) {
  const std::vector<std::vector<int32_t>> cases = {{}, {0}, {1}, {0, 0, 0, 0, 0}, {0, 0, 0, 0, 1},
                                                   {2, 0, 0}};
  for (const auto& flags : cases) {
    for (int32_t start : {0, 1}) {
      BACKEND_TRACE(flags.size() << " flags, skip " << start);
      ops::AdamWStep got, want;
      got.lr = want.lr = 3e-3;
      got.step = want.step = 5;
      got.grad_scale = want.grad_scale = 0.25;
      got.skip = want.skip = start;
      const int64_t n = static_cast<int64_t>(flags.size());
      Staging st(ex);
      ops::skip_if_flagged(ex, st.out(&got, 1), st.in(flags), n);
      st.back();
      ops::skip_if_flagged_ref(&want, flags.data(), n);
      // Field by field: the struct's padding is not a value.
      EXPECT_EQ(got.skip, want.skip);
      EXPECT_TRUE(same_bits(&got.lr, &want.lr, 1) && same_bits(&got.grad_scale, &want.grad_scale, 1))
          << "lr, grad_scale";
      EXPECT_EQ(got.step, want.step);
    }
  }
}

}  // namespace

void add_step_cases(std::vector<OpCase>& out) {
  out.push_back({"zero", {"zero"}, [](const Exec& ex) {
                   zero_one<float>(ex);
                   zero_one<double>(ex);
                   zero_one<int64_t>(ex);
                   zero_one<int32_t>(ex);
                   zero_report(ex);
                 }});
  out.push_back({"copy", {"copy"}, [](const Exec& ex) {
                   copy_one<float>(ex);
                   copy_one<double>(ex);
                   copy_one<int64_t>(ex);
                   copy_one<int32_t>(ex);
                   ops::MicroBatchReport from[2] = {{1.5, 7, 2.5, 3.5, 4, 2}, {-1, 3, 0, 9, 1, 1}};
                   ops::MicroBatchReport to[2];
                   Staging st(ex);
                   ops::copy<ops::MicroBatchReport>(ex, st.out(to, 2), st.in(from, 2), 2);
                   st.back();
                   EXPECT_EQ(std::memcmp(to, from, sizeof from), 0) << "report structs";
                 }});
  out.push_back({"read_back", {"read_back", "read_value"}, [](const Exec& ex) {
                   read_back_one<float>(ex);
                   read_back_one<double>(ex);
                   read_back_one<int64_t>(ex);
                   const ops::MicroBatchReport r{1.5, 7, 2.5, 3.5, 4, 2};
                   Staging st(ex);
                   const ops::MicroBatchReport got =
                       ops::read_value<ops::MicroBatchReport>(ex, st.in(&r, 1));
                   EXPECT_EQ(std::memcmp(&got, &r, sizeof r), 0) << "a report struct";
                 }});
  out.push_back({"loss_grad_scale", {"loss_grad_scale"}, [](const Exec& ex) {
                   loss_grad_scale_one<float>(ex);
                   loss_grad_scale_one<double>(ex);
                 }});
  out.push_back({"report_moe_layer", {"report_moe_layer"}, report_moe_layer_case});
  out.push_back({"flag_nonfinite", {"flag_nonfinite"}, [](const Exec& ex) {
                   flag_nonfinite_one<float>(ex);
                   flag_nonfinite_one<double>(ex);
                 }});
  out.push_back({"flag_at_least", {"flag_at_least"}, flag_at_least_case});
  out.push_back({"skip_if_flagged", {"skip_if_flagged"}, skip_if_flagged_case});
}

}  // namespace moecore::backend_test
