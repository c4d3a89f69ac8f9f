// A distributed-optimizer checkpoint save at TP 2 x EP 2 x EDP 2 (expert TP 2; dense DP 4) on 8
// ranks, one step into a model whose expert weights are split along two dimensions (their
// moments' pieces are no runs of the flattened tensors, the case that used to be gathered):
// (a) the save communicates nothing but its protocol: no call at all on any group but the world,
//     and on the world exactly the protocol's agreements and its one gather of the manifest
//     parts, counted per communicator (Communicator::calls);
// (b) the save's peak extra host memory (VmHWM reset through /proc/self/clear_refs, then read
//     against the VmRSS before the save) stays within a quarter of the rank's own optimizer
//     bytes: the shards stream from the values through a bounded buffer, nothing is staged or
//     assembled; an --async-save holds one host copy of what the rank writes, no more;
// and the checkpoint it wrote validates and holds every global tensor once, each rank's optimizer
// shard its own pieces.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "ckpt/checkpoint_dir.h"
#include "cli/train_flags.h"
#include "common/mpi_testing.h"
#include "common/tiny_train_flags.h"
#include "core/check.h"
#include "parallel/process_groups.h"
#include "parallel/runtime.h"
#include "train/trainer.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

parallel::Runtime g_rt;

// The peak extra memory of a save, as a fraction of the rank's own optimizer bytes (the owned
// moments and, under --bf16, master weights): the stated bound.
constexpr double kSyncExtraFraction = 0.25;
// An --async-save holds one host copy of the bytes this rank writes; the bound leaves room for
// the allocator's rounding and the manifest's text.
constexpr double kAsyncExtraFraction = 1.25;
// The protocol's world collectives in a save: four agreements (staging, the description of the
// shards, their writing, the manifest and publication; parallel::run_on_all_ranks: one
// all-reduce each) and the gather of the manifest parts (all_gather_strings: the lengths, then
// the text).
constexpr int64_t kProtocolAllReduces = 4;
constexpr int64_t kProtocolAllGathers = 2;

// A model whose optimizer state is megabytes per rank (so the old gather shows), trained one
// step: 8 experts of 512 hidden units per layer, hidden 256.
std::vector<std::string> args() {
  // clang-format off
  return {"--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "16",
          "--num-layers", "2", "--num-experts", "8", "--moe-ffn-hidden-size", "512",
          "--ffn-hidden-size", "512", "--vocab-size", "512",
          "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "1",
          "--global-batch-size", "8", "--log-interval", "1000", "--peak-tflops", "0.1",
          "--train-iters", "1", "--lr-warmup-iters", "0",
          "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
          "--sequence-parallel", "--use-distributed-optimizer"};
  // clang-format on
}

cli::TrainFlags flags() {
  cli::TrainFlags f = cli::tiny_train_flags();
  CLI::App app;
  cli::add_train_flags(app, f);
  std::vector<std::string> a = args();
  std::reverse(a.begin(), a.end());  // CLI11 takes them reversed
  app.parse(a);
  cli::finalize_train_flags(f);
  return f;
}

// VmRSS / VmHWM of this process, in bytes.
int64_t status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size())) * 1024;
  }
  return -1;
}

// Resets VmHWM to VmRSS (Linux 4.0+: "5" to /proc/self/clear_refs). False when the kernel does
// not: the peak is then not measurable here.
bool reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  f.flush();
  return f.good();
}

// Whether a reset takes: a 32 MiB peak made and freed (the pages go back), then the reset must
// bring VmHWM down to VmRSS.
bool peak_resets() {
  {
    std::vector<char> big(32 << 20);
    for (size_t i = 0; i < big.size(); i += 4096) big[i] = 1;
    asm volatile("" ::"r"(big.data()) : "memory");
  }
  if (!reset_peak()) return false;
  return status_bytes("VmHWM") - status_bytes("VmRSS") < (16 << 20);
}

std::map<parallel::GroupKind, parallel::CommCalls> calls_of(const parallel::ProcessGroups& g) {
  std::map<parallel::GroupKind, parallel::CommCalls> out;
  for (parallel::GroupKind k : parallel::kAllGroupKinds) {
    if (g.group(k).comm) out[k] = g.group(k).communicator().calls();
  }
  return out;
}

std::string calls_text(const parallel::CommCalls& c) {
  return fmt::format(
      "all_reduce {}, all_gather {}, reduce_scatter {}, all_to_all {}, broadcast {}, "
      "send {}, recv {}, barrier {}",
      c.all_reduce, c.all_gather, c.reduce_scatter, c.all_to_all, c.broadcast, c.send, c.recv,
      c.barrier);
}

