// The safetensors reader refuses every corruption a file can carry before it returns, each with
// a message that starts "[safetensors] ", names the file and says what is wrong with which
// tensor; and it reads what the format allows (any header order, empty tensors, extra keys).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/safetensors_file.h"
#include "ckpt_files.h"

namespace moecore::ckpt {
namespace {

using testing::TempDir;

// A file of the 8-byte length of `header` (or `length` when given), `header`, `data`.
std::filesystem::path make_file(const TempDir& dir, const std::string& header,
                                const std::string& data, int64_t length = -1) {
  const uint64_t n = length < 0 ? header.size() : static_cast<uint64_t>(length);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  const auto p = dir / "shard.safetensors";
  testing::write_text(p, out + header + data);
  return p;
}

// Opening `p` throws a moecore::Error starting "[safetensors] ", naming p, containing `phrase`.
void expect_refused(const std::filesystem::path& p, const std::string& phrase) {
  const std::string msg = testing::error_of([&] { SafetensorsFile f(p); });
  ASSERT_FALSE(msg.empty()) << "no error for " << p << " (expected '" << phrase << "')";
  EXPECT_EQ(msg.rfind("[safetensors] ", 0), 0u) << msg;
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find(phrase), std::string::npos) << msg;
}

const std::string kF32x4 = R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})";

TEST(SafetensorsFile, ReadsTensorsInOffsetOrderWhateverTheHeaderOrder) {
  TempDir dir;
  // b before a in the header, an extra key in an entry (the reference reader ignores unknown
  // keys too), an empty tensor between them, no padding: all valid.
  const auto p = make_file(dir,
                           R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6],"extra":1},)"
                           R"("z":{"dtype":"F64","shape":[0,5],"data_offsets":[4,4]},)"
                           R"("a":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}})",
                           std::string("\x01\x00\xfe\xff\x07\x08", 6));
  const SafetensorsFile f(p);
  EXPECT_EQ(f.path(), p.string());
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "z", "b"}));
  EXPECT_EQ(f.num_tensors(), 3u);
  EXPECT_EQ(f.info("b").offset, 4u);
  EXPECT_EQ(f.info("b").nbytes, 2u);
  EXPECT_EQ(f.info("z").shape, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(static_cast<uint8_t>(f.bytes("b")[1]), 8);
  EXPECT_EQ(f.bytes("z").size(), 0u);
  EXPECT_TRUE(f.metadata().empty());
}

TEST(SafetensorsFile, MissingNameSaysHowManyTensorsTheFileHas) {
  TempDir dir;
  const auto p = make_file(dir, R"({"w":)" + kF32x4 + "}", std::string(16, '\0'));
  const SafetensorsFile f(p);
  EXPECT_ERROR_HAS(f.info("v"), "[safetensors] '" + p.string() +
                                    "' has no tensor 'v' (the file has 1 tensors: 'w')");
  EXPECT_ERROR_HAS(f.bytes("v"), "has no tensor 'v'");
}

TEST(SafetensorsFile, RefusesAMissingFileOrADirectory) {
  TempDir dir;
  expect_refused(dir / "nope.safetensors", "No such file or directory");
  expect_refused(dir.path(), "is not a regular file");
}

TEST(SafetensorsFile, RefusesAFileShorterThan8Bytes) {
  TempDir dir;
  const auto p = dir / "short.safetensors";
  testing::write_text(p, std::string("{}\0\0\0", 5));
  expect_refused(p, "is 5 bytes, shorter than the 8-byte header length");
  testing::write_text(p, "");
  expect_refused(p, "is 0 bytes, shorter than the 8-byte header length");
}

TEST(SafetensorsFile, RefusesAHeaderLengthPastTheEndOfTheFile) {
  TempDir dir;
  expect_refused(make_file(dir, "{}", "", 1000),
                 "header length 1000 runs past the end of the file (10 bytes, so at most 2)");
  // A length near 2^64: no allocation of it, no overflow of 8 + n.
  expect_refused(make_file(dir, "{}", "", INT64_MAX),
                 "header length 9223372036854775807 runs past");
}

