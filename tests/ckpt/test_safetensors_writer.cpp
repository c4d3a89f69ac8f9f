// The safetensors writer: what it writes reads back exactly (every dtype, scalars, empty
// tensors, metadata); the header is padded to 8 bytes; the bytes equal hand-computed files,
// three of them the reference library's own test vectors; inconsistent tensors are refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/safetensors.h"
#include "ckpt/safetensors_file.h"
#include "ckpt/safetensors_writer.h"
#include "ckpt_files.h"

namespace moecore::ckpt {
namespace {

using testing::as_bytes;
using testing::TempDir;

// The 8-byte little-endian length, the header text, the data: a file spelled out by hand.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string as_string(const std::vector<std::byte>& b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

template <typename T>
std::string le_bytes(const std::vector<T>& v) {  // the host is little-endian (x86, ARM)
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T)};
}

TEST(SafetensorsDtype, SizesOfTheFormatsDtypes) {
  EXPECT_EQ(dtype_size("F32"), 4u);
  EXPECT_EQ(dtype_size("F64"), 8u);
  EXPECT_EQ(dtype_size("BF16"), 2u);
  EXPECT_EQ(dtype_size("F16"), 2u);
  EXPECT_EQ(dtype_size("I64"), 8u);
  EXPECT_EQ(dtype_size("I32"), 4u);
  EXPECT_EQ(dtype_size("U8"), 1u);
  EXPECT_EQ(dtype_size("BOOL"), 1u);
  EXPECT_EQ(dtype_size("F8_E4M3"), 1u);
  EXPECT_EQ(dtype_size("C64"), 8u);
  EXPECT_ERROR_HAS(dtype_size("f32"), "unknown dtype 'f32' (known: BOOL, U8");
  EXPECT_ERROR_HAS(dtype_size("F4"), "dtype 'F4' packs elements below a byte");
  for (const DType t : {DType::F32, DType::BF16, DType::F64, DType::I32, DType::I64}) {
    EXPECT_EQ(dtype_size(safetensors_dtype(t)), moecore::dtype_size(t)) << dtype_name(t);
  }
}

TEST(SafetensorsWriter, RoundTripOfEveryKindOfTensor) {
  const std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f};
  const std::vector<double> f64 = {1.0 / 3.0, -1e300};
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC000, 0x7FC0};  // 1, -2, NaN
  const std::vector<uint16_t> f16 = {0x3C00, 0xFBFF};           // 1, -65504
  const std::vector<int64_t> i64 = {-(int64_t{1} << 62)};
  const std::vector<int32_t> i32 = {1, -2, 3, 2147483647};
  const std::vector<uint8_t> u8 = {0, 1, 254, 255, 7};
  const std::vector<uint8_t> boolean = {1, 0, 1};
  SafetensorsWriter w;
  w.add("layers.0.w", "F32", {2, 3}, as_bytes(f32));
  w.add("f64", "F64", {2}, as_bytes(f64));
  w.add("bf16", "BF16", {3}, as_bytes(bf16));
  w.add("f16", "F16", {1, 2}, as_bytes(f16));
  w.add("scalar", "I64", {}, as_bytes(i64));  // shape []: one element
  w.add("empty", "F32", {0}, {});             // shape [0]: no bytes
  w.add("i32", "I32", {2, 2}, as_bytes(i32));
  w.add("empty_3d", "BF16", {2, 0, 3}, {});
  w.add("u8", "U8", {5}, as_bytes(u8));
  w.add("mask", "BOOL", {3}, as_bytes(boolean));
  EXPECT_EQ(w.num_tensors(), 10u);

  TempDir dir;
  const auto p = dir / "model_rank_00000.safetensors";
  w.write(p);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model_rank_00000.safetensors"});
  EXPECT_EQ(testing::read_bytes(p), w.serialize());

  const SafetensorsFile f(p);
  // Insertion order, the empty tensors included (they tie with their successor's offset).
  EXPECT_EQ(f.names(), (std::vector<std::string>{"layers.0.w", "f64", "bf16", "f16", "scalar",
                                                 "empty", "i32", "empty_3d", "u8", "mask"}));
  auto same = [&](const std::string& name, const std::string& dtype,
                  const std::vector<int64_t>& shape, const std::string& bytes) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.has(name));
    EXPECT_EQ(f.info(name).dtype, dtype);
    EXPECT_EQ(f.info(name).shape, shape);
    EXPECT_EQ(f.info(name).nbytes, bytes.size());
    const auto b = f.bytes(name);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(b.data()), b.size()), bytes);
  };
  same("layers.0.w", "F32", {2, 3}, le_bytes(f32));
  same("f64", "F64", {2}, le_bytes(f64));
  same("bf16", "BF16", {3}, le_bytes(bf16));
  same("f16", "F16", {1, 2}, le_bytes(f16));
  same("scalar", "I64", {}, le_bytes(i64));
  same("empty", "F32", {0}, "");
  same("i32", "I32", {2, 2}, le_bytes(i32));
  same("empty_3d", "BF16", {2, 0, 3}, "");
  same("u8", "U8", {5}, le_bytes(u8));
  same("mask", "BOOL", {3}, le_bytes(boolean));
  EXPECT_EQ(f.info("layers.0.w").offset, 0u);
  EXPECT_EQ(f.info("f64").offset, 24u);
  EXPECT_EQ(f.info("empty").offset, f.info("i32").offset);
  EXPECT_TRUE(f.metadata().empty());
  EXPECT_FALSE(f.has("layers.1.w"));
}