TEST(CheckpointSave, DistributedOptimizerSaveCommunicatesOnlyItsProtocolAndStreams) {
  if (g_rt.world_size != 8) GTEST_SKIP() << "TP 2 x EP 2 x EDP 2 needs 8 ranks";
  const cli::TrainFlags f = flags();
  parallel::ParallelConfig pc = f.parallel;
  pc.timeout_minutes = 2.0;  // a deadlock ends with a diagnostic, not a ctest timeout
  parallel::ProcessGroups groups =
      parallel::init_process_groups(pc, g_rt, cli::model_dims(f.model));
  ASSERT_EQ(groups.group(parallel::GroupKind::Tp).size(), 2);
  ASSERT_EQ(groups.group(parallel::GroupKind::ExptTp).size(), 2);
  ASSERT_EQ(groups.group(parallel::GroupKind::Ep).size(), 2);
  ASSERT_EQ(groups.group(parallel::GroupKind::ExptDp).size(), 2);
  ASSERT_EQ(groups.group(parallel::GroupKind::DpCp).size(), 4);
  parallel::Communicator& world = groups.world().communicator();

  train::Trainer trainer(f.model, f.train, &groups);
  std::ostringstream log;
  ASSERT_EQ(trainer.run(log).size(), 1u);
  const int64_t own = trainer.optimizer().state_bytes(MemKind::OptimizerState);

  // One scratch directory for the job: rank 0 names it, every rank learns it.
  std::vector<int32_t> pid = {g_rt.rank == 0 ? static_cast<int32_t>(::getpid()) : 0};
  world.all_reduce(pid, parallel::ReduceOp::Max);
  const fs::path save = fs::temp_directory_path() / fmt::format("moecore_save_mpi.{}", pid[0]);

  const bool measurable = peak_resets();
  const auto save_extra = [&](const fs::path& dir, bool async) {
    reset_peak();
    const int64_t rss = status_bytes("VmRSS");
    trainer.save_checkpoint(dir, true, true, async);
    if (async) trainer.finish_pending_save();
    return status_bytes("VmHWM") - rss;
  };

  // A first save brings in what any save touches once (the code and libraries of the save path,
  // MPI's shared-memory segments): the measured saves then start from the steady state.
  trainer.save_checkpoint(save / "warm", true, true, false);

  // (a) + (b), a save the step waits for.
  world.barrier();
  const auto before = calls_of(groups);
  const parallel::CommCalls world_before = world.calls();
  const parallel::CommBytesSent bytes_before = world.bytes_sent();
  const int64_t extra = save_extra(save / "sync", false);
  const auto after = calls_of(groups);
  const parallel::CommCalls w = world.calls() - world_before;
  for (const auto& [k, c] : after) {
    const parallel::CommCalls d = c - before.at(k);
    EXPECT_EQ(d.total(), 0) << "group '" << parallel::group_name(k)
                            << "' during the save: " << calls_text(d);
  }
  parallel::CommCalls protocol;
  protocol.all_reduce = kProtocolAllReduces;
  protocol.all_gather = kProtocolAllGathers;
  EXPECT_EQ(w, protocol) << "the world during the save: " << calls_text(w);
  // The protocol moves a few bytes per rank (flags, the parts' text), no tensor data.
  const int64_t moved = (world.bytes_sent() - bytes_before).total();
  EXPECT_LT(moved, 1 << 20) << "bytes the world moved during the save";

  // (b) the memory, and the same with --async-save (the step goes on meanwhile: one host copy).
  int64_t written = 0;  // the bytes this rank's shards hold
  for (const char* kind : {"model", "optim"}) {
    std::error_code ec;
    const uint64_t n = fs::file_size(
        ckpt::iteration_dir(save / "sync", 1) / ckpt::shard_name(kind, g_rt.rank), ec);
    if (!ec) written += static_cast<int64_t>(n);
  }
  world.barrier();
  const int64_t async_extra = save_extra(save / "async", true);
  const std::string line = fmt::format(
      "[save-memory] rank {}: own optimizer bytes {}, shards written {} bytes; peak extra host "
      "memory during the save: {} bytes ({:.3f} of the own optimizer bytes), with --async-save "
      "{} bytes ({:.3f} of the bytes written){}\n",
      g_rt.rank, own, written, extra, static_cast<double>(extra) / static_cast<double>(own),
      async_extra, static_cast<double>(async_extra) / static_cast<double>(written),
      measurable ? "" : " [not measured: this kernel cannot reset VmHWM]");
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);
  if (measurable) {
    EXPECT_LE(extra, kSyncExtraFraction * static_cast<double>(own)) << line;
    EXPECT_LE(async_extra, kAsyncExtraFraction * static_cast<double>(written)) << line;
  } else if (g_rt.rank == 0) {
    std::printf(
        "[save-memory] not measured: writing '5' to /proc/self/clear_refs does not reset "
        "VmHWM on this kernel\n");
  }

  // The checkpoint: every global tensor once (the manifest validates when read), the optimizer
  // state in every rank's own shard, and the two saves the same tensors.
  world.barrier();
  if (g_rt.rank == 0) {
    const ckpt::CheckpointReader r(ckpt::iteration_dir(save / "sync", 1));
    EXPECT_EQ(r.manifest().needed_version(), ckpt::kManifestVersionRanged);
    int optim_files = 0;
    for (const ckpt::ShardFile& s : r.manifest().files) {
      optim_files += s.file.rfind("optim_", 0) == 0 ? 1 : 0;
      EXPECT_GT(s.chunk_bytes, 0u) << s.file;
    }
    EXPECT_EQ(optim_files, 8);
    const ckpt::CheckpointReader a(ckpt::iteration_dir(save / "async", 1));
    EXPECT_EQ(a.manifest().files.size(), r.manifest().files.size());
    std::error_code ec;
    fs::remove_all(save, ec);
  }
  world.barrier();
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing::run_mpi_tests(argc, argv, &moecore::g_rt);
}
