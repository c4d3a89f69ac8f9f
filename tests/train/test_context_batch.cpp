// Context parallelism's batch split of a real micro-batch: the data loader's ids and targets
// (with a loss mask) split over cp ranks as Megatron's get_batch_on_this_cp_rank does.
#include <gtest/gtest.h>

#include <vector>

#include "data/sample_stream.h"
#include "data/synthetic_language.h"
#include "train/context_batch.h"

namespace moecore::train {
namespace {

// The positions themselves as the ids: rank r keeps chunks r and 2 cp - 1 - r, in that order.
TEST(ContextBatch, KeepsTheChunkAndItsMirror) {
  const int64_t B = 2, S = 8;
  std::vector<int32_t> ids(B * S), targets(B * S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      ids[b * S + s] = static_cast<int32_t>(100 * b + s);
      targets[b * S + s] = static_cast<int32_t>(100 * b + s + 1);
    }
  const std::vector<std::vector<int32_t>> want = {{0, 1, 6, 7, 100, 101, 106, 107},
                                                  {2, 3, 4, 5, 102, 103, 104, 105}};
  for (int r = 0; r < 2; ++r) {
    std::vector<int32_t> li(B * S / 2), lt(B * S / 2);
    split_micro_batch(parallel::ContextSplit{S, 2, r}, B, ids.data(), targets.data(), li.data(),
                      lt.data());
    EXPECT_EQ(li, want[r]) << "rank " << r;
    for (size_t i = 0; i < lt.size(); ++i) EXPECT_EQ(lt[i], want[r][i] + 1) << "rank " << r;
  }
}

// A micro-batch of the synthetic language with --eod-mask-loss's masked targets: every rank's
// token is the global one at its global position, every (sample, position) is held by exactly
// one rank, and the counted targets add up to the micro-batch's.
TEST(ContextBatch, RealMicroBatchEveryPositionOnce) {
  const int64_t B = 3, S = 16, global_batch = 12;
  data::SyntheticLanguage lang(/*vocab=*/32, /*branching=*/4, /*seed=*/7);
  data::SampleStream stream(&lang, global_batch, /*dp_size=*/2, /*dp_rank=*/1);
  stream.set_eod_mask(3);  // some targets masked (-1): the loss mask splits with them
  std::vector<int32_t> ids(B * S), targets(B * S), scratch(S + 1);
  stream.fill_micro_batch(1, B, S, ids.data(), targets.data(), scratch.data());
  int64_t counted = 0, masked = 0;
  for (int32_t t : targets) (t >= 0 ? counted : masked) += 1;
  ASSERT_GT(masked, 0) << "the test needs masked targets";
  for (int cp : {1, 2, 4}) {
    std::vector<int> seen(B * S, 0);
    int64_t counted_cp = 0;
    for (int r = 0; r < cp; ++r) {
      const parallel::ContextSplit split{S, cp, r};
      const int64_t S_loc = split.local_length();
      std::vector<int32_t> li(B * S_loc, -7), lt(B * S_loc, -7);
      split_micro_batch(split, B, ids.data(), targets.data(), li.data(), lt.data());
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t s = 0; s < S_loc; ++s) {
          const int64_t p = split.global_position(s);
          ASSERT_EQ(li[b * S_loc + s], ids[b * S + p]) << "cp " << cp << " rank " << r;
          ASSERT_EQ(lt[b * S_loc + s], targets[b * S + p]) << "cp " << cp << " rank " << r;
          ++seen[b * S + p];
          counted_cp += lt[b * S_loc + s] >= 0;
        }
      }
    }
    for (int64_t i = 0; i < B * S; ++i) EXPECT_EQ(seen[i], 1) << "cp " << cp << " token " << i;
    EXPECT_EQ(counted_cp, counted) << "cp " << cp;
  }
}

// MTP depth k's inputs: rolled on the whole sequences, then split. On rank r the rolled token at
// local row s is the global sequence's token at global_position(s) + k: across the boundary
// between a rank's two chunks (and between ranks) nothing is lost, and the last k positions
// of every sequence (wherever they are) count nothing.
TEST(ContextBatch, MtpRolledOnTheWholeSequenceBeforeTheSplit) {
  const int64_t B = 2, S = 16;
  std::vector<int32_t> ids(B * S), targets(B * S);
  for (int64_t i = 0; i < B * S; ++i) {
    ids[i] = static_cast<int32_t>(i);
    targets[i] = static_cast<int32_t>(1000 + i);
  }
  for (int64_t k : {1, 2, 3}) {
    std::vector<int32_t> ri(B * S), rt(B * S);
    roll_micro_batch(B, S, k, ids.data(), targets.data(), ri.data(), rt.data());
    for (int cp : {2, 4}) {
      int64_t counted = 0;
      for (int r = 0; r < cp; ++r) {
        const parallel::ContextSplit split{S, cp, r};
        const int64_t S_loc = split.local_length();
        std::vector<int32_t> li(B * S_loc), lt(B * S_loc);
        split_micro_batch(split, B, ri.data(), rt.data(), li.data(), lt.data());
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t s = 0; s < S_loc; ++s) {
            const int64_t p = split.global_position(s) + k;
            const bool in = p < S;
            EXPECT_EQ(li[b * S_loc + s], in ? ids[b * S + p] : 0)
                << "k " << k << " cp " << cp << " rank " << r << " row " << s;
            EXPECT_EQ(lt[b * S_loc + s], in ? targets[b * S + p] : -1)
                << "k " << k << " cp " << cp << " rank " << r << " row " << s;
            counted += lt[b * S_loc + s] >= 0;
          }
        }
      }
      EXPECT_EQ(counted, B * (S - k)) << "k " << k << " cp " << cp;
    }
  }
}

}  // namespace
}  // namespace moecore::train
