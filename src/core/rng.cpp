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

double rng_normal(uint64_t key, uint64_t index, uint32_t lane) {
  auto r = rng_draw(key, index, lane);
  double u1 = rng_to_unit(r[0], r[1]), u2 = rng_to_unit(r[2], r[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace moecore
