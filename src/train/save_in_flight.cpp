#include "train/save_in_flight.h"

#include <fmt/format.h>

#include <vector>

#include "ckpt/checkpoint_dir.h"
#include "parallel/agree.h"

namespace moecore::train {

SaveInFlight::~SaveInFlight() {
  if (background_.joinable()) background_.join();
}

void SaveInFlight::write() {
  written_ = true;
  for (int k = 0; k < 2; ++k) {
    if (shards[k].num_tensors() == 0) continue;
    part.files.push_back(ckpt::write_shard(staging, files[k], rank, shards[k]));
    ckpt::save_kill_point(k == 0 ? "save.after_model_shard" : "save.after_optim_shard", rank);
  }
}

void SaveInFlight::start_background() {
  background_ = std::thread([this] {
    try {
      write();
    } catch (...) {
      error_ = std::current_exception();
    }
    done_.store(true);
  });
}

void SaveInFlight::finish(parallel::Communicator* world) {
  parallel::run_on_all_ranks(world, [&] {
    if (background_.joinable()) {
      background_.join();
      if (error_) std::rethrow_exception(error_);
    } else if (!written_) {
      write();  // a save the step waits for: the shards streamed from the values now
    }
  });
  ckpt::save_kill_point("save.after_shards", rank);
  const std::string text = part.to_json_text();
  const std::vector<std::string> parts =
      world ? parallel::all_gather_strings(*world, text) : std::vector<std::string>{text};
  // Rank 0: the manifest (the ranks' parts merged; validate_manifest in write_manifest proves
  // every global tensor is covered exactly once), the directory published, the tracker last.
  parallel::run_on_all_ranks(world, [&] {
    if (rank != 0) return;
    std::vector<ckpt::Manifest> ms;
    for (size_t r = 0; r < parts.size(); ++r)
      ms.push_back(ckpt::parse_manifest_part(parts[r], fmt::format("rank {}'s shards", r)));
    ckpt::Manifest m = ckpt::merge_manifest_parts(ms, staging.string());
    m.layout = head.layout;
    m.state = head.state;
    ckpt::write_manifest(staging, m);
    ckpt::save_kill_point("save.after_manifest", rank);
    ckpt::publish_iteration_dir(save, iteration);
    ckpt::save_kill_point("save.before_tracker", rank);
    ckpt::write_tracker(save, iteration);
    ckpt::save_kill_point("save.after_tracker", rank);
  });
}

}  // namespace moecore::train
