// DeepSeek-V3's FP8 weights: every one of the 256 float8_e4m3fn codes decodes to the value of a
// table built here from the format's definition by counting (not by the decoder's formula), plus
// anchors from the OCP FP8 spec; block-scale dequantization with partial edge blocks equals a
// per-element loop; a scale of the wrong shape is refused naming the tensor; HfWeights reads an
// F8_E4M3 weight with its `_scale_inv` beside it as f32 and counts both as read, and on the FP8
// fixture of DeepSeek-V3 (tools/make_hf_fixtures.py) gives torch's dequantized values bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/ckpt_files.h"
#include "common/paths.h"
#include "common/testing.h"
#include "convert/fp8_block_dequant.h"
#include "convert/hf_weights.h"

namespace moecore::convert {
namespace {

using testing::error_of;

// The non-negative finite e4m3fn values in code order, built by counting: 8 subnormals spaced
// 2^-9 from 0, then per binade [2^(e-7), 2^(e-6)) eight values spaced 2^(e-10), for e = 1 .. 15,
// the last binade cut after 448 (its eighth pattern is NaN).
std::vector<double> positive_table() {
  std::vector<double> v;
  double step = std::ldexp(1.0, -9), x = 0.0;
  for (int i = 0; i < 8; ++i, x += step) v.push_back(x);  // 0, 2^-9, ..., 7 x 2^-9
  for (int binade = 1; binade <= 15; ++binade) {          // x is 2^(binade-7) here
    for (int i = 0; i < 8 && v.size() < 127; ++i, x += step) v.push_back(x);
    step *= 2.0;
  }
  return v;
}

TEST(Fp8E4m3fn, EveryCodeDecodesToTheCountedTable) {
  const std::vector<double> table = positive_table();
  ASSERT_EQ(table.size(), 127u);
  for (int code = 0; code < 256; ++code) {
    SCOPED_TRACE(code);
    const float got = fp8_e4m3fn_to_float(static_cast<uint8_t>(code));
    const int low = code & 0x7F;
    if (low == 0x7F) {
      EXPECT_TRUE(std::isnan(got));
      continue;
    }
    const double want = (code & 0x80) ? -table[low] : table[low];
    EXPECT_EQ(static_cast<double>(got), want);
    EXPECT_EQ(std::signbit(got), (code & 0x80) != 0);  // 0x80 is -0
  }
}

TEST(Fp8E4m3fn, AnchorsOfTheFormat) {
  EXPECT_EQ(fp8_e4m3fn_to_float(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3fn_to_float(0xC0), -2.0f);
  EXPECT_EQ(fp8_e4m3fn_to_float(0x7E), 448.0f);     // the largest finite
  EXPECT_EQ(fp8_e4m3fn_to_float(0x78), 256.0f);     // exponent 15 holds finite values (no inf)
  EXPECT_EQ(fp8_e4m3fn_to_float(0x08), 0.015625f);  // 2^-6, the smallest normal
  EXPECT_EQ(fp8_e4m3fn_to_float(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(fp8_e4m3fn_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(fp8_e4m3fn_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_e4m3fn_to_float(0xFF)));
}

// A [5, 7] weight in blocks of [2, 3]: scales [3, 3], the last block row one row high and the last
// block column one column wide.
TEST(Fp8BlockDequant, PartialEdgeBlocksTakeTheirOwnScale) {
  const int64_t rows = 5, cols = 7;
  std::vector<uint8_t> codes(rows * cols);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * 37 + 11) % 255);
  std::vector<float> scale(9);
  for (size_t i = 0; i < scale.size(); ++i)
    scale[i] = std::ldexp(1.0f, static_cast<int>(i) - 4) * 1.5f;
  const std::vector<float> got =
      fp8_block_dequant("w", codes, {rows, cols}, scale, {3, 3}, Fp8BlockSize{2, 3});
  ASSERT_EQ(got.size(), codes.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float want = fp8_e4m3fn_to_float(codes[r * cols + c]) * scale[(r / 2) * 3 + c / 3];
      SCOPED_TRACE(::testing::Message() << r << "," << c);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got[r * cols + c]));
      } else {
        EXPECT_EQ(got[r * cols + c], want);
      }
    }
  }
  // The corner element is in the last block (row 4, column 6): scale[8].
  EXPECT_EQ(got[4 * cols + 6], fp8_e4m3fn_to_float(codes[4 * cols + 6]) * scale[8]);
}

// DeepSeek's own block: 128 x 128 on a [130, 129] weight gives scales [2, 2].
TEST(Fp8BlockDequant, DefaultBlockIs128) {
  const std::vector<uint8_t> codes(130 * 129, 0x38);  // 1.0
  const std::vector<float> scale = {2.0f, 3.0f, 5.0f, 7.0f};
  const std::vector<float> got = fp8_block_dequant("w", codes, {130, 129}, scale, {2, 2}, {});
  EXPECT_EQ(got[0], 2.0f);
  EXPECT_EQ(got[127 * 129 + 127], 2.0f);
  EXPECT_EQ(got[127 * 129 + 128], 3.0f);
  EXPECT_EQ(got[128 * 129 + 127], 5.0f);
  EXPECT_EQ(got[129 * 129 + 128], 7.0f);
}

