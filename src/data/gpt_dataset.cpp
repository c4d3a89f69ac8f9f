#include "data/gpt_dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "core/host_memory.h"
#include "data/index_cache.h"
#include "data/numpy_random.h"

namespace moecore::data {

int64_t gpt_num_epochs(int64_t tokens_per_epoch, int64_t num_samples, int64_t seq_length) {
  if (num_samples < 0) return 1;
  MOE_CHECK(tokens_per_epoch > 0, "[data] an epoch with {} tokens cannot give samples",
            tokens_per_epoch);
  // Megatron counts epochs up one by one until they hold num_samples * seq_length + 1 tokens:
  // the same number, without a loop of billions of steps for a huge request.
  int64_t tokens = 0;
  MOE_CHECK(num_samples >= 0 && seq_length >= 1 &&
                !__builtin_mul_overflow(num_samples, seq_length, &tokens) && tokens < INT64_MAX,
            "[data] {} samples of {} tokens are more than 2^63 tokens: lower the samples "
            "(--train-samples / --train-iters x --global-batch-size) or --seq-length",
            num_samples, seq_length);
  const int64_t requested = tokens + 1;
  return std::max<int64_t>(1, requested / tokens_per_epoch +
                                  (requested % tokens_per_epoch != 0 ? 1 : 0));
}

void check_index_bytes(int64_t num_docs, int64_t tokens_per_epoch, int64_t num_epochs,
                       int64_t num_samples, int64_t seq_length) {
  // The document index (int32 per document per epoch), the sample index (two int64 per
  // sample) and the shuffle index (an int64 per sample), counted in floating point: the counts
  // themselves may overflow int64.
  const double docs = static_cast<double>(num_docs) * static_cast<double>(num_epochs);
  const double samples =
      (static_cast<double>(num_epochs) * static_cast<double>(tokens_per_epoch) - 1) /
      static_cast<double>(seq_length);
  const double bytes = 4 * docs + 24 * (samples + 1);
  const double memory = static_cast<double>(host_memory_bytes());
  MOE_CHECK(bytes <= memory && docs < 0x1p62 && samples < 0x1p62,
            "[data] {} samples of {} tokens need {} epochs of {} documents ({} tokens each): "
            "their indices take {} ({:.3g} document entries, {:.3g} samples), more than this "
            "machine's {} of memory: lower the samples (--train-samples, or --train-iters x "
            "--global-batch-size) or --seq-length, or give more data",
            num_samples, seq_length + 1, num_epochs, num_docs, tokens_per_epoch,
            format_bytes(bytes), docs, samples, format_bytes(memory));
}

std::vector<int64_t> build_sample_index(std::span<const int32_t> sizes,
                                        std::span<const int32_t> document_index,
                                        int64_t seq_length, int64_t num_epochs,
                                        int64_t tokens_per_epoch) {
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  std::vector<int64_t> idx(2 * (num_samples + 1));
  int64_t sample = 0, doc = 0, offset = 0;
  idx[0] = doc;
  idx[1] = offset;
  ++sample;
  const int64_t last_doc = static_cast<int64_t>(document_index.size()) - 1;
  while (sample <= num_samples) {
    int64_t remaining = seq_length + 1;
    while (remaining != 0) {
      const int64_t doc_length = sizes[document_index[doc]] - offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        // The sample ends inside this document; the next starts on its last token (the
        // extra token is shared by both).
        offset += remaining + doc_length - 1;
        remaining = 0;
      } else {
        if (doc == last_doc) {
          // Only reached by the last sample (Megatron asserts sample == num_samples).
          offset = sizes[document_index[doc]] - 1;
          break;
        }
        ++doc;
        offset = 0;
      }
    }
    idx[2 * sample] = doc;
    idx[2 * sample + 1] = offset;
    ++sample;
  }
  return idx;
}

