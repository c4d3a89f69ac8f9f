// The GPT dataset's indices are Megatron's element for element: document index (numpy
// RandomState shuffles, epochs, the separate final epoch), sample index (windows of
// seq_length + 1 crossing documents), shuffle index, --split ranges, blending indices and the
// mock dataset, against tests/fixtures/data/indices.json (tools/make_data_fixtures.py, numpy).
// Then the samples themselves, the index cache, and the resumable sample stream.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/paths.h"
#include "common/testing.h"
#include "core/check.h"
#include "data/blended_dataset.h"
#include "data/data_pipeline.h"
#include "data/data_split.h"
#include "data/gpt_dataset.h"
#include "data/index_cache.h"
#include "data/indexed_dataset.h"
#include "data/mock_gpt_dataset.h"
#include "data/numpy_random.h"
#include "data/sample_stream.h"

namespace moecore::data {
namespace {

const nlohmann::json& fixtures() {
  static const nlohmann::json j = [] {
    std::ifstream in(::moecore::testing::source_dir() + "/tests/fixtures/data/indices.json");
    EXPECT_TRUE(in.good()) << "tests/fixtures/data/indices.json (tools/make_data_fixtures.py)";
    return nlohmann::json::parse(in);
  }();
  return j;
}

std::string temp_prefix(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          (name + "." + std::to_string(::getpid()) + "." +
           ::testing::UnitTest::GetInstance()->current_test_info()->name()))
      .string();
}

// token at position t of sequence s of the test datasets
int64_t token_of(int64_t s, int64_t t) { return (s * 131 + t * 7) % 251; }

std::string write_dataset(const std::vector<int32_t>& sizes, const std::string& name) {
  const std::string p = temp_prefix(name);
  IndexedDatasetBuilder b(p + ".bin", TokenDType::UInt16);
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<int64_t> t(sizes[s]);
    for (int32_t i = 0; i < sizes[s]; ++i) t[i] = token_of(static_cast<int64_t>(s), i);
    b.add_item(t);
    b.end_document();
  }
  b.finalize(p + ".idx");
  return p;
}

void remove_dataset(const std::string& p) {
  std::remove((p + ".bin").c_str());
  std::remove((p + ".idx").c_str());
}

TEST(NumpyRandom, RandomStateShuffleAndDefaultRngMatchNumpy) {
  // Mock lengths come from default_rng(0).integers(1, 4096); their first 32 and sum pin PCG64,
  // SeedSequence and the bounded draws.
  const auto& m = fixtures()["mock"];
  NumpyGenerator g(0);
  int64_t sum = 0;
  std::vector<int32_t> first;
  for (int i = 0; i < MockGPTLowLevelDataset::kSize; ++i) {
    const int32_t v = g.integers_int32(1, 4096);
    if (i < 32) first.push_back(v);
    sum += v;
  }
  EXPECT_EQ(first, m["first_lengths"].get<std::vector<int32_t>>());
  EXPECT_EQ(sum, m["sum_lengths"].get<int64_t>());
  // numpy's random_interval above 2^32 - 1 uses 64-bit draws: exercised for the masks.
  NumpyRandomState r(5);
  for (int i = 0; i < 100; ++i) EXPECT_LE(r.interval((uint64_t{1} << 40) + 3), (uint64_t{1} << 40) + 3);
}

