#include "core/rng.h"

#include <cmath>

namespace moecore {

static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t rng_key(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : name) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001b3ull;
  }
  return splitmix64(h ^ splitmix64(seed));
}

static std::array<uint32_t, 4> draw(uint64_t key, uint64_t index, uint32_t lane) {
  return philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), lane, 0u},
                    {static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)});
}

// 53-bit uniform in the open interval (0, 1).
static double to_unit(uint32_t a, uint32_t b) {
  uint64_t bits = (static_cast<uint64_t>(a) << 21) ^ (b >> 11);
  bits &= (1ull << 53) - 1;
  return (static_cast<double>(bits) + 0.5) * (1.0 / 9007199254740992.0);
}

double rng_uniform(uint64_t key, uint64_t index, uint32_t lane) {
  auto r = draw(key, index, lane);
  return to_unit(r[0], r[1]);
}

double rng_normal(uint64_t key, uint64_t index, uint32_t lane) {
  auto r = draw(key, index, lane);
  double u1 = to_unit(r[0], r[1]), u2 = to_unit(r[2], r[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace moecore