namespace {

// _build_document_index: the documents once per epoch, shuffled as one array.
std::vector<int32_t> document_index_epochs(int64_t doc_begin, int64_t doc_end, int64_t epochs,
                                           NumpyRandomState& rng) {
  const int64_t n = doc_end - doc_begin;
  std::vector<int32_t> idx(static_cast<size_t>(epochs * n));
  for (int64_t e = 0; e < epochs; ++e) {
    for (int64_t d = 0; d < n; ++d) idx[e * n + d] = static_cast<int32_t>(doc_begin + d);
  }
  rng.shuffle(std::span<int32_t>(idx));
  return idx;
}

// _build_shuffle_index: [0, num) shuffled, then [num, total) shuffled on its own.
std::vector<int64_t> shuffle_index(int64_t num, int64_t total, NumpyRandomState& rng) {
  std::vector<int64_t> idx(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) idx[i] = i;
  rng.shuffle(std::span<int64_t>(idx.data(), static_cast<size_t>(num)));
  if (num < total) {
    rng.shuffle(std::span<int64_t>(idx.data() + num, static_cast<size_t>(total - num)));
  }
  return idx;
}

}  // namespace

// Sets num_epochs and separate_final_epoch from tokens_per_epoch; returns the samples before
// the final epoch (Megatron's num_samples_sans_final_epoch; 0 for one epoch).
static int64_t plan_epochs(GPTIndices& out, int64_t num_samples, int64_t seq_length) {
  out.num_epochs = gpt_num_epochs(out.tokens_per_epoch, num_samples, seq_length);
  out.separate_final_epoch = false;
  if (out.num_epochs == 1) return 0;
  const int64_t sans_final = ((out.num_epochs - 1) * out.tokens_per_epoch - 1) / seq_length;
  const int64_t from_final = num_samples - sans_final;
  const int64_t per_epoch = (out.tokens_per_epoch - 1) / seq_length;
  MOE_CHECK(from_final >= 0 && from_final <= per_epoch + 1,
            "[data] internal: {} samples from the final epoch of {}", from_final, per_epoch);
  // int(0.80 * per_epoch) in Python: truncation of the double product.
  out.separate_final_epoch = from_final < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  return sans_final;
}

GPTIndices build_gpt_indices(std::span<const int32_t> sizes, int64_t doc_begin, int64_t doc_end,
                             int64_t num_samples, int64_t seq_length, uint32_t seed) {
  MOE_CHECK(seq_length > 1, "[data] --seq-length={} must be > 1", seq_length);
  MOE_CHECK(0 <= doc_begin && doc_begin <= doc_end && doc_end <= static_cast<int64_t>(sizes.size()),
            "[data] documents [{}, {}) of {}", doc_begin, doc_end, sizes.size());
  MOE_CHECK(doc_end <= std::numeric_limits<int32_t>::max(),
            "[data] {} documents exceed the int32 document index", doc_end);
  GPTIndices out;
  for (int64_t d = doc_begin; d < doc_end; ++d) out.tokens_per_epoch += sizes[d];
  MOE_CHECK(out.tokens_per_epoch > 1,
            "[data] the split's {} documents hold {} tokens: a sample needs at least 2; give the "
            "split more data (--split) or use a larger dataset",
            doc_end - doc_begin, out.tokens_per_epoch);
  check_index_bytes(doc_end - doc_begin, out.tokens_per_epoch,
                    gpt_num_epochs(out.tokens_per_epoch, num_samples, seq_length), num_samples,
                    seq_length);
  const int64_t sans_final = plan_epochs(out, num_samples, seq_length);
  // One RandomState for all the shuffles, in Megatron's order.
  NumpyRandomState rng(seed);
  if (!out.separate_final_epoch) {
    out.document_index = document_index_epochs(doc_begin, doc_end, out.num_epochs, rng);
  } else {
    out.document_index = document_index_epochs(doc_begin, doc_end, out.num_epochs - 1, rng);
    std::vector<int32_t> last = document_index_epochs(doc_begin, doc_end, 1, rng);
    out.document_index.insert(out.document_index.end(), last.begin(), last.end());
  }
  out.sample_index =
      build_sample_index(sizes, out.document_index, seq_length, out.num_epochs, out.tokens_per_epoch);
  const int64_t total = static_cast<int64_t>(out.sample_index.size()) / 2 - 1;
  out.shuffle_index = shuffle_index(out.separate_final_epoch ? sans_final : total, total, rng);
  return out;
}