TEST(GPTIndices, EqualMegatronsForSeveralSeedsSizesAndSplits) {
  const std::vector<int32_t> sizes = fixtures()["sizes"].get<std::vector<int32_t>>();
  int separate = 0, multi_epoch = 0;
  for (const auto& c : fixtures()["gpt"]) {
    const int64_t n = c["num_samples"].is_null() ? -1 : c["num_samples"].get<int64_t>();
    SCOPED_TRACE(c["split"].get<std::string>() + " seed " + std::to_string(c["seed"].get<int>()) +
                 " S " + std::to_string(c["seq_length"].get<int>()) + " n " + std::to_string(n));
    const GPTIndices x = build_gpt_indices(sizes, c["doc_begin"], c["doc_end"], n,
                                           c["seq_length"], c["seed"].get<uint32_t>());
    EXPECT_EQ(x.tokens_per_epoch, c["tokens_per_epoch"].get<int64_t>());
    EXPECT_EQ(x.num_epochs, c["num_epochs"].get<int64_t>());
    EXPECT_EQ(x.separate_final_epoch, c["separate_final_epoch"].get<bool>());
    EXPECT_EQ(x.document_index, c["document_index"].get<std::vector<int32_t>>());
    std::vector<int64_t> flat;
    for (const auto& row : c["sample_index"]) {
      flat.push_back(row[0]);
      flat.push_back(row[1]);
    }
    EXPECT_EQ(x.sample_index, flat);
    EXPECT_EQ(x.shuffle_index, c["shuffle_index"].get<std::vector<int64_t>>());
    separate += x.separate_final_epoch;
    multi_epoch += x.num_epochs > 1;
  }
  // The fixtures cover one epoch, several, and a separately shuffled final epoch.
  EXPECT_GT(separate, 0);
  EXPECT_GT(multi_epoch, separate);
}

TEST(GPTIndices, SplitRangesEqualMegatrons) {
  for (const auto& c : fixtures()["splits"]) {
    const SplitMatrix m = split_matrix(parse_split(c["split"]));
    for (int s = 0; s < kNumSplits; ++s) {
      const auto r = split_range(m, static_cast<Split>(s), c["num_elements"]);
      const auto& want = c["ranges"][s];
      SCOPED_TRACE(c["split"].get<std::string>() + " split " + std::to_string(s));
      ASSERT_EQ(r.has_value(), !want.is_null());
      if (r) {
        EXPECT_EQ(r->first, want[0].get<int64_t>());
        EXPECT_EQ(r->second, want[1].get<int64_t>());
      }
    }
  }
  EXPECT_THROW(parse_split("0,0,0"), Error);
  EXPECT_THROW(parse_split("1,2,3,4"), Error);
}

TEST(Blending, IndicesAndNormalisedWeightsEqualMegatrons) {
  for (const auto& c : fixtures()["blends"]) {
    const std::vector<double> w = normalize_weights(c["weights"].get<std::vector<double>>());
    std::vector<std::string> hex;
    for (double x : w) {
      // Python's float.hex: bit-exact weights.
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%a", x);
      hex.push_back(buf);
    }
    std::vector<double> want;
    for (const auto& h : c["normalized"]) want.push_back(std::strtod(h.get<std::string>().c_str(), nullptr));
    EXPECT_EQ(w, want);
    const BlendingIndices b = build_blending_indices(w, c["size"]);
    std::vector<int64_t> di(b.dataset_index.begin(), b.dataset_index.end());
    EXPECT_EQ(di, c["dataset_index"].get<std::vector<int64_t>>());
    EXPECT_EQ(b.dataset_sample_index, c["dataset_sample_index"].get<std::vector<int64_t>>());
  }
  for (const auto& c : fixtures()["exhaustive_blends"]) {
    const BlendingIndices b = build_exhaustive_blending_indices(c["sizes"].get<std::vector<int64_t>>());
    std::vector<int64_t> di(b.dataset_index.begin(), b.dataset_index.end());
    EXPECT_EQ(di, c["dataset_index"].get<std::vector<int64_t>>());
    EXPECT_EQ(b.dataset_sample_index, c["dataset_sample_index"].get<std::vector<int64_t>>());
  }
}

