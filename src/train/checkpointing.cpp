// The trainer's checkpoints (docs/checkpoint_format.md): which tensors of the run state a rank
// writes (the slices it is the first holder of: dense parameters and router state on rank 0,
// each expert slice on its expert-data-parallel rank 0), the multi-rank save protocol (every
// rank writes its shards into the staging directory, rank 0 merges the ranks' descriptions into
// the manifest, publishes the directory and writes the tracker last), and the load, in which
// every rank reads its own slices from whatever slices the checkpoint holds (src/ckpt/): a
// checkpoint loads into any layout. Each step is agreed by all ranks, so a failure on one rank
// stops every rank with its message instead of leaving the others waiting.
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include <nlohmann/json.hpp>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "core/check.h"
#include "ops/memory.h"
#include "parallel/agree.h"
#include "train/checkpoint_state.h"
#include "train/trainer.h"

namespace moecore::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A tensor of the run state on this rank: its global name, dtype and shape, the slice held here
// and its address.
struct StateTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> global_shape;
  ParamSlice slice;
  DevPtr<void> data = nullptr;
  int64_t numel = 0;
  bool optim = false;  // in the optimizer shard
  bool write = false;  // this rank is the first holder of the slice
};

std::vector<int64_t> local_shape(const StateTensor& t) {
  std::vector<int64_t> s = t.global_shape;
  if (t.slice.dim >= 0) s[t.slice.dim] = t.slice.length;
  return s;
}

std::string router_state_name(const Param& weight, const char* what) {
  std::string n = weight.name();
  const std::string suffix = ".weight";
  if (n.size() > suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0)
    n.resize(n.size() - suffix.size());
  return n + "." + what;
}

bool is_optimizer_tensor(const std::string& name) {
  return name.rfind("exp_avg.", 0) == 0 || name.rfind("exp_avg_sq.", 0) == 0;
}

const json& state_value(const ckpt::Manifest& m, const char* key, const std::string& dir) {
  MOE_CHECK(m.state.contains(key), "[checkpoint] '{}': the manifest's state has no \"{}\"", dir,
            key);
  return m.state[key];
}

int64_t state_int(const ckpt::Manifest& m, const char* key, const std::string& dir) {
  const json& v = state_value(m, key, dir);
  MOE_CHECK(v.is_number_integer(), "[checkpoint] '{}': state \"{}\" is {}, not an integer", dir,
            key, v.dump());
  return v.get<int64_t>();
}

// Test hook for the crash-safety tests: MOECORE_FAULT_KILL_AFTER_SHARDS=R kills rank R with
// SIGKILL once its shards are written, before the manifest and the tracker.
void maybe_killed_after_shards(int rank) {
  const char* v = std::getenv("MOECORE_FAULT_KILL_AFTER_SHARDS");
  if (v != nullptr && *v != '\0' && std::atoi(v) == rank) ::raise(SIGKILL);
}

// Every tensor of the run state on this rank: the parameters, their AdamW moments, the routers'
// balancing state.
template <typename T>
std::vector<StateTensor> state_tensors(model::GPTModel<T>& model, optim::ChainedOptimizer& opt,
                                       const parallel::ProcessGroups* groups) {
  const int rank = groups ? groups->rank() : 0;
  const int edp_rank = groups ? groups->group(parallel::GroupKind::ExptDp).rank : 0;
  std::vector<StateTensor> out;
  for (const Param& p : model.params().params()) {
    const bool first = p.spec.kind == ParamKind::Dense ? rank == 0 : edp_rank == 0;
    const auto add = [&](std::string name, DType dtype, DevPtr<void> data, bool optim) {
      out.push_back({std::move(name), dtype, p.spec.global_shape, p.spec.slice, data,
                     p.local_numel(), optim, first});
    };
    add(p.name(), p.dtype, p.data, false);
    add("exp_avg." + p.name(), DType::F32, DevPtr<void>(opt.exp_avg(p)), true);
    add("exp_avg_sq." + p.name(), DType::F32, DevPtr<void>(opt.exp_avg_sq(p)), true);
  }
  for (moe::Router<T>* r : model.routers()) {
    const int64_t E = r->config().num_experts;
    const auto add = [&](const char* what, DevPtr<float> data) {
      out.push_back({router_state_name(r->weight(), what),
                     DType::F32,
                     {E},
                     {},
                     DevPtr<void>(data),
                     E,
                     false,
                     rank == 0});
    };
    if (r->config().enable_expert_bias) add("expert_bias", r->expert_bias());
    if (r->config().uses(LoadBalancing::QuantileBalancing))
      add("quantile_beta", r->quantile_beta());
  }
  return out;
}