namespace {

// Cached indices whose description matches but whose arrays do not fit the dataset (altered,
// truncated and re-padded, copied from another run) would make sample() read out of bounds:
// every entry is checked the way sample() walks it, in O(documents + samples) (consecutive
// samples share their boundary entry, so the walks do not overlap).
void check_cached_indices(const GPTIndices& ix, const LowLevelDataset& data, int64_t doc_begin,
                          int64_t doc_end, int64_t seq_length, int64_t num_samples,
                          const std::string& where) {
  // Every message: "[data] the index cache <files> does not fit the dataset '<name>': <what>;
  // delete those files to rebuild them".
#define MOE_CHECK_CACHE(cond, what, ...)                                                     \
  MOE_CHECK(cond,                                                                            \
            "[data] the index cache {} does not fit the dataset '{}': " what                 \
            "; delete those files to rebuild them",                                          \
            where, data.name(), __VA_ARGS__)
  const int64_t docs = static_cast<int64_t>(ix.document_index.size());
  for (int64_t i = 0; i < docs; ++i) {
    const int64_t d = ix.document_index[i];
    MOE_CHECK_CACHE(d >= doc_begin && d < doc_end,
                    "document_index[{}] = {} is not a document of the split [{}, {})", i, d,
                    doc_begin, doc_end);
  }
  const int64_t samples = static_cast<int64_t>(ix.sample_index.size()) / 2 - 1;
  MOE_CHECK_CACHE(ix.sample_index.size() % 2 == 0 && samples >= 0 &&
                      static_cast<int64_t>(ix.shuffle_index.size()) == samples,
                  "sample_index has {} entries and shuffle_index {}, not 2 * (n + 1) and n",
                  ix.sample_index.size(), ix.shuffle_index.size());
  MOE_CHECK_CACHE(num_samples < 0 || samples >= num_samples, "it holds {} samples, {} are needed",
                  samples, num_samples);
  for (int64_t j = 0; j < samples; ++j) {
    const int64_t b = ix.sample_index[2 * j], b_off = ix.sample_index[2 * j + 1];
    const int64_t e = ix.sample_index[2 * j + 2], e_off = ix.sample_index[2 * j + 3];
    MOE_CHECK_CACHE(b >= 0 && b <= e && e < docs, "sample {} spans document_index [{}, {}] of {}",
                    j, b, e, docs);
    int64_t tokens = 0;
    for (int64_t i = b; i <= e; ++i) {
      const int64_t len = data.sequence_length(ix.document_index[i]);
      // e_off < len before the + 1: an offset near 2^63 must not wrap around.
      MOE_CHECK_CACHE((i != b || (b_off >= 0 && b_off <= len)) && (i != e || (e_off >= 0 && e_off < len)),
                      "sample {} starts at offset {} and ends at offset {} in documents of {} "
                      "tokens",
                      j, b_off, e_off, len);
      const int64_t from = i == b ? b_off : 0, to = i == e ? e_off + 1 : len;
      MOE_CHECK_CACHE(from <= to, "sample {} takes tokens [{}, {}) of a document", j, from, to);
      tokens += to - from;
    }
    MOE_CHECK_CACHE(tokens == seq_length + 1, "sample {} has {} tokens, not {}", j, tokens,
                    seq_length + 1);
  }
  for (int64_t i = 0; i < samples; ++i) {
    const int64_t k = ix.shuffle_index[i];
    MOE_CHECK_CACHE(k >= 0 && k < samples, "shuffle_index[{}] = {} is not a sample of {}", i, k,
                    samples);
  }
#undef MOE_CHECK_CACHE
}

}  // namespace