TEST(MockData, MegatronsMockTrainSplit) {
  const auto& m = fixtures()["mock"];
  auto mock = std::make_shared<const MockGPTLowLevelDataset>(1000, 999);
  GPTDatasetConfig cfg;
  cfg.seq_length = 32;
  cfg.seed = 1234;
  cfg.split = "1,1,1";
  cfg.vocab = 1000;
  cfg.class_name = "MockGPTDataset";
  GPTDataset train(mock, Split::Train, 64, cfg);
  EXPECT_EQ(train.doc_begin(), m["train_documents"][0].get<int64_t>());
  EXPECT_EQ(train.doc_end(), m["train_documents"][1].get<int64_t>());
  EXPECT_EQ(train.indices().num_epochs, m["num_epochs"].get<int64_t>());
  EXPECT_EQ(train.num_samples(), m["num_samples"].get<int64_t>());
  std::vector<int32_t> head(train.indices().document_index.begin(),
                            train.indices().document_index.begin() + 32);
  EXPECT_EQ(head, m["document_index_head"].get<std::vector<int32_t>>());
  std::vector<int64_t> shead(train.indices().shuffle_index.begin(),
                             train.indices().shuffle_index.begin() + 64);
  EXPECT_EQ(shead, m["shuffle_index_head"].get<std::vector<int64_t>>());
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> t(33);
    train.sample(t.data(), 33, i);
    EXPECT_EQ(t, m["first_samples"][i].get<std::vector<int32_t>>()) << "sample " << i;
  }
}

// A sample is the seq_length + 1 tokens the sample index points at, across documents.
TEST(GPTDataset, SamplesAreTheIndexedWindows) {
  const std::vector<int32_t> sizes = fixtures()["sizes"].get<std::vector<int32_t>>();
  const std::string p = write_dataset(sizes, "moecore_gpt_samples");
  auto ds = std::make_shared<const IndexedDataset>(p);
  GPTDatasetConfig cfg;
  cfg.seq_length = 16;
  cfg.seed = 1234;
  cfg.split = "969, 30, 1";
  cfg.vocab = 256;
  GPTDataset train(ds, Split::Train, 200, cfg);
  const GPTIndices& x = train.indices();
  // The stream of tokens the document index lays out, and where each entry starts in it.
  std::vector<int64_t> stream, start;
  for (int32_t seq : x.document_index) {
    start.push_back(static_cast<int64_t>(stream.size()));
    for (int32_t t = 0; t < sizes[seq]; ++t) stream.push_back(token_of(seq, t));
  }
  for (int64_t i = 0; i < train.num_samples(); ++i) {
    std::vector<int32_t> t(17);
    train.sample(t.data(), 17, static_cast<uint64_t>(i));
    const int64_t j = x.shuffle_index[i];
    const int64_t from = start[x.sample_index[2 * j]] + x.sample_index[2 * j + 1];
    for (int k = 0; k < 17; ++k) ASSERT_EQ(t[k], stream[from + k]) << "sample " << i << " token " << k;
    // Consecutive samples of the unshuffled order overlap by one token.
    EXPECT_EQ(start[x.sample_index[2 * j + 2]] + x.sample_index[2 * j + 3], from + 16);
  }
  std::vector<int32_t> t(17);
  EXPECT_THROW(train.sample(t.data(), 17, train.num_samples()), Error);
  remove_dataset(p);
}

// The cache tests' configuration: seed 7, split 90/5/5, indices cached in `dir`.
GPTDatasetConfig cached_config(const std::string& dir) {
  GPTDatasetConfig cfg;
  cfg.seq_length = 8;
  cfg.seed = 7;
  cfg.split = "90,5,5";
  cfg.vocab = 256;
  cfg.cache_path = dir;
  return cfg;
}

