// Megatron's indexed dataset: what the builder writes reads back exactly (every dtype,
// multi-sequence and empty documents), the files are Megatron's layout byte for byte, and
// every corruption a file can carry, and every path that cannot serve, is a clear error naming
// the path before a token is read.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/check.h"
#include "data/data_pipeline.h"
#include "data/indexed_dataset.h"

namespace moecore::data {
namespace {

std::string temp_prefix(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          (name + "." + std::to_string(::getpid()) + "." +
           ::testing::UnitTest::GetInstance()->current_test_info()->name()))
      .string();
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

using testing::error_of;

#define EXPECT_ERROR_HAS(stmt, needle)                                        \
  do {                                                                        \
    const std::string msg = error_of([&] { stmt; });                          \
    EXPECT_NE(msg.find(needle), std::string::npos) << "error: '" << msg << "'"; \
  } while (0)

// Documents: {0..4} as two sequences, an empty document, {5..9} as one, a zero-length sequence
// document, then one of 3 tokens; token value = 7 * position + 3 (mod 100) so positions show.
struct Written {
  std::string prefix;
  std::vector<std::vector<int64_t>> sequences;
};

Written write_sample(TokenDType dt, const std::string& name) {
  Written w{temp_prefix(name), {}};
  IndexedDatasetBuilder b(w.prefix + ".bin", dt);
  auto tok = [](int64_t i) { return (7 * i + 3) % 100; };
  std::vector<int64_t> doc;
  for (int i = 0; i < 5; ++i) doc.push_back(tok(i));
  const std::vector<int32_t> lens = {2, 3};
  b.add_document(doc, lens);
  w.sequences.push_back({doc[0], doc[1]});
  w.sequences.push_back({doc[2], doc[3], doc[4]});
  b.add_document({}, {});  // an empty document: no sequences
  std::vector<int64_t> d2;
  for (int i = 5; i < 10; ++i) d2.push_back(tok(i));
  b.add_item(d2);
  b.end_document();
  w.sequences.push_back(d2);
  b.add_item({});
  b.end_document();
  w.sequences.push_back({});
  const std::vector<int64_t> d3 = {99, 0, 42};
  b.add_document(d3, std::vector<int32_t>{3});
  w.sequences.push_back(d3);
  b.finalize(w.prefix + ".idx");
  return w;
}

TEST(IndexedDataset, WriteThenReadEveryDtype) {
  for (TokenDType dt : {TokenDType::UInt8, TokenDType::Int8, TokenDType::Int16,
                        TokenDType::Int32, TokenDType::Int64, TokenDType::Float64,
                        TokenDType::Float32, TokenDType::UInt16}) {
    SCOPED_TRACE(dtype_name(dt));
    Written w = write_sample(dt, std::string("moecore_idx_") + dtype_name(dt));
    IndexedDataset ds(w.prefix);
    EXPECT_EQ(ds.dtype(), dt);
    ASSERT_EQ(ds.num_sequences(), 5);
    EXPECT_EQ(ds.num_documents(), 5);
    const std::vector<int64_t> doc_idx = {0, 2, 2, 3, 4, 5};
    for (int d = 0; d <= 5; ++d) EXPECT_EQ(ds.document_index(d), doc_idx[d]) << d;
    int64_t ptr = 0;
    for (int64_t s = 0; s < 5; ++s) {
      ASSERT_EQ(ds.sequence_length(s), static_cast<int32_t>(w.sequences[s].size()));
      EXPECT_EQ(ds.sequence_pointer(s), ptr);
      ptr += ds.sequence_length(s) * dtype_size(dt);
      std::vector<int32_t> got(w.sequences[s].size());
      ds.get(s, 0, ds.sequence_length(s), got.data());
      for (size_t t = 0; t < got.size(); ++t) EXPECT_EQ(got[t], w.sequences[s][t]) << s << "," << t;
    }
    std::vector<int32_t> part(2);
    ds.get(1, 1, 2, part.data());  // an offset inside a sequence
    EXPECT_EQ(part[0], w.sequences[1][1]);
    EXPECT_EQ(part[1], w.sequences[1][2]);
    EXPECT_EQ(ds.num_tokens(), 13);
    EXPECT_EQ(static_cast<int64_t>(read_bytes(w.prefix + ".bin").size()), 13 * dtype_size(dt));
    std::remove((w.prefix + ".bin").c_str());
    std::remove((w.prefix + ".idx").c_str());
  }
}

// The .idx layout field by field (Megatron's _IndexWriter).
TEST(IndexedDataset, IndexBytesAreMegatronsLayout) {
  Written w = write_sample(TokenDType::UInt16, "moecore_idx_layout");
  const std::vector<uint8_t> b = read_bytes(w.prefix + ".idx");
  ASSERT_EQ(b.size(), 34u + 5 * 4 + 5 * 8 + 6 * 8);
  EXPECT_EQ(0, std::memcmp(b.data(), "MMIDIDX\0\0", 9));
  uint64_t version, sc, dc;
  std::memcpy(&version, b.data() + 9, 8);
  std::memcpy(&sc, b.data() + 18, 8);
  std::memcpy(&dc, b.data() + 26, 8);
  EXPECT_EQ(version, 1u);
  EXPECT_EQ(b[17], 8);  // uint16
  EXPECT_EQ(sc, 5u);
  EXPECT_EQ(dc, 6u);
  int32_t len1;
  int64_t ptr1, last_doc;
  std::memcpy(&len1, b.data() + 34 + 4, 4);
  std::memcpy(&ptr1, b.data() + 34 + 20 + 8, 8);
  std::memcpy(&last_doc, b.data() + 34 + 20 + 40 + 5 * 8, 8);
  EXPECT_EQ(len1, 3);
  EXPECT_EQ(ptr1, 4);  // 2 tokens * 2 bytes
  EXPECT_EQ(last_doc, 5);
  std::remove((w.prefix + ".bin").c_str());
  std::remove((w.prefix + ".idx").c_str());
}

TEST(IndexedDataset, CorruptIndexFilesAreClearErrors) {
  Written w = write_sample(TokenDType::Int32, "moecore_idx_corrupt");
  const std::string idx = w.prefix + ".idx";
  const std::vector<uint8_t> good = read_bytes(idx);
  auto with = [&](auto edit) {
    std::vector<uint8_t> b = good;
    edit(b);
    write_bytes(idx, b);
  };
  auto put64 = [](std::vector<uint8_t>& b, size_t at, int64_t v) { std::memcpy(b.data() + at, &v, 8); };
  auto put32 = [](std::vector<uint8_t>& b, size_t at, int32_t v) { std::memcpy(b.data() + at, &v, 4); };
  const size_t lens = 34, ptrs = 34 + 5 * 4, docs = ptrs + 5 * 8;

  with([](auto& b) { b[0] = 'X'; });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "does not start with Megatron's index magic");
  with([&](auto& b) { put64(b, 9, 2); });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "index version 2");
  with([](auto& b) { b[17] = 9; });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "dtype code 9");
  with([](auto& b) { b.resize(20); });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "fewer than the 34-byte header");
  with([](auto& b) { b.resize(b.size() - 3); });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "truncated or its counts are inconsistent");
  with([&](auto& b) { put64(b, 18, 6); });  // sequence count + 1
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "counts are inconsistent");
  with([&](auto& b) { put64(b, 18, int64_t{1} << 60); });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "more than its");
  with([&](auto& b) { put64(b, docs, 1); });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "document_indices[0] = 1, must be 0");
  with([&](auto& b) { put64(b, docs + 16, 1); });  // 0, 2, 1: decreasing
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "must be non-decreasing");
  with([&](auto& b) { put64(b, docs + 40, 4); });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "documents do not cover every sequence");
  with([&](auto& b) { put32(b, lens + 4, -1); });
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "sequence 1 has length -1");
  with([&](auto& b) { put64(b, ptrs + 16, 0); });  // sequence 2 overlaps sequence 1
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "pointers must increase");
  with([&](auto& b) { put32(b, lens + 16, 100); });  // the last sequence runs past the .bin
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "the .bin is truncated");
  // A truncated .bin with a good index.
  write_bytes(idx, good);
  std::vector<uint8_t> bin = read_bytes(w.prefix + ".bin");
  bin.resize(bin.size() - 4);
  write_bytes(w.prefix + ".bin", bin);
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "the .bin is truncated");
  // Every message names the file.
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), idx);
  std::remove((w.prefix + ".bin").c_str());
  EXPECT_ERROR_HAS(IndexedDataset ds(w.prefix), "the data file '" + w.prefix + ".bin' beside its index does not exist");
  std::remove(idx.c_str());
}

