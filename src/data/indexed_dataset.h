// Megatron's indexed dataset: a .bin of token ids back to back and a .idx that says where each
// sequence starts and which sequences make a document. The .idx layout (version 1,
// little-endian):
//   "MMIDIDX\0\0"  u64 version = 1  u8 dtype code  u64 sequence_count  u64 document_count
//   i32 sequence_lengths[sequence_count]   (tokens)
//   i64 sequence_pointers[sequence_count]  (byte offsets into the .bin)
//   i64 document_indices[document_count]   (0, then the sequence index that ends each document)
//   [i8 sequence_modes[sequence_count]]    (multimodal datasets only)
// The reader maps both files and checks everything a corrupt or mismatched pair could break
// before anything reads a token; the builder writes what Megatron's IndexedDatasetBuilder
// writes, byte for byte.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "data/low_level_dataset.h"
#include "data/mapped_file.h"

namespace moecore::data {

// Megatron's DType codes.
enum class TokenDType : uint8_t {
  UInt8 = 1,
  Int8 = 2,
  Int16 = 3,
  Int32 = 4,
  Int64 = 5,
  Float64 = 6,
  Float32 = 7,
  UInt16 = 8,
};

bool is_valid_dtype_code(int code);
int64_t dtype_size(TokenDType t);
const char* dtype_name(TokenDType t);
// Megatron's DType.optimal_dtype: uint16 for a vocabulary under 65500 tokens, else int32.
TokenDType optimal_dtype(int64_t vocab_size);

inline constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
inline constexpr size_t kIndexHeaderBytes = 34;

// A validated .idx image (views into the caller's bytes; arrays may be unaligned, so they are
// read through the accessors).
struct IndexView {
  TokenDType dtype = TokenDType::Int32;
  int64_t sequence_count = 0;
  int64_t document_count = 0;  // entries of document_indices = documents + 1
  bool has_modes = false;
  const uint8_t* lengths = nullptr;   // i32[sequence_count]
  const uint8_t* pointers = nullptr;  // i64[sequence_count]
  const uint8_t* documents = nullptr; // i64[document_count]

  int32_t sequence_length(int64_t i) const;
  int64_t sequence_pointer(int64_t i) const;
  int64_t document_index(int64_t i) const;
};

// Parses and validates a .idx image: magic, version, dtype code, the counts against the file
// size, lengths >= 0, pointers increasing without overlap, document indices starting at 0,
// non-decreasing and ending at sequence_count, and (bin_bytes >= 0) every sequence inside a
// .bin of bin_bytes bytes. Throws moecore::Error naming `what` (the path) and the fault.
IndexView parse_index(const uint8_t* data, size_t size, const std::string& what,
                      int64_t bin_bytes);

class IndexedDataset final : public LowLevelDataset {
 public:
  // prefix: the path without ".idx" / ".bin".
  explicit IndexedDataset(const std::string& prefix);

  const std::string& name() const override { return prefix_; }
  const std::string& prefix() const { return prefix_; }
  TokenDType dtype() const { return index_.dtype; }
  int64_t num_sequences() const override { return index_.sequence_count; }
  int64_t num_documents() const { return index_.document_count - 1; }
  int32_t sequence_length(int64_t i) const override { return index_.sequence_length(i); }
  int64_t sequence_pointer(int64_t i) const { return index_.sequence_pointer(i); }
  // i in [0, num_documents()]: the sequence index where document i starts (i = num: the end).
  int64_t document_index(int64_t i) const { return index_.document_index(i); }
  std::vector<int32_t> sequence_lengths() const override;
  int64_t num_tokens() const override;
  // Writes tokens [offset, offset + length) of sequence `seq` to out as int32; a token that is
  // not an integer in [0, 2^31) is an error naming the dataset and the position.
  void get(int64_t seq, int64_t offset, int64_t length, int32_t* out) const override;

 private:
  std::string prefix_;
  std::unique_ptr<MappedFile> idx_, bin_;
  IndexView index_;
};

// Megatron's IndexedDatasetBuilder: tokens go to the .bin as they come, the index is written by
// finalize(). Documents made of one item each (add_document with one length) is what
// tools/preprocess_data.py writes without --split-sentences.
class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(const std::string& bin_path, TokenDType dtype);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  // One sequence (Megatron's add_item); end_document() closes the document.
  void add_item(std::span<const int64_t> tokens);
  void end_document();
  // A whole document: its tokens and the lengths of its sequences (summing to tokens.size()).
  void add_document(std::span<const int64_t> tokens, std::span<const int32_t> lengths);
  void finalize(const std::string& idx_path);
  int64_t tokens_written() const { return tokens_written_; }

 private:
  void write_tokens(std::span<const int64_t> tokens);

  std::string bin_path_;
  TokenDType dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> documents_{0};
  std::vector<uint8_t> buffer_;
  int64_t tokens_written_ = 0;
};

}  // namespace moecore::data