GPTDataset::GPTDataset(std::shared_ptr<const LowLevelDataset> data, Split split,
                       int64_t num_samples, const GPTDatasetConfig& cfg)
    : data_(std::move(data)), split_(split), cfg_(cfg) {
  const SplitMatrix m = split_matrix(parse_split(cfg_.split));
  const auto range = split_range(m, split, data_->num_sequences());
  MOE_CHECK(range.has_value(), "[data] --split '{}' gives the {} split no share", cfg_.split,
            split_name(split));
  doc_begin_ = range->first;
  doc_end_ = range->second;
  MOE_CHECK(doc_end_ > doc_begin_,
            "[data] --data-path prefix '{}': the {} split of --split '{}' gets none of its {} "
            "sequences (documents [{}, {})): use more data or a larger share",
            data_->name(), split_name(split), cfg_.split, data_->num_sequences(), doc_begin_,
            doc_end_);
  check_split_serves_a_sample(num_samples);
  description_ = fmt::format(
      "{{\"class\": \"{}\", \"dataset_path\": \"{}\", \"num_samples\": {}, "
      "\"index_split\": \"{}\", \"random_seed\": {}, \"sequence_length\": {}, \"split\": \"{}\", "
      "\"documents\": [{}, {}], \"sequences\": {}, \"tokens\": {}, \"format\": 1}}",
      cfg_.class_name, data_->name(), num_samples < 0 ? std::string("null") : std::to_string(num_samples),
      split_name(split), cfg_.seed, cfg_.seq_length, cfg_.split, doc_begin_, doc_end_,
      data_->num_sequences(), data_->num_tokens());
  IndexCache cache(cfg_.cache_path, cfg_.class_name, split_name(split), description_);
  if (cache.hit()) {
    int64_t r = 0, c = 0, r2 = 0, c2 = 0, r3 = 0, c3 = 0;
    auto doc = read_npy<int32_t>(cache.path_of("document_index.npy"), &r, &c);
    auto smp = read_npy<int64_t>(cache.path_of("sample_index.npy"), &r2, &c2);
    auto shf = read_npy<int64_t>(cache.path_of("shuffle_index.npy"), &r3, &c3);
    if (doc && smp && shf) {
      MOE_CHECK(c == 0 && c2 == 2 && c3 == 0,
                "[data] the index cache {} has arrays of shapes ({}, {}), ({}, {}), ({}, {}), "
                "not (n,), (m, 2), (m - 1,): delete those files to rebuild them",
                cache.path_of("*.npy"), r, c, r2, c2, r3, c3);
      indices_.document_index = std::move(*doc);
      indices_.sample_index = std::move(*smp);
      indices_.shuffle_index = std::move(*shf);
      check_cached_indices(indices_, *data_, doc_begin_, doc_end_, cfg_.seq_length, num_samples,
                           cache.path_of("*.npy"));
      for (int64_t d = doc_begin_; d < doc_end_; ++d) indices_.tokens_per_epoch += data_->sequence_length(d);
      plan_epochs(indices_, num_samples, cfg_.seq_length);
      from_cache_ = true;
    }
  }
  if (!from_cache_) {
    const std::vector<int32_t> sizes = data_->sequence_lengths();
    indices_ = build_gpt_indices(sizes, doc_begin_, doc_end_, num_samples, cfg_.seq_length, cfg_.seed);
    if (cache.enabled()) {
      write_npy(cache.path_of("document_index.npy"), indices_.document_index,
                static_cast<int64_t>(indices_.document_index.size()), 0);
      write_npy(cache.path_of("sample_index.npy"), indices_.sample_index,
                static_cast<int64_t>(indices_.sample_index.size() / 2), 2);
      write_npy(cache.path_of("shuffle_index.npy"), indices_.shuffle_index,
                indices_.num_samples(), 0);
      cache.save_description();  // last: a description means the arrays are complete
    }
  }
  MOE_CHECK(num_samples < 0 || indices_.num_samples() >= num_samples,
            "[data] internal: {} samples built, {} requested", indices_.num_samples(), num_samples);
}

