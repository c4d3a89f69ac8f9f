#include "data/indexed_dataset.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/check.h"

namespace moecore::data {

namespace {

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the arrays of a .idx are not aligned (header of 34 bytes)
  return v;
}

template <typename T>
void store(std::vector<uint8_t>& out, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.insert(out.end(), b, b + sizeof(T));
}

}  // namespace

bool is_valid_dtype_code(int code) { return code >= 1 && code <= 8; }

int64_t dtype_size(TokenDType t) {
  switch (t) {
    case TokenDType::UInt8:
    case TokenDType::Int8: return 1;
    case TokenDType::Int16:
    case TokenDType::UInt16: return 2;
    case TokenDType::Int32:
    case TokenDType::Float32: return 4;
    case TokenDType::Int64:
    case TokenDType::Float64: return 8;
  }
  MOE_FAIL("[data] unknown dtype code {}", static_cast<int>(t));
}

const char* dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::UInt8: return "uint8";
    case TokenDType::Int8: return "int8";
    case TokenDType::Int16: return "int16";
    case TokenDType::Int32: return "int32";
    case TokenDType::Int64: return "int64";
    case TokenDType::Float64: return "float64";
    case TokenDType::Float32: return "float32";
    case TokenDType::UInt16: return "uint16";
  }
  return "?";
}

TokenDType optimal_dtype(int64_t vocab_size) {
  return vocab_size < 65500 ? TokenDType::UInt16 : TokenDType::Int32;
}

int32_t IndexView::sequence_length(int64_t i) const { return load<int32_t>(lengths + 4 * i); }
int64_t IndexView::sequence_pointer(int64_t i) const { return load<int64_t>(pointers + 8 * i); }
int64_t IndexView::document_index(int64_t i) const { return load<int64_t>(documents + 8 * i); }

IndexView parse_index(const uint8_t* data, size_t size, const std::string& what,
                      int64_t bin_bytes) {
  MOE_CHECK(size >= kIndexHeaderBytes,
            "[data] {} has {} bytes, fewer than the {}-byte header of a Megatron .idx: the file "
            "is truncated or not an index",
            what, size, kIndexHeaderBytes);
  MOE_CHECK(std::memcmp(data, kIndexMagic, sizeof(kIndexMagic)) == 0,
            "[data] {} does not start with Megatron's index magic \"MMIDIDX\\0\\0\": not a .idx "
            "file of an indexed dataset (make one with `moecore preprocess`)",
            what);
  const uint64_t version = load<uint64_t>(data + 9);
  MOE_CHECK(version == 1, "[data] {} has index version {}; only version 1 is known", what,
            version);
  const int code = data[17];
  MOE_CHECK(is_valid_dtype_code(code),
            "[data] {} has dtype code {}; Megatron's codes are 1 (uint8) to 8 (uint16)", what,
            code);
  IndexView v;
  v.dtype = static_cast<TokenDType>(code);
  const uint64_t sc = load<uint64_t>(data + 18), dc = load<uint64_t>(data + 26);
  const uint64_t body = size - kIndexHeaderBytes;
  // Bound the counts by the file size before multiplying (no overflow below).
  MOE_CHECK(sc <= body / 12 && dc <= body / 8,
            "[data] {} claims {} sequences and {} documents, more than its {} bytes can hold: the "
            "file is truncated or corrupt",
            what, sc, dc, size);
  const uint64_t expected = 12 * sc + 8 * dc;
  MOE_CHECK(body == expected || body == expected + sc,
            "[data] {} has {} bytes after the header; {} sequences and {} document indices need "
            "{} (or {} with sequence modes): the file is truncated or its counts are inconsistent",
            what, body, sc, dc, expected, expected + sc);
  MOE_CHECK(dc >= 1,
            "[data] {} has no document indices (a valid index has at least the leading 0)", what);
  v.sequence_count = static_cast<int64_t>(sc);
  v.document_count = static_cast<int64_t>(dc);
  v.has_modes = body != expected;
  v.lengths = data + kIndexHeaderBytes;
  v.pointers = v.lengths + 4 * sc;
  v.documents = v.pointers + 8 * sc;

  MOE_CHECK(v.document_index(0) == 0, "[data] {}: document_indices[0] = {}, must be 0", what,
            v.document_index(0));
  for (int64_t d = 1; d < v.document_count; ++d) {
    const int64_t a = v.document_index(d - 1), b = v.document_index(d);
    MOE_CHECK(b >= a && b <= v.sequence_count,
              "[data] {}: document_indices[{}] = {} after {} (must be non-decreasing and <= the "
              "sequence count {})",
              what, d, b, a, v.sequence_count);
  }
  MOE_CHECK(v.document_index(v.document_count - 1) == v.sequence_count,
            "[data] {}: the last document index is {}, not the sequence count {}: documents do "
            "not cover every sequence",
            what, v.document_index(v.document_count - 1), v.sequence_count);

  const int64_t item = dtype_size(v.dtype);
  int64_t end = 0;  // where the previous sequence ends in the .bin
  for (int64_t i = 0; i < v.sequence_count; ++i) {
    const int32_t len = v.sequence_length(i);
    const int64_t ptr = v.sequence_pointer(i);
    MOE_CHECK(len >= 0, "[data] {}: sequence {} has length {}", what, i, len);
    MOE_CHECK(ptr >= end,
              "[data] {}: sequence {} starts at byte {}, before the end of sequence {} (byte {}): "
              "pointers must increase",
              what, i, ptr, i - 1, end);
    MOE_CHECK(ptr <= std::numeric_limits<int64_t>::max() - int64_t{len} * item,
              "[data] {}: sequence {} pointer {} overflows", what, i, ptr);
    end = ptr + int64_t{len} * item;
    MOE_CHECK(bin_bytes < 0 || end <= bin_bytes,
              "[data] {}: sequence {} ends at byte {} but the .bin has {} bytes: the .bin is "
              "truncated or belongs to another index",
              what, i, end, bin_bytes);
  }
  return v;
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  const std::string what = fmt::format("--data-path prefix '{}':", prefix);
  idx_ = std::make_unique<MappedFile>(idx, what + " index");
  const std::string bin_why = unreadable_reason(bin);
  MOE_CHECK(bin_why.empty() || bin_why == "is empty",
            "[data] --data-path prefix '{}': the data file '{}' beside its index {}", prefix, bin,
            bin_why);
  int64_t bin_bytes = 0;
  if (bin_why.empty()) {
    bin_ = std::make_unique<MappedFile>(bin, what + " data");
    bin_bytes = static_cast<int64_t>(bin_->size());
  }
  index_ = parse_index(idx_->data(), idx_->size(), "'" + idx + "'", bin_bytes);
}

