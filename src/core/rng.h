// Counter-based RNG (Philox4x32-10). A parameter's initial value is a pure function of
// (seed, parameter name, global element index), so every parallel layout holds the same
// global model: the key comes from (seed, name), the counter is the global index.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace moecore {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// 64-bit key from a seed and a name (FNV-1a of the name mixed with splitmix64 of the seed).
uint64_t rng_key(uint64_t seed, std::string_view name);

// Uniform in (0, 1) and standard normal draws for stream `key` at position `index`
// (`lane` selects an independent draw at the same index).
double rng_uniform(uint64_t key, uint64_t index, uint32_t lane = 0);
double rng_normal(uint64_t key, uint64_t index, uint32_t lane = 0);

}  // namespace moecore
