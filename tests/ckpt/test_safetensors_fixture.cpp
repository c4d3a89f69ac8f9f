// A file laid out as the reference library writes it (tests/fixtures/ckpt/
// reference_layout.safetensors, built byte by byte from the published format by
// tools/make_safetensors_fixture.py): the reader gets every tensor and value, and the writer,
// given the tensors in the reference writer's order, writes the same bytes.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/safetensors_file.h"
#include "ckpt/safetensors_writer.h"
#include "ckpt_files.h"
#include "common/paths.h"

namespace moecore::ckpt {
namespace {

const std::string kFixture =
    ::moecore::testing::source_dir() + "/tests/fixtures/ckpt/reference_layout.safetensors";

template <typename T>
std::vector<T> values(const SafetensorsFile& f, const std::string& name) {
  const auto b = f.bytes(name);
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), b.size());  // the bytes need not be aligned
  return v;
}

TEST(SafetensorsFixture, ReadsTheReferenceLayout) {
  const SafetensorsFile f(kFixture);
  // The reference writer's order: dtype alignment, largest first, then name.
  EXPECT_EQ(f.names(), (std::vector<std::string>{"step", "empty", "model.embed.weight", "tokens",
                                                 "model.norm.weight", "mask"}));
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));

  EXPECT_EQ(f.info("step").dtype, "I64");
  EXPECT_EQ(f.info("step").shape, std::vector<int64_t>{});
  EXPECT_EQ(values<int64_t>(f, "step"), std::vector<int64_t>{100});

  EXPECT_EQ(f.info("empty").shape, std::vector<int64_t>{0});
  EXPECT_EQ(f.info("empty").offset, 8u);
  EXPECT_EQ(f.info("empty").nbytes, 0u);

  EXPECT_EQ(f.info("model.embed.weight").dtype, "F32");
  EXPECT_EQ(f.info("model.embed.weight").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.info("model.embed.weight").offset, 8u);
  EXPECT_EQ(values<float>(f, "model.embed.weight"),
            (std::vector<float>{-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.5f}));

  EXPECT_EQ(f.info("tokens").dtype, "I32");
  EXPECT_EQ(values<int32_t>(f, "tokens"), (std::vector<int32_t>{1, -2, 3, 70000}));

  EXPECT_EQ(f.info("model.norm.weight").dtype, "BF16");
  EXPECT_EQ(values<uint16_t>(f, "model.norm.weight"),
            (std::vector<uint16_t>{0x3F80, 0xC000, 0x3F00}));  // 1, -2, 0.5

  EXPECT_EQ(f.info("mask").dtype, "BOOL");
  EXPECT_EQ(f.info("mask").offset, 54u);
  EXPECT_EQ(values<uint8_t>(f, "mask"), (std::vector<uint8_t>{1, 0, 1, 1}));
}

TEST(SafetensorsFixture, WriterReproducesTheReferenceBytes) {
  const SafetensorsFile f(kFixture);
  SafetensorsWriter w;
  for (const std::string& name : f.names()) {
    const TensorInfo& t = f.info(name);
    w.add(name, t.dtype, t.shape, f.bytes(name));
  }
  for (const auto& [k, v] : f.metadata()) w.set_metadata(k, v);
  EXPECT_EQ(w.serialize(), testing::read_bytes(kFixture));
}

}  // namespace
}  // namespace moecore::ckpt
