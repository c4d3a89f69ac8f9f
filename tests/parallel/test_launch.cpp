// The command line and the launcher: `moecore groups --json` parsed with nlohmann_json;
// under mpirun (oversubscribed, as root in containers): rank 0 alone prints, every rank's error
// carries its rank, and a rank that skips a collective ends the job with a diagnostic, not a
// hang.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unistd.h>
#include <string>

#include "common/command.h"
#include "common/paths.h"
#include "parallel/groups_command.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {
namespace {

using ProcResult = moecore::testing::CommandResult;
ProcResult run(const std::string& cmd) { return moecore::testing::run_command(cmd); }

std::string moecore_binary() { return moecore::testing::moecore_binary(); }

TEST(GroupsCommand, JsonHasExactlyTheGroupKeys) {
  const ProcResult r = run(moecore_binary() +
                    " groups --world-size 16 --tensor-model-parallel-size 2 "
                    "--pipeline-model-parallel-size 2 --expert-model-parallel-size 4 "
                    "--expert-tensor-parallel-size 1 --sequence-parallel --num-experts 8 "
                    "--num-layers 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  ASSERT_TRUE(j.is_object());
  const std::vector<std::string> keys = {"tp", "cp",      "dp",      "dp_cp", "tp_cp", "tp_dp_cp",
                                         "pp", "ep",      "expt_tp", "expt_dp", "tp_ep", "tp_ep_pp"};
  EXPECT_EQ(j.size(), keys.size());
  ParallelConfig c;
  c.tp = 2;
  c.pp = 2;
  c.ep = 4;
  c.etp = 1;
  const Layout l = make_layout(c, 16);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(j.contains(keys[i])) << keys[i];
    EXPECT_EQ(j[keys[i]].get<RankLists>(), l.of(kAllGroupKinds[i])) << keys[i];
  }
  EXPECT_EQ(j["dp"].get<RankLists>(),
            (RankLists{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(layout_json(l) + "\n", r.output);
}

TEST(GroupsCommand, TextListingAndBadLayout) {
  ProcResult r = run(moecore_binary() +
              " groups --world-size 8 --tensor-model-parallel-size 2 --context-parallel-size 2 "
              "--rank 5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("attention grid: tp 2 x cp 2 x dp 2 x pp 1"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("dp_cp       2 x 4   [0,2,4,6] [1,3,5,7]"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("cp        [5,7] (position 0)"), std::string::npos) << r.output;
  r = run(moecore_binary() +
          " groups --world-size 8 --expert-model-parallel-size 4 --num-experts 6");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("error: [parallel] --num-experts 6 is not divisible by "
                          "--expert-model-parallel-size 4"),
            std::string::npos)
      << r.output;
}

#ifdef MOECORE_HAVE_MPI
std::string mpirun(int np) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 " +
         moecore::testing::mpiexec() + " --oversubscribe -np " + std::to_string(np) + " ";
}

TEST(Launch, RankZeroAlonePrints) {
  const ProcResult r = run(mpirun(3) + moecore_binary() + " groups --world-size 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Exactly one JSON object: the other ranks' stdout is quiet.
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_NO_THROW(nlohmann::json::parse(r.output)) << r.output;
}

TEST(Launch, ErrorsCarryTheRank) {
  const ProcResult r = run(mpirun(2) + moecore_binary() +
                    " groups --world-size 12 --tensor-model-parallel-size 8");
  EXPECT_NE(r.exit_code, 0) << r.output;
  const bool r0 = r.output.find("[rank 0] error: [parallel] world size 12") != std::string::npos;
  const bool r1 = r.output.find("[rank 1] error: [parallel] world size 12") != std::string::npos;
  EXPECT_TRUE(r0 || r1) << r.output;
}

// `moecore train` under mpirun: data parallelism over 2 ranks trains the same global batch as
// one process. Rank 0 alone prints and writes the metrics file; step 1 is bitwise the 1-rank
// value (same micro-batches, same weights, losses summed in global order), later steps within
// the f32 layout-parity tolerance. A global batch that does not split over DP stops before
// training, naming the three numbers.
std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(Launch, DataParallelTrainMatchesOneRank) {
  const std::string tiny =
      " train --hidden-size 32 --num-attention-heads 2 --seq-length 16 --num-layers 2"
      " --max-position-embeddings 16 --num-experts 4 --moe-ffn-hidden-size 16"
      " --ffn-hidden-size 32 --vocab-size 64 --swiglu --disable-bias-linear"
      " --normalization RMSNorm --position-embedding-type rope --attention-dropout 0"
      " --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-3"
      " --min-lr 3e-4 --lr-decay-style cosine --moe-aux-loss-coeff 0.01"
      " --moe-token-dispatcher-type alltoall --log-interval 1 --peak-tflops 0.1 --metrics-file ";
  const std::string base = ::testing::TempDir() + "moecore_dp_" + std::to_string(::getpid());
  const ProcResult one = run(moecore_binary() + tiny + base + ".1.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const ProcResult two =
      run(mpirun(2) + moecore_binary() + tiny + base + ".2.jsonl --overlap-grad-reduce");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find(" iteration      4/4"), std::string::npos) << two.output;
  // One header, one set of log lines: rank 1 is quiet.
  size_t headers = 0;
  for (size_t at = 0; (at = two.output.find("[train] parallel: 2 ranks", at)) != std::string::npos;
       ++at) {
    ++headers;
  }
  EXPECT_EQ(headers, 1u) << two.output;
  const auto a = read_jsonl(base + ".1.jsonl"), b = read_jsonl(base + ".2.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(a[0]["lm_loss"].get<double>(), b[0]["lm_loss"].get<double>());
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i]["lm_loss"].get<double>(), y = b[i]["lm_loss"].get<double>();
    EXPECT_LE(std::abs(x - y), 1e-5 * std::abs(x)) << "iteration " << i + 1;
  }
  std::remove((base + ".1.jsonl").c_str());
  std::remove((base + ".2.jsonl").c_str());

  const ProcResult bad = run(mpirun(2) + moecore_binary() + tiny + base + ".3.jsonl" +
                             " --global-batch-size 6");
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("--global-batch-size=6 must be a multiple of --micro-batch-size=2 x "
                            "data-parallel size 2 = 4"),
            std::string::npos)
      << bad.output;
  EXPECT_EQ(bad.output.find("iteration "), std::string::npos) << bad.output;
}

// --moe-expert-rank-capacity-factor under the allgather dispatcher: each EP rank sees only its
// own rows, so the rank over the budget stops alone, and the job ends at once (the runtime's
// abort after an error), not after a collective's timeout, with the rank's rows in the message.
// The other rank waits in its next collective: had the job not been aborted, it would print its
// timeout diagnostic after --distributed-timeout-minutes (1 here), and the test would see it.
TEST(Launch, RankCapacityOverflowEndsTheJob) {
  const ProcResult r =
      run(mpirun(2) + moecore_binary() +
          " train --hidden-size 32 --num-attention-heads 2 --seq-length 16 --num-layers 2"
          " --max-position-embeddings 16 --num-experts 4 --moe-ffn-hidden-size 16"
          " --ffn-hidden-size 32 --vocab-size 64 --swiglu --disable-bias-linear"
          " --normalization RMSNorm --position-embedding-type rope --attention-dropout 0"
          " --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr 3e-3"
          " --peak-tflops 0.1 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"
          " --moe-expert-rank-capacity-factor 1 --distributed-timeout-minutes 1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("timeout: world rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("x the balanced load of 64 (T 32 x top-k 2), over the 64 rows planned "
                          "by --moe-expert-rank-capacity-factor 1"),
            std::string::npos)
      << r.output;
}

// One rank skips a collective: the others time out (5 s), name the group, the call, the rank
// that is waiting and the rank that never arrived (with what it is doing instead), and the job
// ends with a non-zero status, at once: rank 3 never reaches its own (120 s) timeout. No
// wall-clock bound: the absent diagnostic of rank 3 is what tells, however loaded the machine.
TEST(Launch, SkippedCollectiveTimesOutWithDiagnostic) {
  const ProcResult r = run(mpirun(4) + moecore::testing::timeout_probe());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("timeout: world rank 3 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[comm] timeout: world rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("in all_reduce #2 on 'world' (f32 x 10)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("world rank 3: has NOT reached all_reduce #2 on 'world' (it entered "
                          "1 call there); it is waiting in barrier #1 on 'tp'"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("probe: not reached"), std::string::npos) << r.output;
}

// A hung pipeline stage: the next stage's wait for its activation times out (5 s), naming the
// pipeline group, the receive and where the first stage is instead; the job ends at once.
TEST(Launch, HungPipelineStageTimesOutNamingThePipelineGroup) {
  const ProcResult r = run(mpirun(2) + moecore::testing::timeout_probe() + " pp");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("timeout: world rank 0 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[comm] timeout: world rank 1 (rank 1 of 2 in group 'pp'"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("recv #1 on 'pp'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("it is waiting in barrier #1 on 'world'"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("probe: not reached"), std::string::npos) << r.output;
}
#endif

}  // namespace
}  // namespace moecore::parallel