void GPTDataset::check_split_serves_a_sample(int64_t num_samples) const {
  // A sample is seq_length + 1 consecutive tokens of the split's shuffled documents. A split
  // whose epoch holds fewer has no such sample: Megatron would build one anyway, from as many
  // epochs as it takes (the same documents repeated inside one sample; 189466 epochs of a
  // 5278-token split for --seq-length 10^9). The training split always serves samples; an
  // evaluation split when samples are asked of it (num_samples > 0; 0 and None take what one
  // epoch gives, which may be none).
  if (split_ != Split::Train && num_samples <= 0) return;
  int64_t tokens = 0;
  for (int64_t d = doc_begin_; d < doc_end_; ++d) tokens += data_->sequence_length(d);
  MOE_CHECK(tokens > cfg_.seq_length,
            "[data] '{}': the {} split (documents [{}, {}) of {}, --split '{}') holds {} tokens, "
            "fewer than one sample of --seq-length {} + 1 = {} tokens, so none of the {} "
            "samples asked of it exists (only the split repeated inside one sample would make "
            "it): give --seq-length at most {}, or more {} data (a larger dataset, or a larger "
            "{} share of --split)",
            data_->name(), split_name(split_), doc_begin_, doc_end_, data_->num_sequences(),
            cfg_.split, tokens, cfg_.seq_length, cfg_.seq_length + 1,
            num_samples < 0 ? std::string("one epoch's") : std::to_string(num_samples),
            std::max<int64_t>(tokens - 1, 1), split_name(split_), split_name(split_));
}

void GPTDataset::sample(int32_t* tokens, int64_t len, uint64_t index) const {
  MOE_CHECK(len == cfg_.seq_length + 1, "[data] GPTDataset samples have {} tokens, not {}",
            cfg_.seq_length + 1, len);
  MOE_CHECK(index < static_cast<uint64_t>(indices_.num_samples()),
            "[data] sample {} of the {} split of '{}', which was built for {} samples", index,
            split_name(split_), data_->name(), indices_.num_samples());
  const int64_t j = indices_.shuffle_index[index];
  const int64_t b = indices_.sample_index[2 * j], b_off = indices_.sample_index[2 * j + 1];
  const int64_t e = indices_.sample_index[2 * j + 2], e_off = indices_.sample_index[2 * j + 3];
  int64_t n = 0;
  for (int64_t i = b; i <= e; ++i) {
    const int32_t seq = indices_.document_index[i];
    const int64_t from = i == b ? b_off : 0;
    const int64_t to = i == e ? e_off + 1 : data_->sequence_length(seq);
    const int64_t take = std::min<int64_t>(to - from, len - n);
    data_->get(seq, from, take, tokens + n);
    n += take;
  }
  // Megatron pads a short sample (only possible without drop_last_partial_sequence) with a
  // masked pad token; there is no loss mask here, so such a sample is an error.
  MOE_CHECK(n == len, "[data] sample {} has {} tokens, not {}", index, n, len);
  for (int64_t t = 0; t < len; ++t) {
    MOE_CHECK(tokens[t] < cfg_.vocab,
              "[data] '{}' holds token id {} but the tokenizer's vocabulary has {} ids: give the "
              "--tokenizer-type (and --vocab-size) the data was made with",
              data_->name(), tokens[t], cfg_.vocab);
  }
}

std::string GPTDataset::describe() const {
  return fmt::format("'{}' {} split: sequences [{}, {}) of {}, {} tokens per epoch, {} epochs{}, "
                     "{} samples of {} tokens{}",
                     data_->name(), split_name(split_), doc_begin_, doc_end_,
                     data_->num_sequences(), indices_.tokens_per_epoch, indices_.num_epochs,
                     indices_.separate_final_epoch ? " (final epoch shuffled apart)" : "",
                     indices_.num_samples(), cfg_.seq_length + 1,
                     from_cache_ ? ", indices from --data-cache-path" : "");
}

}  // namespace moecore::data