TEST(SafetensorsWriter, MetadataRoundTrip) {
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.set_metadata("iteration", "100");
  w.set_metadata("note", "");
  w.set_metadata("unicode \u00e9", "line\nbreak \"quoted\" \u4e2d");
  w.set_metadata("iteration", "200");  // replaces
  const std::vector<float> x = {1.0f};
  w.add("x", "F32", {1}, as_bytes(x));
  TempDir dir;
  w.write(dir / "m.safetensors");
  const SafetensorsFile f(dir / "m.safetensors");
  const std::map<std::string, std::string> expected = {
      {"format", "pt"},
      {"iteration", "200"},
      {"note", ""},
      {"unicode \u00e9", "line\nbreak \"quoted\" \u4e2d"}};
  EXPECT_EQ(f.metadata(), expected);
  EXPECT_EQ(f.names(), std::vector<std::string>{"x"});
}

TEST(SafetensorsWriter, HeaderIsPaddedWithSpacesToAMultipleOf8) {
  // Names of every length mod 8, so every amount of padding (0..7) occurs.
  for (int len = 1; len <= 16; ++len) {
    SafetensorsWriter w;
    const std::vector<uint8_t> b = {42};
    w.add(std::string(len, 'n'), "U8", {1}, as_bytes(b));
    const std::string h = w.header();
    SCOPED_TRACE(h);
    EXPECT_EQ(h.size() % 8, 0u);
    const size_t json_end = h.rfind('}') + 1;
    EXPECT_LT(h.size() - json_end, 8u);
    EXPECT_EQ(h.substr(json_end), std::string(h.size() - json_end, ' '));
    const std::vector<std::byte> file = w.serialize();
    EXPECT_EQ(file.size(), 8 + h.size() + 1);
    EXPECT_EQ(static_cast<uint8_t>(file[8 + h.size()]), 42);  // the data block, 8-aligned
  }
}

// The reference library's own unit tests (safetensors/src/tensor.rs, test_empty and
// test_serialization_forced_alignement), with the JSON counted here: the same bytes.
TEST(SafetensorsWriter, ByteExactEmptyFile) {
  // "{}" is 2 bytes: 6 spaces make 8.
  EXPECT_EQ(as_string(SafetensorsWriter().serialize()), file_bytes("{}      ", ""));
  SafetensorsWriter w;
  w.set_metadata("framework", "pt");
  // {"__metadata__":{"framework":"pt"}} is 35 bytes: 5 spaces make 40.
  EXPECT_EQ(as_string(w.serialize()),
            file_bytes(R"({"__metadata__":{"framework":"pt"}})" + std::string(5, ' '), ""));
  EXPECT_EQ(w.serialize()[0], std::byte{40});
}

