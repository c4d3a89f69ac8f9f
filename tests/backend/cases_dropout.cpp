// Cases: dropout, dropout + residual add and the dropout backward, against their references
// bitwise (each element is one multiply, or a multiply and an add, of the same factor). Sizes 0 /
// 1 / odd / across the 4-column Philox block and the 64-column chunk, a first position past 0,
// one shape above the OpenMP threshold; in place too.
#include "backend_case.h"
#include "core/rng.h"
#include "ops/dropout.h"

namespace moecore::backend_test {
namespace {

struct SBC {
  int64_t S, B, C, s0;
};
const SBC kDropoutShapes[] = {{0, 2, 5, 0},  {1, 1, 1, 0},   {1, 1, 3, 0},
                              {7, 3, 37, 4}, {5, 2, 130, 0}, {64, 3, 101, 0}};

template <typename T>
void dropout_case(const Exec& ex) {
  // Read from memory by the op (a planned buffer in the step): staged with the case's buffers.
  const ops::DropoutCounters counters{9, 30};
  const uint64_t key = rng_key(5, "decoder.layers.3.hidden_dropout");
  uint32_t seed = 500;
  for (double p : {0.0, 0.1, 0.5}) {
    for (auto [S, B, C, s0] : kDropoutShapes) {
      BACKEND_TRACE(dtype_name<T>()
                    << " p=" << p << " S=" << S << " B=" << B << " C=" << C << " s0=" << s0);
      const int64_t n = S * B * C;
      const auto x = random_vec<T>(n, seed++), res = random_vec<T>(n, seed++);
      std::vector<T> y_ref(n), a_ref(n), dx_ref(n);
      ops::dropout_forward_ref<T>(y_ref.data(), x.data(), p, key, &counters, S, B, C, s0);
      ops::dropout_add_forward_ref<T>(a_ref.data(), res.data(), x.data(), p, key, &counters, S, B,
                                      C, s0);
      ops::dropout_backward_ref<T>(dx_ref.data(), x.data(), p, key, &counters, S, B, C, s0);
      Guarded<T> y = nan_out<T>(n), a = nan_out<T>(n), dx = nan_out<T>(n), y_in = guarded(x),
                 a_in = guarded(res), dx_in = guarded(x);
      Staging st(ex);
      const ops::DropoutCounters* c_d = st.in(&counters, 1);
      const T* x_d = st.in(x);
      // The in-place buffers staged once, as outputs (the order of a call's arguments is
      // unspecified).
      T* y_in_d = st.out(y_in);
      T* a_in_d = st.out(a_in);
      T* dx_in_d = st.out(dx_in);
      ops::dropout_forward<T>(ex, st.out(y), x_d, p, key, c_d, S, B, C, s0);
      ops::dropout_add_forward<T>(ex, st.out(a), st.in(res), x_d, p, key, c_d, S, B, C, s0);
      ops::dropout_backward<T>(ex, st.out(dx), x_d, p, key, c_d, S, B, C, s0);
      ops::dropout_forward<T>(ex, y_in_d, y_in_d, p, key, c_d, S, B, C, s0);
      ops::dropout_add_forward<T>(ex, a_in_d, a_in_d, x_d, p, key, c_d, S, B, C, s0);
      ops::dropout_backward<T>(ex, dx_in_d, dx_in_d, p, key, c_d, S, B, C, s0);
      st.back();
      expect_bitwise(y, y_ref.data(), "y");
      expect_bitwise(a, a_ref.data(), "y (add)");
      expect_bitwise(dx, dx_ref.data(), "dx");
      expect_bitwise(y_in, y_ref.data(), "y in place");
      expect_bitwise(a_in, a_ref.data(), "y (add) in place");
      expect_bitwise(dx_in, dx_ref.data(), "dx in place");
    }
  }
}

}  // namespace

void add_dropout_cases(std::vector<OpCase>& out) {
  const std::vector<std::string> ops = {"dropout_forward", "dropout_add_forward",
                                        "dropout_backward"};
  out.push_back({"dropout_f32", ops, dropout_case<float>});
  out.push_back({"dropout_f64", ops, dropout_case<double>});
}

}  // namespace moecore::backend_test