TEST(GPTDataset, IndicesAreCachedAndReloaded) {
  const std::vector<int32_t> sizes = fixtures()["sizes"].get<std::vector<int32_t>>();
  const std::string p = write_dataset(sizes, "moecore_gpt_cache");
  const std::string dir = temp_prefix("moecore_cache_dir");
  auto ds = std::make_shared<const IndexedDataset>(p);
  GPTDatasetConfig cfg = cached_config(dir);
  GPTDataset a(ds, Split::Train, 300, cfg);
  EXPECT_FALSE(a.loaded_from_cache());
  GPTDataset b(ds, Split::Train, 300, cfg);
  EXPECT_TRUE(b.loaded_from_cache());
  EXPECT_EQ(a.indices().document_index, b.indices().document_index);
  EXPECT_EQ(a.indices().sample_index, b.indices().sample_index);
  EXPECT_EQ(a.indices().shuffle_index, b.indices().shuffle_index);
  EXPECT_EQ(a.indices().num_epochs, b.indices().num_epochs);
  EXPECT_EQ(a.indices().separate_final_epoch, b.indices().separate_final_epoch);
  cfg.seed = 8;  // another seed: another cache entry
  GPTDataset c(ds, Split::Train, 300, cfg);
  EXPECT_FALSE(c.loaded_from_cache());
  EXPECT_NE(a.indices().shuffle_index, c.indices().shuffle_index);
  // The cache is .npy: 3 arrays and a description per entry.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 8);
  std::filesystem::remove_all(dir);
  remove_dataset(p);
}

// A cache entry whose description matches but whose arrays do not fit the dataset is refused
// naming the file and the entry (found by tests/fuzz/fuzz_index_cache: a shuffle index past the
// samples read out of bounds in sample()); a .npy whose shape needs more bytes than the file
// holds is refused before anything is allocated.
TEST(GPTDataset, ACorruptCacheIsRefusedNamingTheEntry) {
  const std::vector<int32_t> sizes = fixtures()["sizes"].get<std::vector<int32_t>>();
  const std::string p = write_dataset(sizes, "moecore_gpt_bad_cache");
  const std::string dir = temp_prefix("moecore_bad_cache_dir");
  auto ds = std::make_shared<const IndexedDataset>(p);
  GPTDatasetConfig cfg = cached_config(dir);
  const GPTDataset a(ds, Split::Train, 300, cfg);  // writes the cache
  const GPTIndices& ix = a.indices();
  const IndexCache cache(dir, cfg.class_name, "train", a.description());
  const std::string doc = cache.path_of("document_index.npy");
  const std::string smp = cache.path_of("sample_index.npy");
  const std::string shf = cache.path_of("shuffle_index.npy");
  const int64_t n = ix.num_samples();
  auto reload_error = [&] {
    std::string e = ::moecore::testing::error_of([&] { GPTDataset b(ds, Split::Train, 300, cfg); });
    // Each case alters one array; the next starts from the cache as written.
    write_npy(doc, ix.document_index, static_cast<int64_t>(ix.document_index.size()), 0);
    write_npy(smp, ix.sample_index, n + 1, 2);
    write_npy(shf, ix.shuffle_index, n, 0);
    return e;
  };
  EXPECT_EQ(reload_error(), "");  // as written: loads

  std::vector<int64_t> shuffle = ix.shuffle_index;
  shuffle[3] = n;
  write_npy(shf, shuffle, n, 0);
  std::string e = reload_error();
  EXPECT_NE(e.find(fmt::format("shuffle_index[3] = {} is not a sample of {}; delete those files "
                               "to rebuild them", n, n)),
            std::string::npos) << e;
  EXPECT_NE(e.find("[data] the index cache " + dir), std::string::npos) << e;

  std::vector<int64_t> sample = ix.sample_index;
  sample[1] += 1;  // sample 0 starts a token later: one short
  write_npy(smp, sample, n + 1, 2);
  e = reload_error();
  EXPECT_NE(e.find("sample 0 has 8 tokens, not 9"), std::string::npos) << e;

  sample = ix.sample_index;
  sample[2] = static_cast<int64_t>(ix.document_index.size());  // past the document index
  write_npy(smp, sample, n + 1, 2);
  e = reload_error();
  EXPECT_NE(e.find(fmt::format("sample 0 spans document_index [0, {}] of {}",
                               ix.document_index.size(), ix.document_index.size())),
            std::string::npos) << e;

  std::vector<int32_t> document = ix.document_index;
  document[0] = static_cast<int32_t>(a.doc_end());
  write_npy(doc, document, static_cast<int64_t>(document.size()), 0);
  e = reload_error();
  EXPECT_NE(e.find(fmt::format("document_index[0] = {} is not a document of the split [0, {})",
                               a.doc_end(), a.doc_end())),
            std::string::npos) << e;

  // Headers whose shapes the data does not hold: refused by size, nothing allocated.
  write_npy(smp, std::vector<int64_t>{}, int64_t{1} << 62, 4);
  e = reload_error();
  EXPECT_NE(e.find("has 0 bytes of data but its shape (4611686018427387904, 4) of 8-byte values "
                   "needs more than 2^64"),
            std::string::npos) << e;
  write_npy(shf, std::vector<int64_t>(3), 1000, 0);
  e = reload_error();
  EXPECT_NE(e.find("has 24 bytes of data but its shape (1000,) of 8-byte values needs 8000"),
            std::string::npos) << e;
  std::filesystem::remove_all(dir);
  remove_dataset(p);
}

