// numpy's legacy RandomState(seed) as Megatron's datasets use it: MT19937 seeded by
// init_genrand, and RandomState.shuffle of a 1-D array (Fisher-Yates from the end, each swap
// partner drawn by numpy's random_interval: masked rejection on 32-bit draws, 64-bit draws
// above 2^32 - 1). Reproducing it bit for bit makes the document and shuffle indices equal to
// Megatron's for the same seed (tests/data compares them with numpy-generated fixtures).
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace moecore::data {

class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed);
  uint32_t next_uint32();
  uint64_t next_uint64();  // numpy: (first draw << 32) | second draw
  // numpy's random_interval: uniform in [0, max].
  uint64_t interval(uint64_t max);
  template <typename T>
  void shuffle(std::span<T> x) {
    for (size_t i = x.size(); i-- > 1;) {
      const uint64_t j = interval(i);
      T tmp = x[i];
      x[i] = x[j];
      x[j] = tmp;
    }
  }

 private:
  void refill();
  std::array<uint32_t, 624> mt_{};
  int pos_ = 624;
};

// numpy's default_rng(seed): PCG64 (XSL-RR 128/64) seeded through SeedSequence(seed), and
// Generator.integers(low, high, dtype=int32) (Lemire's bounded draws on 32-bit halves of the
// 64-bit outputs). Megatron's mock dataset draws its sequence lengths this way.
class NumpyGenerator {
 public:
  explicit NumpyGenerator(uint64_t seed);
  uint64_t next_uint64();
  uint32_t next_uint32();
  // Generator.integers(low, high) for dtype=int32: uniform in [low, high).
  int32_t integers_int32(int32_t low, int32_t high);

 private:
  unsigned __int128 state_ = 0, inc_ = 0;
  bool has_uint32_ = false;
  uint32_t uinteger_ = 0;
};

}  // namespace moecore::data