parallel::Communicator* world_comm(const parallel::ProcessGroups* groups) {
  if (groups == nullptr || groups->world_size() == 1) return nullptr;
  return &groups->world().communicator();
}

}  // namespace

template <typename T>
void BasicTrainer<T>::save_checkpoint(const fs::path& save, bool save_optim, bool save_rng) {
  parallel::Communicator* world = world_comm(groups_);
  const int rank = groups_ ? groups_->rank() : 0;
  const int world_size = groups_ ? groups_->world_size() : 1;
  const Exec& ex = exec_;
  const fs::path staging = ckpt::staging_dir(save, iteration_);

  // 1. Rank 0 makes the staging directory (a leftover of an interrupted save goes first).
  parallel::run_on_all_ranks(world, [&] {
    if (rank != 0) return;
    fs::create_directories(save);
    fs::remove_all(staging);
    fs::create_directories(staging);
    ckpt::fsync_dir(save);
  });

  // 2. Every rank writes its shards and describes them.
  std::string part;
  parallel::run_on_all_ranks(world, [&] {
    ckpt::Manifest m;
    m.iteration = iteration_;
    m.world_size = world_size;
    ckpt::SafetensorsWriter shard[2];  // model, optimizer
    const std::string file[2] = {ckpt::shard_name("model", rank), ckpt::shard_name("optim", rank)};
    for (const StateTensor& t : state_tensors(*model_, *optimizer_, groups_)) {
      if (!t.write || (t.optim && !save_optim)) continue;
      std::vector<std::byte> bytes(static_cast<size_t>(t.numel) * dtype_size(t.dtype));
      ops::read_back<std::byte>(ex, bytes.data(), dev_ptr_cast<const std::byte>(t.data),
                                static_cast<int64_t>(bytes.size()));
      const std::string dtype(ckpt::safetensors_dtype(t.dtype));
      shard[t.optim].add(t.name, dtype, local_shape(t), bytes);
      ckpt::SliceRef slice{file[t.optim]};
      if (t.slice.dim >= 0) slice = {file[t.optim], t.slice.dim, t.slice.offset, t.slice.length};
      m.tensors.push_back({t.name, dtype, t.global_shape, {slice}});
    }
    for (int k = 0; k < 2; ++k) {
      shard[k].set_metadata("format", "moecore");
      shard[k].set_metadata("format_version", std::to_string(ckpt::kManifestVersion));
      shard[k].set_metadata("iteration", std::to_string(iteration_));
      shard[k].set_metadata("rank", std::to_string(rank));
      if (shard[k].num_tensors() > 0)
        m.files.push_back(ckpt::write_shard(staging, file[k], rank, shard[k]));
    }
    part = m.to_json_text();
  });
  maybe_killed_after_shards(rank);
  const std::vector<std::string> parts =
      world ? parallel::all_gather_strings(*world, part) : std::vector<std::string>{part};

  // 3. Rank 0: the manifest (the ranks' parts merged; validate_manifest in write_manifest proves
  // every global tensor is covered exactly once), the directory published, the tracker last.
  parallel::run_on_all_ranks(world, [&] {
    if (rank != 0) return;
    std::vector<ckpt::Manifest> ms;
    for (size_t r = 0; r < parts.size(); ++r)
      ms.push_back(ckpt::parse_manifest_part(parts[r], fmt::format("rank {}'s shards", r)));
    ckpt::Manifest m = ckpt::merge_manifest_parts(ms, staging.string());
    m.layout = {{"dp", dp_size_},
                {"ep", groups_ ? groups_->group(parallel::GroupKind::Ep).size() : 1},
                {"expt_dp", groups_ ? groups_->group(parallel::GroupKind::ExptDp).size() : 1}};
    m.state = {{"iteration", iteration_},
               {"optimizer_steps", optimizer_->steps_taken()},
               {"has_optimizer", save_optim},
               {"consumed_train_samples", consumed_train_samples()},
               {"consumed_valid_samples", consumed_valid_samples()},
               {"model", model_signature(model_cfg_)}};
    if (save_rng) {
      const std::vector<moe::Router<T>*> routers = model_->routers();
      m.state["rng"] = {
          {"seed", cfg_.seed},
          {"router_jitter_step",
           routers.empty() ? optimizer_->steps_taken() : routers.front()->steps_finished()}};
    }
    ckpt::write_manifest(staging, m);
    ckpt::publish_iteration_dir(staging, ckpt::iteration_dir(save, iteration_));
    ckpt::write_tracker(save, iteration_);
  });
}

