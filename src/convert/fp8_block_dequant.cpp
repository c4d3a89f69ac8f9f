#include "convert/fp8_block_dequant.h"

#include <cmath>
#include <limits>

#include "ckpt/safetensors.h"
#include "core/check.h"

namespace moecore::convert {

float fp8_e4m3fn_to_float(uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  // e4m3fn spends the all-ones pattern on NaN only, so exponent 15 still holds 256 .. 448.
  if (exponent == 0xF && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  // Both cases are exact in f32: at most 4 significant bits, exponents within [-9, 8].
  const float magnitude = exponent == 0
                              ? std::ldexp(static_cast<float>(mantissa), -9)
                              : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return negative ? -magnitude : magnitude;
}

std::vector<float> fp8_block_dequant(std::string_view name, std::span<const uint8_t> codes,
                                     const std::vector<int64_t>& shape,
                                     std::span<const float> scale_inv,
                                     const std::vector<int64_t>& scale_shape, Fp8BlockSize block) {
  MOE_CHECK(block.rows >= 1 && block.cols >= 1,
            "[convert] tensor '{}': FP8 block size [{}, {}] must be positive (the checkpoint's "
            "quantization_config.weight_block_size)",
            name, block.rows, block.cols);
  MOE_CHECK(shape.size() == 2 && shape[0] >= 0 && shape[1] >= 0,
            "[convert] tensor '{}': an FP8 weight with block scales must be 2-D [rows, cols], not "
            "{}",
            name, ckpt::format_shape(shape));
  const int64_t rows = shape[0], cols = shape[1];
  MOE_CHECK(static_cast<int64_t>(codes.size()) == rows * cols,
            "[convert] tensor '{}': {} FP8 codes for shape {}", name, codes.size(),
            ckpt::format_shape(shape));
  const int64_t block_rows = (rows + block.rows - 1) / block.rows;
  const int64_t block_cols = (cols + block.cols - 1) / block.cols;
  const std::vector<int64_t> want = {block_rows, block_cols};
  MOE_CHECK(scale_shape == want,
            "[convert] tensor '{}': its weight_scale_inv is {}, but a weight of {} in blocks of "
            "[{}, {}] needs {} (one scale per block, the last ones partial); check "
            "quantization_config.weight_block_size",
            name, ckpt::format_shape(scale_shape), ckpt::format_shape(shape), block.rows,
            block.cols, ckpt::format_shape(want));
  MOE_CHECK(static_cast<int64_t>(scale_inv.size()) == block_rows * block_cols,
            "[convert] tensor '{}': {} scales for shape {}", name, scale_inv.size(),
            ckpt::format_shape(scale_shape));
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scale_inv.data() + (r / block.rows) * block_cols;
    for (int64_t c = 0; c < cols; ++c) {
      // One f32 product, as DeepSeek's weight_dequant (x.to(float32) * s).
      out[r * cols + c] = fp8_e4m3fn_to_float(codes[r * cols + c]) * scale_row[c / block.cols];
    }
  }
  return out;
}

}  // namespace moecore::convert
