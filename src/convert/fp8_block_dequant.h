// The FP8 weights of DeepSeek-V3's released checkpoints: each 2-D weight stored as float8_e4m3fn
// codes with a float32 `weight_scale_inv` of one scale per block of the weight (128 x 128 as
// quantization_config.weight_block_size says; the blocks on the last rows and columns are
// partial). A value is decode(code) x scale_inv of its block, in f32 as DeepSeek's own
// `weight_dequant` computes it; moecore's master weights are f32, so the import widens them here.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace moecore::convert {

// The exact value of a float8_e4m3fn code (OCP FP8 E4M3, "fn": finite, one NaN per sign):
// 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 are subnormals
// (m / 8 x 2^-6), 0x7F and 0xFF are NaN, 0x7E = 448 is the largest; there are no infinities.
float fp8_e4m3fn_to_float(uint8_t code);

// The block shape of the scales: DeepSeek's quantization_config.weight_block_size [rows, cols].
struct Fp8BlockSize {
  int64_t rows = 128;
  int64_t cols = 128;

  bool operator==(const Fp8BlockSize&) const = default;
};

// The f32 weight [rows, cols] (row-major) of the e4m3fn `codes` of `shape` and the f32
// `scale_inv` of `scale_shape`, which must be [ceil(rows / block.rows), ceil(cols / block.cols)].
// A weight that is not 2-D, a block size below 1, data sizes that do not match their shapes or a
// scale of another shape throw, naming `name` (the weight's tensor) and the shapes.
std::vector<float> fp8_block_dequant(std::string_view name, std::span<const uint8_t> codes,
                                     const std::vector<int64_t>& shape,
                                     std::span<const float> scale_inv,
                                     const std::vector<int64_t>& scale_shape, Fp8BlockSize block);

}  // namespace moecore::convert