TEST(SafetensorsWriter, ByteExactSingleTensor) {
  const std::vector<float> v = {0, 1, 2, 3, 4, 5};
  SafetensorsWriter w;
  w.add("attn0", "F32", {1, 1, 2, 3}, as_bytes(v));
  // 65 bytes of JSON, 7 spaces: N = 72 = 0x48.
  const std::string header =
      R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" + std::string(7, ' ');
  ASSERT_EQ(header.size(), 72u);
  const std::string data(
      "\x00\x00\x00\x00\x00\x00\x80\x3f\x00\x00\x00\x40"
      "\x00\x00\x40\x40\x00\x00\x80\x40\x00\x00\xa0\x40",
      24);
  EXPECT_EQ(as_string(w.serialize()), file_bytes(header, data));
  EXPECT_EQ(as_string(w.serialize()).substr(0, 8), std::string("\x48\0\0\0\0\0\0\0", 8));
}

TEST(SafetensorsWriter, ByteExactInsertionOrderWithMetadata) {
  // Not sorted by name or dtype: the writer keeps the order it was given (the reference writer
  // sorts; a caller wanting its layout adds in its order, test_safetensors_fixture.cpp).
  SafetensorsWriter w;
  const std::vector<int64_t> b = {7};
  const std::vector<uint8_t> a = {1, 2, 3};
  w.add("b", "I64", {}, as_bytes(b));
  w.add("a", "U8", {3}, as_bytes(a));
  w.set_metadata("format", "pt");
  // 137 bytes of JSON, 7 spaces: 144.
  const std::string header = R"({"__metadata__":{"format":"pt"},)"
                             R"("b":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                             R"("a":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})" +
                             std::string(7, ' ');
  ASSERT_EQ(header.size(), 144u);
  EXPECT_EQ(w.header(), header);
  EXPECT_EQ(as_string(w.serialize()),
            file_bytes(header, std::string("\x07\0\0\0\0\0\0\0\x01\x02\x03", 11)));
}

TEST(SafetensorsWriter, RefusesInconsistentTensors) {
  SafetensorsWriter w;
  const std::vector<float> four = {1, 2, 3, 4};
  w.add("w", "F32", {2, 2}, as_bytes(four));
  EXPECT_ERROR_HAS(w.add("w", "F32", {4}, as_bytes(four)), "tensor 'w' added twice");
  EXPECT_ERROR_HAS(w.add("v", "F32", {2, 3}, as_bytes(four)),
                   "tensor 'v': 16 bytes given, but shape [2, 3] of F32 (4 bytes each) needs 24");
  EXPECT_ERROR_HAS(w.add("s", "F32", {}, as_bytes(four)),
                   "tensor 's': 16 bytes given, but shape [] of F32 (4 bytes each) needs 4");
  EXPECT_ERROR_HAS(w.add("v", "FP32", {4}, as_bytes(four)), "tensor 'v': unknown dtype 'FP32'");
  EXPECT_ERROR_HAS(w.add("v", "F32", {-1, -4}, as_bytes(four)),
                   "tensor 'v': shape [-1, -4] has the negative dimension -1 at index 0");
  EXPECT_ERROR_HAS(w.add("v", "U8", {int64_t{1} << 40, int64_t{1} << 40}, {}), "overflows 64 bits");
  EXPECT_ERROR_HAS(w.add("__metadata__", "F32", {4}, as_bytes(four)),
                   "a tensor cannot be named '__metadata__'");
  EXPECT_ERROR_HAS(w.add("bad\xff", "F32", {4}, as_bytes(four)),
                   "a tensor name is not valid UTF-8");
  EXPECT_ERROR_HAS(w.set_metadata("k", "bad\xc3"), "the value of metadata 'k' is not valid UTF-8");
  // The refused tensors left nothing behind.
  EXPECT_EQ(w.num_tensors(), 1u);
  EXPECT_EQ(w.serialize().size(), 8 + w.header().size() + 16);
}

}  // namespace
}  // namespace moecore::ckpt