std::vector<int32_t> IndexedDataset::sequence_lengths() const {
  std::vector<int32_t> out(index_.sequence_count);
  if (!out.empty()) std::memcpy(out.data(), index_.lengths, out.size() * sizeof(int32_t));
  return out;
}

int64_t IndexedDataset::num_tokens() const {
  int64_t n = 0;
  for (int64_t i = 0; i < index_.sequence_count; ++i) n += index_.sequence_length(i);
  return n;
}

namespace {

template <typename T>
void convert(const uint8_t* p, int64_t n, int32_t* out, const std::string& prefix, int64_t seq,
             int64_t offset) {
  for (int64_t t = 0; t < n; ++t) {
    const T v = load<T>(p + t * sizeof(T));
    bool ok;
    if constexpr (std::is_floating_point_v<T>) {
      ok = v >= 0 && v < 2147483648.0 && std::floor(v) == v;
    } else if constexpr (std::is_signed_v<T>) {
      ok = v >= 0 && static_cast<int64_t>(v) <= std::numeric_limits<int32_t>::max();
    } else {
      ok = static_cast<uint64_t>(v) <= static_cast<uint64_t>(std::numeric_limits<int32_t>::max());
    }
    MOE_CHECK(ok, "[data] '{}.bin': token {} of sequence {} is {}, not a token id in [0, 2^31)",
              prefix, offset + t, seq, static_cast<double>(v));
    out[t] = static_cast<int32_t>(v);
  }
}

}  // namespace

void IndexedDataset::get(int64_t seq, int64_t offset, int64_t length, int32_t* out) const {
  MOE_CHECK(seq >= 0 && seq < num_sequences(), "[data] '{}': sequence {} of {}", prefix_, seq,
            num_sequences());
  const int64_t len = sequence_length(seq);
  MOE_CHECK(offset >= 0 && length >= 0 && offset + length <= len,
            "[data] '{}': tokens [{}, {}) of sequence {} of length {}", prefix_, offset,
            offset + length, seq, len);
  if (length == 0) return;
  const uint8_t* p = bin_->data() + sequence_pointer(seq) + offset * dtype_size(dtype());
  switch (dtype()) {
    case TokenDType::UInt8: return convert<uint8_t>(p, length, out, prefix_, seq, offset);
    case TokenDType::Int8: return convert<int8_t>(p, length, out, prefix_, seq, offset);
    case TokenDType::Int16: return convert<int16_t>(p, length, out, prefix_, seq, offset);
    case TokenDType::UInt16: return convert<uint16_t>(p, length, out, prefix_, seq, offset);
    case TokenDType::Int32: return convert<int32_t>(p, length, out, prefix_, seq, offset);
    case TokenDType::Int64: return convert<int64_t>(p, length, out, prefix_, seq, offset);
    case TokenDType::Float32: return convert<float>(p, length, out, prefix_, seq, offset);
    case TokenDType::Float64: return convert<double>(p, length, out, prefix_, seq, offset);
  }
}

namespace {

std::string temp_of(const std::string& path) {
  return path + ".tmp." + std::to_string(::getpid());
}

// fflush + fsync + fclose; false (errno set) when any fails.
bool close_durably(std::FILE* f) {
  const bool ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  return std::fclose(f) == 0 && ok;
}

}  // namespace