TEST(SafetensorsFile, RefusesAHeaderThatIsNotAJsonObject) {
  TempDir dir;
  expect_refused(make_file(dir, "[1, 2]", ""), "does not start with '{' (first byte 0x5b)");
  expect_refused(make_file(dir, "", ""), "does not start with '{' (it is empty)");
  expect_refused(make_file(dir, R"({"w":{"dtype":"F32",)", ""), "header is not valid JSON");
  expect_refused(make_file(dir, R"({"w":1} trailing)", ""), "header is not valid JSON");
}

TEST(SafetensorsFile, RefusesAnEntryMissingDtypeShapeOrOffsets) {
  TempDir dir;
  expect_refused(
      make_file(dir, R"({"w":{"shape":[4],"data_offsets":[0,16]}})", std::string(16, 'x')),
      "tensor 'w' has no \"dtype\"");
  expect_refused(
      make_file(dir, R"({"w":{"dtype":"F32","data_offsets":[0,16]}})", std::string(16, 'x')),
      "tensor 'w' has no \"shape\"");
  expect_refused(make_file(dir, R"({"w":{"dtype":"F32","shape":[4]}})", std::string(16, 'x')),
                 "tensor 'w' has no \"data_offsets\"");
  expect_refused(make_file(dir, R"({"w":[1,2]})", ""),
                 "tensor 'w' is a JSON array, expected an object");
  expect_refused(make_file(dir, R"({"w":{"dtype":4,"shape":[4],"data_offsets":[0,16]}})",
                           std::string(16, 'x')),
                 "tensor 'w': \"dtype\" is a JSON number, expected a string");
}

// DeepSeek-V3's released weights are F8_E4M3 codes (one byte each) beside F32 block scales: read
// as bytes like any byte-sized dtype (the converter decodes them).
TEST(SafetensorsFile, ReadsF8E4M3CodesAsBytes) {
  TempDir dir;
  const auto p = make_file(dir,
                           R"({"w":{"dtype":"F8_E4M3","shape":[2,3],"data_offsets":[4,10]},)"
                           R"("w_scale_inv":{"dtype":"F32","shape":[1,1],"data_offsets":[0,4]}})",
                           std::string("\x00\x00\x80\x3f\x38\x7e\x7f\x80\x01\xff", 10));
  const SafetensorsFile f(p);
  EXPECT_EQ(f.info("w").dtype, "F8_E4M3");
  EXPECT_EQ(f.info("w").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.info("w").nbytes, 6u);
  ASSERT_EQ(f.bytes("w").size(), 6u);
  EXPECT_EQ(static_cast<uint8_t>(f.bytes("w")[0]), 0x38);
  EXPECT_EQ(static_cast<uint8_t>(f.bytes("w")[5]), 0xff);
  EXPECT_EQ(f.info("w_scale_inv").dtype, "F32");
}

TEST(SafetensorsFile, RefusesAnUnknownDtype) {
  TempDir dir;
  expect_refused(make_file(dir, R"({"w":{"dtype":"F31","shape":[4],"data_offsets":[0,16]}})",
                           std::string(16, 'x')),
                 "tensor 'w': unknown dtype 'F31' (known: BOOL");
  expect_refused(make_file(dir, R"({"w":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}})",
                           std::string(2, 'x')),
                 "tensor 'w': unknown dtype 'F4'");
}

TEST(SafetensorsFile, RefusesNegativeOrNonIntegerDimensions) {
  TempDir dir;
  expect_refused(make_file(dir, R"({"w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]}})", ""),
                 "tensor 'w': shape [2,-1] has the negative dimension -1 at index 1");
  expect_refused(make_file(dir, R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})",
                           std::string(8, 'x')),
                 "tensor 'w': shape [2.5] has 2.5 at index 0, expected a non-negative integer");
  expect_refused(make_file(dir, R"({"w":{"dtype":"F32","shape":4,"data_offsets":[0,16]}})",
                           std::string(16, 'x')),
                 "tensor 'w': \"shape\" is a JSON number, expected an array");
  expect_refused(
      make_file(
          dir, R"({"w":{"dtype":"F64","shape":[4611686018427387904,8],"data_offsets":[0,0]}})", ""),
      "tensor 'w': shape [4611686018427387904, 8] x F64 (8 bytes each) overflows 64 bits");
}

