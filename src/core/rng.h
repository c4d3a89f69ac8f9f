// Counter-based RNG (Philox4x32-10). A parameter's initial value is a pure function of
// (seed, parameter name, global element index), so every parallel layout holds the same
// global model: the key comes from (seed, name), the counter is the global index.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "core/host_device.h"

namespace moecore {

// Inline (and constexpr) so that the dropout masks (ops/dropout.h) and the input jitter draw it per
// element in the ops' loops and in their CUDA kernels (the same bits on every backend).
MOE_HOST_DEVICE constexpr std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c,
                                                             std::array<uint32_t, 2> k) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kW0;
    k[1] += kW1;
  }
  return c;
}

// 64-bit key from a seed and a name (FNV-1a of the name mixed with splitmix64 of the seed).
uint64_t rng_key(uint64_t seed, std::string_view name);

// The Philox block of stream `key` at position `index`, lane `lane`.
MOE_HOST_DEVICE inline std::array<uint32_t, 4> rng_draw(uint64_t key, uint64_t index,
                                                        uint32_t lane) {
  return philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), lane, 0u},
                    {static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)});
}

// 53 bits of (a, b) as a uniform in the open interval (0, 1): an add then a multiply, nothing to
// contract, so every backend rounds it the same.
MOE_HOST_DEVICE inline double rng_to_unit(uint32_t a, uint32_t b) {
  uint64_t bits = (static_cast<uint64_t>(a) << 21) ^ (b >> 11);
  bits &= (1ull << 53) - 1;
  return (static_cast<double>(bits) + 0.5) * (1.0 / 9007199254740992.0);
}

// Uniform in (0, 1) and standard normal draws for stream `key` at position `index`
// (`lane` selects an independent draw at the same index). The uniform is shared with the CUDA
// kernels (the input jitter's): inline, host and device.
MOE_HOST_DEVICE inline double rng_uniform(uint64_t key, uint64_t index, uint32_t lane = 0) {
  const std::array<uint32_t, 4> r = rng_draw(key, index, lane);
  return rng_to_unit(r[0], r[1]);
}
double rng_normal(uint64_t key, uint64_t index, uint32_t lane = 0);

}  // namespace moecore