IndexedDatasetBuilder::IndexedDatasetBuilder(const std::string& bin_path, TokenDType dtype)
    : bin_path_(bin_path), dtype_(dtype) {
  bin_ = std::fopen(temp_of(bin_path).c_str(), "wb");
  MOE_CHECK(bin_ != nullptr, "[data] cannot write '{}': {}", bin_path, std::strerror(errno));
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  // Not finalized (an error stopped the run): no partial output is left under the real names.
  if (bin_ != nullptr) {
    std::fclose(bin_);
    std::remove(temp_of(bin_path_).c_str());
  }
}

namespace {

template <typename T>
void append_checked(std::vector<uint8_t>& out, int64_t v, const std::string& path) {
  if constexpr (std::is_integral_v<T>) {
    MOE_CHECK(v >= std::numeric_limits<T>::min() && v <= std::numeric_limits<T>::max(),
              "[data] token id {} does not fit the dtype of '{}' ({} bytes)", v, path, sizeof(T));
  }
  store<T>(out, static_cast<T>(v));
}

}  // namespace

void IndexedDatasetBuilder::write_tokens(std::span<const int64_t> tokens) {
  buffer_.clear();
  buffer_.reserve(tokens.size() * dtype_size(dtype_));
  for (int64_t v : tokens) {
    switch (dtype_) {
      case TokenDType::UInt8: append_checked<uint8_t>(buffer_, v, bin_path_); break;
      case TokenDType::Int8: append_checked<int8_t>(buffer_, v, bin_path_); break;
      case TokenDType::Int16: append_checked<int16_t>(buffer_, v, bin_path_); break;
      case TokenDType::UInt16: append_checked<uint16_t>(buffer_, v, bin_path_); break;
      case TokenDType::Int32: append_checked<int32_t>(buffer_, v, bin_path_); break;
      case TokenDType::Int64: append_checked<int64_t>(buffer_, v, bin_path_); break;
      case TokenDType::Float32: append_checked<float>(buffer_, v, bin_path_); break;
      case TokenDType::Float64: append_checked<double>(buffer_, v, bin_path_); break;
    }
  }
  MOE_CHECK(buffer_.empty() || std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) == buffer_.size(),
            "[data] writing '{}' failed: {}", bin_path_, std::strerror(errno));
  tokens_written_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetBuilder::add_item(std::span<const int64_t> tokens) {
  MOE_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
            "[data] a sequence of {} tokens does not fit the index's int32 lengths", tokens.size());
  write_tokens(tokens);
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
}

void IndexedDatasetBuilder::end_document() {
  documents_.push_back(static_cast<int64_t>(lengths_.size()));
}

void IndexedDatasetBuilder::add_document(std::span<const int64_t> tokens,
                                         std::span<const int32_t> lengths) {
  int64_t sum = 0;
  for (int32_t l : lengths) sum += l;
  MOE_CHECK(sum == static_cast<int64_t>(tokens.size()),
            "[data] add_document: lengths sum to {} but the document has {} tokens", sum,
            tokens.size());
  write_tokens(tokens);
  lengths_.insert(lengths_.end(), lengths.begin(), lengths.end());
  end_document();
}

void IndexedDatasetBuilder::finalize(const std::string& idx_path) {
  MOE_CHECK(bin_ != nullptr, "[data] '{}' finalized twice", bin_path_);
  const std::string bin_tmp = temp_of(bin_path_), idx_tmp = temp_of(idx_path);
  const bool closed = close_durably(bin_);
  bin_ = nullptr;
  if (!closed) {
    const int err = errno;
    std::remove(bin_tmp.c_str());
    MOE_FAIL("[data] writing '{}' failed: {}", bin_path_, std::strerror(err));
  }
  std::vector<uint8_t> out;
  out.insert(out.end(), kIndexMagic, kIndexMagic + sizeof(kIndexMagic));
  store<uint64_t>(out, 1);
  out.push_back(static_cast<uint8_t>(dtype_));
  store<uint64_t>(out, lengths_.size());
  store<uint64_t>(out, documents_.size());
  for (int32_t l : lengths_) store<int32_t>(out, l);
  int64_t ptr = 0;
  for (int32_t l : lengths_) {
    store<int64_t>(out, ptr);
    ptr += int64_t{l} * dtype_size(dtype_);
  }
  for (int64_t d : documents_) store<int64_t>(out, d);
  // Both files under temporary names until both are whole, then renamed (.bin first: the
  // .idx names the dataset): an interrupted run leaves no half-written pair.
  std::FILE* f = std::fopen(idx_tmp.c_str(), "wb");
  bool ok = f != nullptr;
  int err = errno;
  if (ok) {
    ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
    ok = close_durably(f) && ok;
    err = errno;
  }
  ok = ok && std::rename(bin_tmp.c_str(), bin_path_.c_str()) == 0 &&
       std::rename(idx_tmp.c_str(), idx_path.c_str()) == 0;
  if (!ok) {
    err = errno != 0 ? errno : err;
    std::remove(bin_tmp.c_str());
    std::remove(idx_tmp.c_str());
    MOE_FAIL("[data] writing '{}' failed: {}", idx_path, std::strerror(err));
  }
}

}  // namespace moecore::data