template <typename T>
std::optional<int64_t> BasicTrainer<T>::load_checkpoint(const fs::path& load,
                                                        const LoadOptions& opt) {
  std::optional<int64_t> loaded;
  parallel::run_on_all_ranks(world_comm(groups_), [&] {
    MOE_CHECK(!fs::exists(load / ckpt::kManifestFile),
              "[checkpoint] --load '{}' is one iteration's directory: give the directory above it "
              "(the --save directory), with --ckpt-step N for an iteration other than the latest",
              load.string());
    loaded = opt.iteration >= 0 ? std::optional<int64_t>(opt.iteration) : ckpt::read_tracker(load);
    if (!loaded.has_value()) return;
    ckpt::CheckpointReader reader(ckpt::iteration_dir(load, *loaded), ckpt::HashCheck::OnOpen);
    const ckpt::Manifest& m = reader.manifest();
    const std::string dir = reader.dir().string();
    MOE_CHECK(m.iteration == *loaded, "[checkpoint] '{}' holds iteration {}, not {}", dir,
              m.iteration, *loaded);
    check_same_model(state_value(m, "model", dir), model_signature(model_cfg_), dir);
    const bool optim = opt.optim && !opt.finetune;
    MOE_CHECK(!optim || state_value(m, "has_optimizer", dir).get<bool>(),
              "[checkpoint] '{}' was saved without the optimizer state (--no-save-optim): load "
              "it with --no-load-optim or --finetune",
              dir);

    const Exec& ex = exec_;
    std::set<std::string> read;
    for (const StateTensor& t : state_tensors(*model_, *optimizer_, groups_)) {
      if (t.optim && !optim) continue;
      const ckpt::GlobalTensor& g = reader.tensor(t.name);
      MOE_CHECK(g.shape == t.global_shape && g.dtype == ckpt::safetensors_dtype(t.dtype),
                "[checkpoint] '{}': tensor '{}' is {} {} there and {} {} in this model: a "
                "checkpoint loads only into the model that wrote it (any layout)",
                dir, t.name, g.dtype, ckpt::format_shape(g.shape), ckpt::safetensors_dtype(t.dtype),
                ckpt::format_shape(t.global_shape));
      std::vector<std::byte> bytes(static_cast<size_t>(t.numel) * dtype_size(t.dtype));
      reader.read(t.name, g.dtype, t.slice.dim, t.slice.offset, t.slice.length, bytes);
      ops::copy<std::byte>(ex, dev_ptr_cast<std::byte>(t.data), bytes.data(),
                           static_cast<int64_t>(bytes.size()));
      exec_synchronize(ex);  // `bytes` goes out of scope
      read.insert(t.name);
    }
    // Every model tensor of the checkpoint has a place here (another model fails above or here).
    std::string unused;
    int n_unused = 0;
    for (const ckpt::GlobalTensor& g : m.tensors) {
      if (is_optimizer_tensor(g.name) || read.count(g.name) > 0) continue;
      if (++n_unused <= 5) unused += (unused.empty() ? "'" : ", '") + g.name + "'";
    }
    MOE_CHECK(n_unused == 0,
              "[checkpoint] '{}': {} tensor(s) of the checkpoint have no place in this model "
              "({}{}): it was written by another model",
              dir, n_unused, unused, n_unused > 5 ? ", ..." : "");

    model_->params().refresh_bf16();
    const int64_t steps = opt.finetune ? 0 : state_int(m, "optimizer_steps", dir);
    if (optim) optimizer_->set_steps_taken(steps);
    int64_t jitter = 0;  // a fresh run's random streams
    if (!opt.finetune && opt.rng && m.state.contains("rng")) {
      const json& rng = m.state["rng"];
      MOE_CHECK(rng.contains("router_jitter_step") && rng["router_jitter_step"].is_number_integer(),
                "[checkpoint] '{}': the state's rng has no integer \"router_jitter_step\"", dir);
      jitter = rng["router_jitter_step"].get<int64_t>();
    }
    for (moe::Router<T>* r : model_->routers()) r->set_steps_finished(jitter);
    iteration_ = opt.finetune ? 0 : state_int(m, "iteration", dir);
    set_consumed_train_samples(opt.finetune ? 0 : state_int(m, "consumed_train_samples", dir));
    set_consumed_valid_samples(opt.finetune ? 0 : state_int(m, "consumed_valid_samples", dir));
  });
  return loaded;
}

template void BasicTrainer<float>::save_checkpoint(const fs::path&, bool, bool);
template void BasicTrainer<double>::save_checkpoint(const fs::path&, bool, bool);
template std::optional<int64_t> BasicTrainer<float>::load_checkpoint(const fs::path&,
                                                                     const LoadOptions&);
template std::optional<int64_t> BasicTrainer<double>::load_checkpoint(const fs::path&,
                                                                      const LoadOptions&);

}  // namespace moecore::train