TEST(IndexedDataset, TokensOutsideTheIdRangeAreErrors) {
  const std::string p = temp_prefix("moecore_idx_negative");
  {
    IndexedDatasetBuilder b(p + ".bin", TokenDType::Int32);
    b.add_document(std::vector<int64_t>{1, -5, 3}, std::vector<int32_t>{3});
    b.finalize(p + ".idx");
  }
  IndexedDataset ds(p);
  std::vector<int32_t> t(3);
  EXPECT_ERROR_HAS(ds.get(0, 0, 3, t.data()), "token 1 of sequence 0 is -5");
  IndexedDatasetBuilder b(p + ".bin", TokenDType::UInt16);
  EXPECT_ERROR_HAS(b.add_item(std::vector<int64_t>{70000}), "does not fit the dtype");
  std::remove((p + ".bin").c_str());
  std::remove((p + ".idx").c_str());
}

// Every --data-path that cannot serve names the path and why.
TEST(DataPath, PathsThatCannotServeAreClearErrors) {
  const std::string dir = temp_prefix("moecore_dir");
  std::filesystem::create_directories(dir);
  EXPECT_ERROR_HAS(classify_data_path(dir), "'" + dir + "' is a directory");
  EXPECT_ERROR_HAS(classify_data_path("/nonexistent/corpus"), "'/nonexistent/corpus' does not exist");
  EXPECT_ERROR_HAS(classify_data_path("/dev/null"), "'/dev/null' is not a regular file");
  const std::string empty = temp_prefix("moecore_empty") + ".txt";
  std::ofstream(empty).close();
  EXPECT_ERROR_HAS(classify_data_path(empty), "is empty");
  // A prefix whose .idx is a directory, a .bin without its .idx, a path given with its extension.
  const std::string p = temp_prefix("moecore_pair");
  std::filesystem::create_directories(p + ".idx");
  std::ofstream(p + ".bin") << "xx";
  EXPECT_ERROR_HAS(IndexedDataset ds(p), "'" + p + ".idx' is a directory");
  std::filesystem::remove(p + ".idx");
  EXPECT_ERROR_HAS(classify_data_path(p), "exists but its index '" + p + ".idx' does not");
  EXPECT_ERROR_HAS(classify_data_path(p + ".bin"), "give the prefix without the extension");
  // An empty .idx.
  std::ofstream(p + ".idx").close();
  EXPECT_ERROR_HAS(IndexedDataset ds(p), "'" + p + ".idx' is empty");
  if (::geteuid() != 0) {  // root reads anything
    std::ofstream(p + ".idx") << "MMIDIDX";
    ::chmod((p + ".idx").c_str(), 0);
    EXPECT_ERROR_HAS(IndexedDataset ds(p), "is not readable");
  }
  std::filesystem::remove_all(dir);
  std::filesystem::remove(p + ".idx");
  std::filesystem::remove(p + ".bin");
  std::filesystem::remove(empty);
}

}  // namespace
}  // namespace moecore::data