TEST(Fp8BlockDequant, RefusesAScaleOfTheWrongShapeNamingTheTensor) {
  const std::vector<uint8_t> codes(5 * 7, 0x38);
  const std::vector<float> scale(6, 1.0f);
  const std::string e = error_of([&] {
    fp8_block_dequant("model.layers.0.mlp.gate_proj.weight", codes, {5, 7}, scale, {2, 3},
                      Fp8BlockSize{2, 3});
  });
  EXPECT_NE(e.find("[convert] tensor 'model.layers.0.mlp.gate_proj.weight': its "
                   "weight_scale_inv is [2, 3], but a weight of [5, 7] in blocks of [2, 3] "
                   "needs [3, 3]"),
            std::string::npos)
      << e;
  EXPECT_NE(error_of([&] {
              fp8_block_dequant("v", codes, {35}, scale, {6}, {});
            }).find("[convert] tensor 'v': an FP8 weight with block scales must be 2-D"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              fp8_block_dequant("v", codes, {5, 7}, scale, {2, 3}, {0, 3});
            }).find("FP8 block size [0, 3] must be positive"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              fp8_block_dequant("v", codes, {5, 6}, scale, {1, 1}, {});
            }).find("[convert] tensor 'v': 35 FP8 codes for shape [5, 6]"),
            std::string::npos);
}

std::vector<std::byte> f32_bytes(const std::vector<float>& v) {
  std::vector<std::byte> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// A checkpoint directory as DeepSeek-V3's FP8 release has it: a [3, 5] F8_E4M3 weight in blocks
// of [2, 2] (scales [2, 3]), and an F32 norm weight beside it.
TEST(HfWeightsFp8, ReadsTheWeightDequantizedAndCountsItsScaleAsRead) {
  ckpt::testing::TempDir dir;
  const std::vector<uint8_t> codes = {0x38, 0xC0, 0x01, 0x7E, 0x80, 0x08, 0x30, 0x40,
                                      0x48, 0x50, 0xB8, 0x00, 0x39, 0x3A, 0x3B};
  const std::vector<float> scale = {0.5f, 2.0f, 4.0f, 0.25f, 8.0f, 1.0f};
  std::vector<std::byte> code_bytes(codes.size());
  std::memcpy(code_bytes.data(), codes.data(), codes.size());
  write_hf_weights(dir.path(),
                   {{"l.w.weight", "F8_E4M3", {3, 5}, code_bytes},
                    {"l.w.weight_scale_inv", "F32", {2, 3}, f32_bytes(scale)},
                    {"l.norm.weight", "F32", {2}, f32_bytes({1.0f, 2.0f})}},
                   0);
  HfWeights w(dir.path());
  w.set_fp8_block_size({2, 2});
  const std::vector<float> got = w.read_f32("l.w.weight");
  ASSERT_EQ(got.size(), 15u);
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 5; ++c) {
      EXPECT_EQ(got[r * 5 + c], fp8_e4m3fn_to_float(codes[r * 5 + c]) * scale[(r / 2) * 3 + c / 2])
          << r << "," << c;
    }
  }
  EXPECT_EQ(got[0], 0.5f);            // 1.0 x 0.5
  EXPECT_EQ(got[3], 448.0f * 2.0f);   // row 0, column 3: block (0, 1)
  EXPECT_EQ(got[14], 1.375f * 1.0f);  // row 2, column 4: the corner block (1, 2)
  EXPECT_EQ(w.unread(), (std::vector<std::string>{"l.norm.weight"}));

  // Read with DeepSeek's 128 x 128 blocks, the [2, 3] scales are the wrong shape: refused by name.
  HfWeights w128(dir.path());
  const std::string e = error_of([&] { w128.read_f32("l.w.weight"); });
  EXPECT_NE(e.find("[convert] tensor 'l.w.weight': its weight_scale_inv is [2, 3], but a weight "
                   "of [3, 5] in blocks of [128, 128] needs [1, 1]"),
            std::string::npos)
      << e;
}

// torch's float8_e4m3fn codes and block scales, dequantized by torch (codes.float() * scale):
// every FP8 tensor of the fixture read back bit for bit, every other tensor read as it is, none
// left over.
TEST(HfWeightsFp8, DeepSeekV3FixtureEqualsTorchsDequantization) {
  const std::filesystem::path dir =
      std::filesystem::path(testing::source_dir()) / "tests/fixtures/hf/deepseek_v3_fp8";
  HfWeights w(dir);
  w.set_fp8_block_size({16, 16});  // its config.json's quantization_config.weight_block_size
  const ckpt::SafetensorsFile want(dir / "dequantized.safetensors");
  int fp8 = 0;
  for (const std::string& name : w.names()) {
    if (name.ends_with("_scale_inv")) continue;
    SCOPED_TRACE(name);
    const std::vector<float> got = w.read_f32(name);
    if (w.info(name).dtype != "F8_E4M3") continue;
    ++fp8;
    const std::span<const std::byte> b = want.bytes(name);
    ASSERT_EQ(b.size(), got.size() * 4);
    EXPECT_EQ(std::memcmp(b.data(), got.data(), b.size()), 0);
  }
  EXPECT_EQ(fp8, static_cast<int>(want.num_tensors()));
  EXPECT_GT(fp8, 40);
  EXPECT_TRUE(w.unread().empty());
}

}  // namespace
}  // namespace moecore::convert
