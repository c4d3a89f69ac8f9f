// The trainer's checkpoints: which tensors of the run state a rank writes (the slices it is the
// first holder of: dense parameters and router state on rank 0, each expert slice on its
// expert-data-parallel rank 0), the manifest from the shards' descriptions, and the load, which
// reads each local slice from whatever slices the checkpoint holds (src/ckpt/). One rank so
// far: the multi-rank protocol of docs/checkpoint_format.md is still to be built.
#include <nlohmann/json.hpp>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "core/check.h"
#include "ops/memory.h"
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

// Refuses a multi-rank layout: the protocol (barriers, the gather of the shards' descriptions
// to rank 0) is designed (docs/checkpoint_format.md) but not built and tested yet.
void check_one_rank(const parallel::ProcessGroups* groups, const char* what) {
  MOE_CHECK(groups == nullptr || groups->world_size() == 1,
            "[checkpoint] {} with {} ranks: checkpoints are implemented for one rank so far "
            "(multi-rank save and load are not yet)",
            what, groups ? groups->world_size() : 1);
}

}  // namespace

template <typename T>
void BasicTrainer<T>::save_checkpoint(const fs::path& save) {
  check_one_rank(groups_, "--save");
  const int rank = groups_ ? groups_->rank() : 0;
  const int world = groups_ ? groups_->world_size() : 1;
  const int edp_rank = groups_ ? groups_->group(parallel::GroupKind::ExptDp).rank : 0;
  const Exec& ex = exec_;
  const fs::path dir = ckpt::iteration_dir(save, iteration_);
  fs::create_directories(dir);
  ckpt::fsync_dir(save);

  // What this rank holds.
  std::vector<StateTensor> state;
  for (const Param& p : model_->params().params()) {
    const bool first = p.spec.kind == ParamKind::Dense ? rank == 0 : edp_rank == 0;
    const auto add = [&](std::string name, DType dtype, DevPtr<void> data, bool optim) {
      state.push_back({std::move(name), dtype, p.spec.global_shape, p.spec.slice, data,
                       p.local_numel(), optim, first});
    };
    add(p.name(), p.dtype, p.data, false);
    add("exp_avg." + p.name(), DType::F32, DevPtr<void>(optimizer_->exp_avg(p)), true);
    add("exp_avg_sq." + p.name(), DType::F32, DevPtr<void>(optimizer_->exp_avg_sq(p)), true);
  }
  for (moe::Router<T>* r : model_->routers()) {
    const int64_t E = r->config().num_experts;
    const auto add = [&](const char* what, DevPtr<float> data) {
      state.push_back({router_state_name(r->weight(), what),
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

  // This rank's shards, and the manifest's entries for what they hold.
  ckpt::Manifest m;
  ckpt::SafetensorsWriter shard[2];  // model, optimizer
  const std::string file[2] = {ckpt::shard_name("model", rank), ckpt::shard_name("optim", rank)};
  for (const StateTensor& t : state) {
    if (!t.write) continue;
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
    if (shard[k].num_tensors() > 0)
      m.files.push_back(ckpt::write_shard(dir, file[k], rank, shard[k]));
  }

  // The manifest, then the tracker, last.
  m.iteration = iteration_;
  m.world_size = world;
  m.layout = {{"dp", dp_size_},
              {"ep", groups_ ? groups_->group(parallel::GroupKind::Ep).size() : 1}};
  m.state = {{"iteration", iteration_},
             {"optimizer_steps", optimizer_->steps_taken()},
             {"consumed_train_samples", consumed_train_samples()},
             {"consumed_valid_samples", consumed_valid_samples()}};
  // validate_manifest (in write_manifest) proves every global tensor is covered exactly once.
  ckpt::write_manifest(dir, m);
  ckpt::write_tracker(save, iteration_);
}

template <typename T>
void BasicTrainer<T>::load_checkpoint(const fs::path& load, bool load_optim) {
  check_one_rank(groups_, "--load");
  const std::optional<int64_t> iteration = ckpt::read_tracker(load);
  MOE_CHECK(iteration.has_value(),
            "[checkpoint] --load '{}' holds no checkpoint (no {}): give the --save directory of "
            "an earlier run",
            load.string(), ckpt::kTrackerFile);
  ckpt::CheckpointReader reader(ckpt::iteration_dir(load, *iteration));
  const Exec& ex = exec_;
  const auto read_into = [&](const std::string& name, DType dtype,
                             const std::vector<int64_t>& global_shape, const ParamSlice& slice,
                             DevPtr<void> dst, int64_t numel) {
    const ckpt::GlobalTensor& g = reader.tensor(name);
    MOE_CHECK(g.shape == global_shape && g.dtype == ckpt::safetensors_dtype(dtype),
              "[checkpoint] '{}': tensor '{}' is {} {} there and {} {} in this model: a "
              "checkpoint loads only into the model that wrote it (any layout)",
              reader.dir().string(), name, g.dtype, ckpt::format_shape(g.shape),
              ckpt::safetensors_dtype(dtype), ckpt::format_shape(global_shape));
    std::vector<std::byte> bytes(static_cast<size_t>(numel) * dtype_size(dtype));
    reader.read(name, g.dtype, slice.dim, slice.offset, slice.length, bytes);
    ops::copy<std::byte>(ex, dev_ptr_cast<std::byte>(dst), bytes.data(),
                         static_cast<int64_t>(bytes.size()));
    exec_synchronize(ex);  // `bytes` goes out of scope
  };
  for (const Param& p : model_->params().params()) {
    read_into(p.name(), p.dtype, p.spec.global_shape, p.spec.slice, p.data, p.local_numel());
    if (!load_optim) continue;
    read_into("exp_avg." + p.name(), DType::F32, p.spec.global_shape, p.spec.slice,
              DevPtr<void>(optimizer_->exp_avg(p)), p.local_numel());
    read_into("exp_avg_sq." + p.name(), DType::F32, p.spec.global_shape, p.spec.slice,
              DevPtr<void>(optimizer_->exp_avg_sq(p)), p.local_numel());
  }
  const json& st = reader.manifest().state;
  const auto state_int = [&](const char* key) {
    MOE_CHECK(st.contains(key) && st[key].is_number_integer(),
              "[checkpoint] '{}': the manifest's state has no integer \"{}\"",
              reader.dir().string(), key);
    return st[key].get<int64_t>();
  };
  const int64_t steps = state_int("optimizer_steps");
  for (moe::Router<T>* r : model_->routers()) {
    const int64_t E = r->config().num_experts;
    if (r->config().enable_expert_bias) {
      read_into(router_state_name(r->weight(), "expert_bias"), DType::F32, {E}, {},
                DevPtr<void>(r->expert_bias()), E);
    }
    if (r->config().uses(LoadBalancing::QuantileBalancing)) {
      read_into(router_state_name(r->weight(), "quantile_beta"), DType::F32, {E}, {},
                DevPtr<void>(r->quantile_beta()), E);
    }
    r->set_steps_finished(steps);
  }
  model_->params().refresh_bf16();
  if (load_optim) optimizer_->set_steps_taken(steps);
  iteration_ = state_int("iteration");
  set_consumed_train_samples(state_int("consumed_train_samples"));
  set_consumed_valid_samples(state_int("consumed_valid_samples"));
}

template void BasicTrainer<float>::save_checkpoint(const fs::path&);
template void BasicTrainer<double>::save_checkpoint(const fs::path&);
template void BasicTrainer<float>::load_checkpoint(const fs::path&, bool);
template void BasicTrainer<double>::load_checkpoint(const fs::path&, bool);

}  // namespace moecore::train