TEST(DataPipeline, BlendOfWeightedPrefixesFollowsMegatronsSizes) {
  const std::vector<int32_t> sizes = fixtures()["sizes"].get<std::vector<int32_t>>();
  const std::string p1 = write_dataset(sizes, "moecore_blend_a");
  std::vector<int32_t> other(sizes.rbegin(), sizes.rend());
  const std::string p2 = write_dataset(other, "moecore_blend_b");
  DataConfig cfg;
  cfg.data_path = {"0.3", p1, "0.7", p2};
  cfg.split = "98,2,0";
  const DataSplits s = build_data_splits(cfg, 16, 1234, {100, 20, 0}, 256, 0);
  ASSERT_NE(s.train(), nullptr);
  const auto* blend = dynamic_cast<const BlendedDataset*>(s.train());
  ASSERT_NE(blend, nullptr);
  // sum(ceil(100 * w)) samples, each dataset built with ceil(ceil(100 * w) * 1.005).
  EXPECT_EQ(blend->num_samples(), 30 + 70);
  const auto* a = dynamic_cast<const GPTDataset*>(&blend->dataset(0));
  ASSERT_NE(a, nullptr);
  GPTDatasetConfig g;
  g.seq_length = 16;
  g.seed = 1234;
  g.split = "98,2,0";
  g.vocab = 256;
  GPTDataset direct(std::make_shared<const IndexedDataset>(p1), Split::Train, 31, g);
  EXPECT_EQ(a->indices().shuffle_index, direct.indices().shuffle_index);
  // Blend sample i is sample dataset_sample_index[i] of dataset dataset_index[i].
  const BlendingIndices want = build_blending_indices(normalize_weights({0.3, 0.7}), 100);
  for (int64_t i = 0; i < 100; ++i) {
    std::vector<int32_t> x(17), y(17);
    blend->sample(x.data(), 17, i);
    blend->dataset(want.dataset_index[i]).sample(y.data(), 17, want.dataset_sample_index[i]);
    ASSERT_EQ(x, y) << i;
  }
  EXPECT_NE(s.valid(), nullptr);
  EXPECT_EQ(s.test(), nullptr);  // a zero share is no split
  // Prefixes without weights: blended by their one-epoch sizes.
  cfg.data_path = {p1, p2};
  const DataSplits u = build_data_splits(cfg, 16, 1234, {50, 5, 0}, 256, 0);
  EXPECT_EQ(u.train()->num_samples(), 50);
  remove_dataset(p1);
  remove_dataset(p2);
}

