// The clip coefficient op: Megatron's formula on hand values, fast == reference bitwise, the
// parts added in order, and a non-finite norm turning the update into a no-op (skip) instead
// of writing NaN weights.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "ops/adamw.h"
#include "ops/grad_clip.h"

namespace moecore::ops {
namespace {

TEST(GradClip, MegatronCoefficientFastEqualsRef) {
  struct Case {
    std::vector<double> parts;
    double max_norm;
  };
  const Case cases[] = {{{9.0, 16.0}, 1.0},   {{9.0, 16.0}, 0.0},  {{9.0, 16.0}, 10.0},
                        {{0.0, 0.0}, 1.0},    {{}, 1.0},           {{1e-30, 2.5}, 1.5},
                        {{0.25, 0.0}, 0.5},   {{1.0, 1e300, 1e300}, 1.0}};
  for (const Case& c : cases) {
    AdamWStep fast, ref;
    fast.skip = ref.skip = 7;
    double norm = -1, norm_ref = -2;
    grad_clip(cpu_exec(), &norm, &fast, c.parts.data(), static_cast<int64_t>(c.parts.size()),
              c.max_norm);
    grad_clip_ref(&norm_ref, &ref, c.parts.data(), static_cast<int64_t>(c.parts.size()),
                  c.max_norm);
    EXPECT_EQ(std::memcmp(&norm, &norm_ref, sizeof(double)), 0) << norm << " vs " << norm_ref;
    EXPECT_EQ(std::memcmp(&fast.grad_scale, &ref.grad_scale, sizeof(double)), 0);
    EXPECT_EQ(fast.skip, 0);
    EXPECT_EQ(ref.skip, 0);
  }
  AdamWStep s;
  double norm = 0;
  const double parts[2] = {9.0, 16.0};
  grad_clip(cpu_exec(), &norm, &s, parts, 2, 1.0);
  EXPECT_EQ(norm, 5.0);
  EXPECT_EQ(s.grad_scale, 1.0 / (5.0 + 1e-6));
  grad_clip(cpu_exec(), &norm, &s, parts, 2, 10.0);  // below the threshold: no clipping
  EXPECT_EQ(s.grad_scale, 1.0);
  grad_clip(cpu_exec(), &norm, &s, parts, 2, 0.0);  // clipping off
  EXPECT_EQ(s.grad_scale, 1.0);
}

TEST(GradClip, NonFiniteNormSkipsTheUpdate) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {nan, inf}) {
    const double parts[2] = {1.0, bad};
    AdamWStep fast, ref;
    double norm = 0, norm_ref = 0;
    grad_clip(cpu_exec(), &norm, &fast, parts, 2, 1.0);
    grad_clip_ref(&norm_ref, &ref, parts, 2, 1.0);
    EXPECT_FALSE(std::isfinite(norm));
    EXPECT_EQ(fast.skip, 1);
    EXPECT_EQ(ref.skip, 1);
    EXPECT_EQ(fast.grad_scale, 1.0);
    // The update reads skip and leaves weights, moments and the bf16 copies as they were.
    std::vector<float> p = {1.f, -2.f}, g = {nanf(""), 1.f}, m = {0.5f, 0.25f}, v = {1.f, 2.f};
    std::vector<float> p16w = {3.f, 4.f};
    std::vector<bf16> p16(2);
    const std::vector<float> p0 = p, m0 = m, v0 = v, w0 = p16w;
    AdamWParams a;
    adamw_step<float>(cpu_exec(), p.data(), g.data(), m.data(), v.data(), 2, a, &fast, p16.data(),
                      p16w.data());
    EXPECT_EQ(p, p0);
    EXPECT_EQ(m, m0);
    EXPECT_EQ(v, v0);
    EXPECT_EQ(p16w, w0);
    adamw_step_ref<float>(p.data(), g.data(), m.data(), v.data(), 2, a, ref);
    EXPECT_EQ(p, p0);
  }
}

}  // namespace
}  // namespace moecore::ops