TEST(SafetensorsFile, RefusesOffsetsThatDoNotMatchTheShape) {
  TempDir dir;
  expect_refused(make_file(dir, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})",
                           std::string(12, 'x')),
                 "tensor 'w': data_offsets [0, 12] hold 12 bytes, but shape [2, 2] of F32 "
                 "(4 bytes each) needs 16");
  expect_refused(
      make_file(dir, R"({"w":{"dtype":"BF16","shape":[],"data_offsets":[0,0]}})", ""),
      "tensor 'w': data_offsets [0, 0] hold 0 bytes, but shape [] of BF16 (2 bytes each) needs 2");
  expect_refused(make_file(dir, R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", ""),
                 "tensor 'w': data_offsets [8, 4] end before they begin");
  expect_refused(
      make_file(dir, R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[-1,3]}})", ""),
      "tensor 'w': data_offsets is [-1,3], expected [begin, end], two non-negative integers");
  expect_refused(make_file(dir, R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4,8]}})", ""),
                 "tensor 'w': data_offsets is [0,4,8], expected [begin, end]");
}

TEST(SafetensorsFile, RefusesOffsetsOutsideTheDataBlock) {
  TempDir dir;
  // A truncated shard: the header promises 16 bytes, 12 are there.
  expect_refused(make_file(dir, R"({"w":)" + kF32x4 + "}", std::string(12, 'x')),
                 "tensor 'w': data_offsets [0, 16] run past the end of the 12-byte data block, "
                 "by 4 bytes");
  expect_refused(make_file(dir, R"({"e":{"dtype":"U8","shape":[0],"data_offsets":[5,5]}})",
                           std::string(4, 'x')),
                 "tensor 'e': data_offsets [5, 5] run past the end of the 4-byte data block");
}

TEST(SafetensorsFile, RefusesOverlappingTensors) {
  TempDir dir;
  expect_refused(make_file(dir,
                           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           std::string(12, 'x')),
                 "tensor 'b' data_offsets [4, 12] overlap tensor 'a' [0, 8] by 4 bytes");
  // The same range twice.
  expect_refused(make_file(dir,
                           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
                           std::string(8, 'x')),
                 "tensor 'b' data_offsets [0, 8] overlap tensor 'a' [0, 8] by 8 bytes");
  // An empty tensor inside another one.
  expect_refused(make_file(dir,
                           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                           std::string(8, 'x')),
                 "tensor 'e' data_offsets [4, 4] overlap tensor 'a' [0, 8]");
}

TEST(SafetensorsFile, RefusesGapsBetweenTensors) {
  TempDir dir;
  expect_refused(make_file(dir,
                           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                           std::string(12, 'x')),
                 "gap: bytes [4, 8) of the data block belong to no tensor: tensor 'b' begins at "
                 "8, expected 4 (where 'a' ends)");
  expect_refused(make_file(dir, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                           std::string(8, 'x')),
                 "gap: bytes [0, 4) of the data block belong to no tensor: tensor 'a' begins at "
                 "4, expected 0 (the start of the data block)");
}

TEST(SafetensorsFile, RefusesTrailingBytesAfterTheLastTensor) {
  TempDir dir;
  expect_refused(make_file(dir, R"({"w":)" + kF32x4 + "}", std::string(18, 'x')),
                 "trailing bytes: the data block is 18 bytes but its tensors end at 16: 2 bytes "
                 "belong to no tensor");
  expect_refused(make_file(dir, "{}", "x"),
                 "trailing bytes: the data block is 1 bytes but its tensors end at 0");
}

TEST(SafetensorsFile, RefusesADuplicateTensorName) {
  TempDir dir;
  expect_refused(make_file(dir,
                           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                           std::string(8, 'x')),
                 "tensor 'a' appears twice in the header");
}

TEST(SafetensorsFile, RefusesMetadataThatIsNotStringToString) {
  TempDir dir;
  expect_refused(make_file(dir, R"({"__metadata__":{"format":"pt","step":100}})", ""),
                 "\"__metadata__\" entry 'step' is a JSON number, expected a string");
  expect_refused(make_file(dir, R"({"__metadata__":["pt"]})", ""),
                 "\"__metadata__\" is a JSON array, expected an object of strings");
}

}  // namespace
}  // namespace moecore::ckpt