// The data position is resumable: a stream set to sample N continues exactly where a stream
// that consumed N samples is; and the global batch does not depend on the data-parallel size.
TEST(SampleStream, ResumeAtSampleNAndDataParallelSizeIndependence) {
  const std::vector<int32_t> sizes = fixtures()["sizes"].get<std::vector<int32_t>>();
  const std::string p = write_dataset(sizes, "moecore_stream");
  DataConfig cfg;
  cfg.data_path = {p};
  cfg.split = "1,0,0";
  const DataSplits s = build_data_splits(cfg, 8, 1234, {96, 0, 0}, 256, 0);
  const TokenSource& src = *s.train();
  const int64_t S = 8, gb = 8;
  std::vector<int32_t> ids(gb * S), tg(gb * S), scratch(S + 1), ids2(gb * S), tg2(gb * S);
  SampleStream full(&src, gb, 1, 0);
  for (int step = 0; step < 5; ++step) full.advance();
  SampleStream resumed(&src, gb, 1, 0);
  resumed.set_consumed_samples(full.consumed_samples());
  EXPECT_EQ(resumed.consumed_samples(), 40);
  for (int step = 0; step < 3; ++step) {
    full.fill_micro_batch(0, gb, S, ids.data(), tg.data(), scratch.data());
    resumed.fill_micro_batch(0, gb, S, ids2.data(), tg2.data(), scratch.data());
    EXPECT_EQ(ids, ids2);
    EXPECT_EQ(tg, tg2);
    full.advance();
    resumed.advance();
  }
  EXPECT_THROW(resumed.set_consumed_samples(3), Error);  // not a whole global batch
  // DP = 1, 2, 4: the ranks' micro-batches, in rank order, are the one-rank global batch.
  SampleStream one(&src, gb, 1, 0);
  one.set_consumed_samples(16);
  one.fill_micro_batch(0, gb, S, ids.data(), tg.data(), scratch.data());
  for (int dp : {2, 4}) {
    std::vector<int32_t> joined;
    for (int r = 0; r < dp; ++r) {
      SampleStream rank(&src, gb, dp, r);
      rank.set_consumed_samples(16);
      const int64_t micro = 1;
      for (int64_t mb = 0; mb < gb / dp; ++mb) {
        std::vector<int32_t> i1(micro * S), t1(micro * S);
        rank.fill_micro_batch(mb, micro, S, i1.data(), t1.data(), scratch.data());
        joined.insert(joined.end(), i1.begin(), i1.end());
      }
    }
    EXPECT_EQ(joined, ids) << "dp " << dp;
  }
  remove_dataset(p);
}

// --eod-mask-loss: the target of every position whose input token is the EOD is ignored (-1),
// every other target and every input unchanged (Megatron: loss_mask[tokens == eod] = 0).
TEST(SampleStream, EodMaskIgnoresThePredictionsMadeAtTheEod) {
  const std::vector<int32_t> sizes = fixtures()["sizes"].get<std::vector<int32_t>>();
  const std::string p = write_dataset(sizes, "moecore_eodmask");
  DataConfig cfg;
  cfg.data_path = {p};
  cfg.split = "1,0,0";
  const DataSplits s = build_data_splits(cfg, 8, 1234, {96, 0, 0}, 256, 0);
  const int64_t S = 8, gb = 8;
  std::vector<int32_t> ids(gb * S), tg(gb * S), scratch(S + 1), ids2(gb * S), tg2(gb * S);
  SampleStream plain(s.train(), gb, 1, 0);
  plain.fill_micro_batch(0, gb, S, ids.data(), tg.data(), scratch.data());
  const int32_t eod = ids[3];  // a token the batch holds, standing for the EOD
  SampleStream masked(s.train(), gb, 1, 0);
  masked.set_eod_mask(eod);
  masked.fill_micro_batch(0, gb, S, ids2.data(), tg2.data(), scratch.data());
  EXPECT_EQ(ids2, ids);
  int64_t n_masked = 0;
  for (int64_t i = 0; i < gb * S; ++i) {
    if (ids[i] == eod) {
      EXPECT_EQ(tg2[i], -1) << i;
      ++n_masked;
    } else {
      EXPECT_EQ(tg2[i], tg[i]) << i;
    }
  }
  EXPECT_GE(n_masked, 1);
  // Each micro-batch's first sample in the global batch: the dropout counters' sample0.
  SampleStream rank1(s.train(), gb, 2, 1);
  EXPECT_EQ(rank1.first_sample(0, 2), 4);
  EXPECT_EQ(rank1.first_sample(1, 2), 6);
  remove_dataset(p);
}

}  // namespace
}  // namespace moecore::data
