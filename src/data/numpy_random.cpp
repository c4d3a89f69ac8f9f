#include "data/numpy_random.h"

namespace moecore::data {

NumpyRandomState::NumpyRandomState(uint32_t seed) {
  // init_genrand, as numpy's mt19937_seed.
  mt_[0] = seed;
  for (uint32_t i = 1; i < 624; ++i) {
    mt_[i] = 1812433253u * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + i;
  }
  pos_ = 624;
}

void NumpyRandomState::refill() {
  constexpr uint32_t kUpper = 0x80000000u, kLower = 0x7fffffffu, kMatrix = 0x9908b0dfu;
  for (int i = 0; i < 624; ++i) {
    const uint32_t y = (mt_[i] & kUpper) | (mt_[(i + 1) % 624] & kLower);
    mt_[i] = mt_[(i + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? kMatrix : 0u);
  }
  pos_ = 0;
}

uint32_t NumpyRandomState::next_uint32() {
  if (pos_ == 624) refill();
  uint32_t y = mt_[pos_++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

uint64_t NumpyRandomState::next_uint64() {
  const uint64_t hi = next_uint32();
  return (hi << 32) | next_uint32();
}

uint64_t NumpyRandomState::interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffull) {
    while ((value = (next_uint32() & mask)) > max) {
    }
  } else {
    while ((value = (next_uint64() & mask)) > max) {
    }
  }
  return value;
}

namespace {

// SeedSequence: hash the entropy words into a pool of 4, then draw state words from the pool.
constexpr uint32_t kInitA = 0x43b0d7e5u, kMultA = 0x931e8875u, kInitB = 0x8b51f9ddu,
                   kMultB = 0x58f38dedu, kMixMultL = 0xca01f9ddu, kMixMultR = 0x4973f715u;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> 16;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixMultL * x - kMixMultR * y;
  r ^= r >> 16;
  return r;
}

std::array<uint64_t, 4> seed_sequence_state(uint64_t seed) {
  // The entropy as uint32 words, least significant first (a 0 seed is one word, 0).
  std::array<uint32_t, 2> words{};
  size_t n_words = 0;
  if (seed == 0) {
    n_words = 1;
  } else {
    for (uint64_t v = seed; v > 0; v >>= 32) words[n_words++] = static_cast<uint32_t>(v);
  }
  std::array<uint32_t, 4> pool{};
  uint32_t hc = kInitA;
  for (size_t i = 0; i < 4; ++i) pool[i] = hashmix(i < n_words ? words[i] : 0u, hc);
  for (size_t src = 0; src < 4; ++src) {
    for (size_t dst = 0; dst < 4; ++dst) {
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], hc));
    }
  }
  // (entropy beyond the pool size: at most 2 words here, never)
  std::array<uint32_t, 8> out32{};
  uint32_t hb = kInitB;
  for (size_t i = 0; i < 8; ++i) {
    uint32_t v = pool[i % 4];
    v ^= hb;
    hb *= kMultB;
    v *= hb;
    v ^= v >> 16;
    out32[i] = v;
  }
  std::array<uint64_t, 4> out{};
  for (size_t i = 0; i < 4; ++i) out[i] = uint64_t{out32[2 * i]} | (uint64_t{out32[2 * i + 1]} << 32);
  return out;
}

constexpr unsigned __int128 kPcgMultiplier =
    (static_cast<unsigned __int128>(2549297995355413924ull) << 64) | 4865540595714422341ull;

}  // namespace

NumpyGenerator::NumpyGenerator(uint64_t seed) {
  const std::array<uint64_t, 4> s = seed_sequence_state(seed);
  const unsigned __int128 initstate = (static_cast<unsigned __int128>(s[0]) << 64) | s[1];
  const unsigned __int128 initseq = (static_cast<unsigned __int128>(s[2]) << 64) | s[3];
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  state_ = state_ * kPcgMultiplier + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMultiplier + inc_;
}

uint64_t NumpyGenerator::next_uint64() {
  state_ = state_ * kPcgMultiplier + inc_;
  const uint64_t x = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  const unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t NumpyGenerator::next_uint32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uinteger_;
  }
  const uint64_t next = next_uint64();
  has_uint32_ = true;
  uinteger_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next & 0xffffffffu);
}

int32_t NumpyGenerator::integers_int32(int32_t low, int32_t high) {
  const uint32_t rng = static_cast<uint32_t>(high - 1 - low);
  if (rng == 0) return low;
  const uint32_t rng_excl = rng + 1;
  uint64_t m = uint64_t{next_uint32()} * rng_excl;
  uint32_t leftover = static_cast<uint32_t>(m);
  if (leftover < rng_excl) {
    const uint32_t threshold = (0xffffffffu - rng) % rng_excl;
    while (leftover < threshold) {
      m = uint64_t{next_uint32()} * rng_excl;
      leftover = static_cast<uint32_t>(m);
    }
  }
  return static_cast<int32_t>(static_cast<uint32_t>(low) + static_cast<uint32_t>(m >> 32));
}

}  // namespace moecore::data
