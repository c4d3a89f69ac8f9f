// The trainer's checkpoints (docs/checkpoint_format.md): which tensors of the run state a rank
// writes (the slices it is the first holder of, train/checkpoint_state.h's first_holder: dense
// slices on dense data-parallel rank 0, each expert slice on its expert-data-parallel rank 0,
// one TP rank for a slice replicated over TP; router state on rank 0), the multi-rank save
// protocol (every
// rank writes its shards into the staging directory, rank 0 merges the ranks' descriptions into
// the manifest, publishes the directory and writes the tracker last), and the load, in which
// every rank reads its own slices from whatever slices the checkpoint holds (src/ckpt/): a
// checkpoint loads into any layout. Each step is agreed by all ranks, so a failure on one rank
// stops every rank with its message instead of leaving the others waiting.
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "core/check.h"
#include "ops/memory.h"
#include "parallel/agree.h"
#include "train/checkpoint_state.h"
#include "train/save_in_flight.h"
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
  // The slice is elements [slice.offset, slice.offset + slice.length) of the flattened tensor
  // (the distributed optimizer's piece of a moment, or of the fp32 master weights it holds).
  bool flat = false;
  // The parameter's bf16 values when the registry holds no master (--bf16 with the distributed
  // optimizer): `data` is null; a load rounds the checkpoint's fp32 weights into them
  // (ParamRegistry::write_bf16); never written (the master pieces are).
  const Param* bf16_of = nullptr;
  // The distributed optimizer's pieces of a slice that is not one run of the flattened tensor
  // (ParamSlice::contiguous() false: tensor parallelism's slices): `data` is null; the save
  // assembles the whole local slice over the data-parallel group that shards it (`group`, null
  // on one rank) from each rank's owned pieces, and the load takes this rank's pieces out of it.
  struct Owned {
    int64_t local = 0;  // the piece's first element in the local tensor
    int64_t count = 0;
    DevPtr<float> data = nullptr;
  };
  bool assembled = false;
  std::vector<Owned> owned{};
  parallel::Communicator* group = nullptr;
};

std::vector<int64_t> local_shape(const StateTensor& t) {
  if (t.flat) return {t.numel};
  return slice_shape(t.global_shape, t.slice);
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

// Where parameter p's local elements start in its global tensor flattened in row-major order:
// its slice of dimension 0 (or the whole tensor) is one contiguous run of it.
int64_t flat_base(const Param& p) {
  if (p.spec.slice.dim < 0) return 0;
  MOE_CHECK(p.spec.slice.contiguous(),
            "[checkpoint] '{}' is split along dimension {} ({} parts{}): not one run of the "
            "flattened tensor, so it has no flat pieces (its pieces are assembled instead)",
            p.name(), p.spec.slice.dim, p.spec.slice.parts,
            p.spec.slice.second.split() ? ", and a second dimension" : "");
  int64_t per_index = 1;
  for (size_t d = 1; d < p.spec.global_shape.size(); ++d) per_index *= p.spec.global_shape[d];
  return p.spec.slice.offset * per_index;
}

// Every tensor of the run state on this rank: the parameters, their AdamW moments, the
// routers' balancing state. With the distributed optimizer each rank holds, and writes, the
// moments of its own pieces only, as flat slices: nothing is gathered.
template <typename T>
std::vector<StateTensor> state_tensors(model::GPTModel<T>& model, optim::ChainedOptimizer& opt,
                                       const parallel::ProcessGroups* groups) {
  const int rank = groups ? groups->rank() : 0;
  HolderRanks holder;
  if (groups != nullptr) {
    holder = {groups->group(parallel::GroupKind::DpCp).rank,
              groups->group(parallel::GroupKind::Tp).rank,
              groups->group(parallel::GroupKind::ExptDp).rank,
              groups->group(parallel::GroupKind::ExptTp).rank};
  }
  std::vector<StateTensor> out;
  for (const Param& p : model.params().params()) {
    const bool first = first_holder(p.spec, holder);
    const auto add = [&](std::string name, DType dtype, DevPtr<void> data, bool optim) {
      out.push_back({std::move(name), dtype, p.spec.global_shape, p.spec.slice, data,
                     p.local_numel(), optim, first});
    };
    if (p.data != nullptr) {
      add(p.name(), p.dtype, p.data, false);
    } else {
      add(p.name(), p.dtype, nullptr, false);
      out.back().write = false;
      out.back().bf16_of = &p;
    }
    if (opt.sharded()) continue;
    add("exp_avg." + p.name(), DType::F32, DevPtr<void>(opt.exp_avg(p)), true);
    add("exp_avg_sq." + p.name(), DType::F32, DevPtr<void>(opt.exp_avg_sq(p)), true);
  }
  if (opt.sharded()) {
    for (const optim::AdamWOptimizer* o : {&opt.dense(), &opt.expert()}) {
      const ParamKind kind = o == &opt.dense() ? ParamKind::Dense : ParamKind::Expert;
      for (const optim::AdamWOptimizer::Piece& pc : o->pieces()) {
        const Param& p = *pc.p;
        if (!p.spec.slice.contiguous()) continue;  // assembled below
        const ParamSlice flat{-1, flat_base(p) + (pc.begin - p.offset), pc.count};
        // Every rank of the data-parallel group writes its own pieces; of a TP-replicated
        // parameter only TP rank 0's group does (the other TP ranks hold the same pieces).
        const bool write = tp_first_holder(p.spec, holder);
        const auto add = [&](std::string name, DevPtr<float> moment) {
          out.push_back({std::move(name), DType::F32, p.spec.global_shape, flat,
                         DevPtr<void>(moment + pc.owned), pc.count, true, write, true});
        };
        add("exp_avg." + p.name(), o->owned_exp_avg());
        add("exp_avg_sq." + p.name(), o->owned_exp_avg_sq());
        if (o->holds_master()) {  // the weights: every rank writes its pieces of them
          out.push_back({p.name(), DType::F32, p.spec.global_shape, flat,
                         DevPtr<void>(o->owned_master() + pc.owned), pc.count, false, write,
                         true});
        }
      }
      // A slice that is no run of the flattened tensor: every rank of the group that shards the
      // kind takes part, holding a piece of it or not, in registry order.
      parallel::Communicator* group = nullptr;
      if (groups != nullptr) {
        const parallel::ProcessGroup& g = groups->group(
            kind == ParamKind::Dense ? parallel::GroupKind::DpCp : parallel::GroupKind::ExptDp);
        if (g.size() > 1) group = &g.communicator();
      }
      for (const Param& p : model.params().params()) {
        if (p.spec.kind != kind || p.spec.slice.contiguous()) continue;
        const auto add = [&](std::string name, DevPtr<float> base, bool optim) {
          StateTensor t{std::move(name), DType::F32, p.spec.global_shape, p.spec.slice, nullptr,
                        p.local_numel(), optim, first_holder(p.spec, holder)};
          t.assembled = true;
          t.group = group;
          for (const optim::AdamWOptimizer::Piece& pc : o->pieces()) {
            if (pc.p == &p) t.owned.push_back({pc.begin - p.offset, pc.count, base + pc.owned});
          }
          out.push_back(std::move(t));
        };
        add("exp_avg." + p.name(), o->owned_exp_avg(), true);
        add("exp_avg_sq." + p.name(), o->owned_exp_avg_sq(), true);
        if (o->holds_master()) add(p.name(), o->owned_master(), false);
      }
    }
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

}  // namespace

template <typename T>
parallel::Communicator* BasicTrainer<T>::world_comm() const {
  if (groups_ == nullptr || groups_->world_size() == 1) return nullptr;
  return &groups_->world().communicator();
}

template <typename T>
void BasicTrainer<T>::save_checkpoint(const fs::path& save, bool save_optim, bool save_rng,
                                      bool async) {
  finish_pending_save();  // one save at a time
  buckets_->wait_params();  // --overlap-param-gather: the weights saved are whole
  parallel::Communicator* world = world_comm();
  auto s = std::make_unique<SaveInFlight>();
  s->save = save;
  s->staging = ckpt::staging_dir(save, iteration_);
  s->iteration = iteration_;
  s->rank = groups_ ? groups_->rank() : 0;
  const Exec& ex = exec_;

  // 1. Rank 0 makes the staging directory (a leftover of an interrupted save goes first).
  parallel::run_on_all_ranks(world, [&] {
    if (s->rank == 0) ckpt::begin_staging(save, iteration_);
  });

  // 2. Every rank copies what it writes to host memory and describes it; rank 0 the run state.
  parallel::run_on_all_ranks(world, [&] {
    s->part.iteration = iteration_;
    s->part.world_size = groups_ ? groups_->world_size() : 1;
    s->files[0] = ckpt::shard_name("model", s->rank);
    s->files[1] = ckpt::shard_name("optim", s->rank);
    for (const StateTensor& t : state_tensors(*model_, *optimizer_, groups_)) {
      if (t.optim && !save_optim) continue;
      std::vector<std::byte> bytes;
      if (t.assembled) {
        // The whole local slice from the group's pieces (exact: assembly_buffer).
        std::vector<float> local = assembly_buffer(t.numel);
        for (const StateTensor::Owned& o : t.owned) {
          ops::read_back<float>(ex, local.data() + o.local, o.data, o.count);
        }
        if (t.group != nullptr) t.group->all_reduce(local, parallel::ReduceOp::Sum);
        if (!t.write) continue;
        const auto b = std::as_bytes(std::span<const float>(local));
        bytes.assign(b.begin(), b.end());
      } else {
        if (!t.write) continue;
        bytes.resize(static_cast<size_t>(t.numel) * dtype_size(t.dtype));
        ops::read_back<std::byte>(ex, bytes.data(), dev_ptr_cast<const std::byte>(t.data),
                                  static_cast<int64_t>(bytes.size()));
      }
      const std::string dtype(ckpt::safetensors_dtype(t.dtype));
      const std::string& file = s->files[t.optim];
      s->shards[t.optim].add(t.name, dtype, local_shape(t), bytes);
      const ckpt::SliceRef slice =
          t.flat ? ckpt::SliceRef{file, ckpt::SliceRef::kFlat, t.slice.offset, t.slice.length}
                 : checkpoint_slice(t.slice, file);
      s->part.tensors.push_back({t.name, dtype, t.global_shape, {slice}});
    }
    for (ckpt::SafetensorsWriter& shard : s->shards) {
      shard.set_metadata("format", "moecore");
      // The version of this rank's slices (the manifest's is the highest of the ranks').
      shard.set_metadata("format_version", std::to_string(s->part.needed_version()));
      shard.set_metadata("iteration", std::to_string(iteration_));
      shard.set_metadata("rank", std::to_string(s->rank));
    }
    s->head.layout = {
        {"dp", dp_size_},
        {"ep", groups_ ? groups_->group(parallel::GroupKind::Ep).size() : 1},
        {"expt_dp", groups_ ? groups_->group(parallel::GroupKind::ExptDp).size() : 1}};
    s->head.state = {{"iteration", iteration_},
                     {"optimizer_steps", optimizer_->steps_taken()},
                     {"has_optimizer", save_optim},
                     {"consumed_train_samples", consumed_train_samples()},
                     {"consumed_valid_samples", consumed_valid_samples()},
                     {"model", model_signature(model_cfg_)},
                     {"args", cfg_.ckpt.run_args}};
    if (save_rng) {
      const std::vector<moe::Router<T>*> routers = model_->routers();
      s->head.state["rng"] = {
          {"seed", cfg_.seed},
          {"router_jitter_step",
           routers.empty() ? optimizer_->steps_taken() : routers.front()->steps_finished()}};
    }
  });

  // 3. The shards, now or in the background; then the manifest and the tracker.
  if (async) {
    s->start_background();
    pending_save_ = std::move(s);
    return;
  }
  s->write();
  s->finish(world);
}

template <typename T>
int64_t BasicTrainer<T>::finish_pending_save(bool only_if_written) {
  if (!pending_save_) return -1;
  parallel::Communicator* world = world_comm();
  if (only_if_written) {
    // Every rank must be done writing, or every rank waits for the next poll.
    std::vector<int64_t> written{pending_save_->written() ? 1 : 0};
    if (world) world->all_reduce(written, parallel::ReduceOp::Sum);
    if (written[0] < (world ? world->size() : 1)) return -1;
  }
  const int64_t it = pending_save_->iteration;
  std::unique_ptr<SaveInFlight> s = std::move(pending_save_);
  s->finish(world);
  return it;
}

template <typename T>
void BasicTrainer<T>::recover_checkpoint_dirs(std::ostream& log) {
  const CheckpointConfig& ck = cfg_.ckpt;
  std::vector<std::string> dirs;
  for (const std::string& d : {ck.load, ck.save}) {
    if (!d.empty() && std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  }
  for (const std::string& d : dirs) {
    std::string did;
    // Rank 0 alone changes the directory; the others read it only after this agreement.
    parallel::run_on_all_ranks(world_comm(), [&] {
      if (groups_ == nullptr || groups_->rank() == 0) did = ckpt::recover_checkpoint_dir(d);
    });
    if (logging_rank() && !did.empty()) {
      fmt::print(log, "[checkpoint] recovered: {}: {}\n", d, did);
      log.flush();
    }
  }
}

template <typename T>
std::optional<int64_t> BasicTrainer<T>::load_checkpoint(const fs::path& load,
                                                        const LoadOptions& opt) {
  std::optional<int64_t> loaded;
  buckets_->wait_params();  // a pending gather would overwrite the loaded values
  parallel::run_on_all_ranks(world_comm(), [&] {
    std::error_code ec;
    MOE_CHECK(!fs::exists(load / ckpt::kManifestFile, ec),
              "[checkpoint] --load '{}' is one iteration's directory: give the directory above it "
              "(the --save directory), with --ckpt-step N for an iteration other than the latest",
              load.string());
    loaded = opt.iteration >= 0 ? std::optional<int64_t>(opt.iteration) : ckpt::read_tracker(load);
    if (!loaded.has_value()) return;
    ckpt::CheckpointReader reader(ckpt::find_iteration_dir(load, *loaded),
                                  ckpt::HashCheck::OnOpen);
    const ckpt::Manifest& m = reader.manifest();
    const std::string dir = reader.dir().string();
    MOE_CHECK(m.iteration == *loaded, "[checkpoint] '{}' holds iteration {}, not {}", dir,
              m.iteration, *loaded);
    json saved = state_value(m, "model", dir), mine = model_signature(model_cfg_);
    const bool up = opt.upcycle;
    if (up) {
      MOE_CHECK(saved.value("--num-experts", 0) == 0,
                "[checkpoint] --moe-use-upcycling loads a dense checkpoint; '{}' has {} experts: "
                "load it without --moe-use-upcycling",
                dir, saved.value("--num-experts", 0));
      MOE_CHECK(model_cfg_.num_experts > 0 && model_cfg_.moe.ffn_hidden == model_cfg_.ffn_hidden &&
                    model_cfg_.moe.shared_ffn_hidden == 0,
                "[checkpoint] --moe-use-upcycling makes each expert a copy of the dense MLP: it "
                "needs --num-experts > 0, --moe-ffn-hidden-size = --ffn-hidden-size ({} and {} "
                "here) and no shared expert",
                model_cfg_.moe.ffn_hidden, model_cfg_.ffn_hidden);
      for (const char* k : {"--num-experts", "--moe-ffn-hidden-size", "--moe-layer-freq",
                            "--moe-shared-expert-intermediate-size"}) {
        saved.erase(k);
        mine.erase(k);
      }
    }
    check_same_model(saved, mine, dir);
    const bool optim = opt.optim && !opt.finetune && !up;
    MOE_CHECK(!optim || state_value(m, "has_optimizer", dir).get<bool>(),
              "[checkpoint] '{}' was saved without the optimizer state (--no-save-optim): load "
              "it with --no-load-optim or --finetune",
              dir);

    const Exec& ex = exec_;
    // The bytes of a tensor's slice held here, into its place.
    const auto store = [&](const StateTensor& t, const std::vector<std::byte>& bytes) {
      if (t.assembled) {  // this rank's pieces of the local slice
        for (const StateTensor::Owned& o : t.owned) {
          ops::copy<float>(ex, o.data, reinterpret_cast<const float*>(bytes.data()) + o.local,
                           o.count);
        }
        exec_synchronize(ex);
        return;
      }
      if (t.bf16_of != nullptr) {
        model_->params().write_bf16(*t.bf16_of, 0, reinterpret_cast<const float*>(bytes.data()),
                                    t.numel);
        return;
      }
      ops::copy<std::byte>(ex, dev_ptr_cast<std::byte>(t.data), bytes.data(),
                           static_cast<int64_t>(bytes.size()));
      exec_synchronize(ex);  // `bytes` goes out of scope
    };
    std::set<std::string> read;
    for (const StateTensor& t : state_tensors(*model_, *optimizer_, groups_)) {
      if (t.optim && !optim) continue;
      if (up && m.find(t.name) == nullptr) {
        // Upcycling: each local expert a copy of the dense MLP of its layer; the routers keep
        // their initialization (with top-k probabilities that sum to 1 the layer's output is the
        // dense MLP's).
        const size_t e = t.name.find(".mlp.experts.linear_fc");
        if (e == std::string::npos) continue;  // a router's weight or balancing state
        const std::string dense = t.name.substr(0, e) + ".mlp." + t.name.substr(e + 13);
        const ckpt::GlobalTensor& g = reader.tensor(dense);
        const std::vector<int64_t> want(t.global_shape.begin() + 1, t.global_shape.end());
        MOE_CHECK(t.flat || t.slice.contiguous(),
                  "[checkpoint] '{}': upcycling '{}' into a slice split along dimension {} ({} "
                  "parts{}) is not supported: upcycle at expert tensor parallel size 1 and "
                  "reshard the upcycled checkpoint",
                  dir, t.name, t.slice.dim, t.slice.parts,
                  t.slice.second.split() ? ", and a second dimension" : "");
        MOE_CHECK(g.shape == want && g.dtype == ckpt::safetensors_dtype(t.dtype) &&
                      (t.slice.dim == 0 || t.flat),
                  "[checkpoint] '{}': the dense '{}' is {} {}; upcycling '{}' needs {} {}", dir,
                  dense, g.dtype, ckpt::format_shape(g.shape), t.name,
                  ckpt::safetensors_dtype(t.dtype), ckpt::format_shape(want));
        int64_t per_expert = 1;
        for (int64_t d : want) per_expert *= d;
        const size_t es = dtype_size(t.dtype);
        std::vector<std::byte> one(static_cast<size_t>(per_expert) * es);
        reader.read(dense, g.dtype, -1, 0, 0, one);
        // Element i of the held run is element (start + i) mod per_expert of the dense tensor.
        const int64_t start = t.flat ? t.slice.offset : 0;
        std::vector<std::byte> bytes(static_cast<size_t>(t.numel) * es);
        for (int64_t i = 0; i < t.numel; ++i) {
          std::memcpy(bytes.data() + i * es, one.data() + ((start + i) % per_expert) * es, es);
        }
        store(t, bytes);
        read.insert(dense);
        continue;
      }
      const ckpt::GlobalTensor& g = reader.tensor(t.name);
      MOE_CHECK(g.shape == t.global_shape && g.dtype == ckpt::safetensors_dtype(t.dtype),
                "[checkpoint] '{}': tensor '{}' is {} {} there and {} {} in this model: a "
                "checkpoint loads only into the model that wrote it (any layout)",
                dir, t.name, g.dtype, ckpt::format_shape(g.shape), ckpt::safetensors_dtype(t.dtype),
                ckpt::format_shape(t.global_shape));
      std::vector<std::byte> bytes(static_cast<size_t>(t.numel) * dtype_size(t.dtype));
      if (t.flat)
        reader.read_flat(t.name, g.dtype, t.slice.offset, t.slice.length, bytes);
      else
        reader.read(t.name, g.dtype, checkpoint_slice(t.slice), bytes);
      store(t, bytes);
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

    model_->params().refresh_bf16();  // from the master values (or, without them here, the
                                      // f32 copies of the bf16 values just written)
    const bool fresh = opt.finetune || up;  // a new run from the checkpoint's weights
    const int64_t steps = fresh ? 0 : state_int(m, "optimizer_steps", dir);
    if (optim) optimizer_->set_steps_taken(steps);
    int64_t jitter = 0;  // a fresh run's random streams
    if (!fresh && opt.rng && m.state.contains("rng")) {
      const json& rng = m.state["rng"];
      MOE_CHECK(rng.contains("router_jitter_step") && rng["router_jitter_step"].is_number_integer(),
                "[checkpoint] '{}': the state's rng has no integer \"router_jitter_step\"", dir);
      jitter = rng["router_jitter_step"].get<int64_t>();
    }
    for (moe::Router<T>* r : model_->routers()) r->set_steps_finished(jitter);
    iteration_ = fresh ? 0 : state_int(m, "iteration", dir);
    set_consumed_train_samples(fresh ? 0 : state_int(m, "consumed_train_samples", dir));
    set_consumed_valid_samples(fresh ? 0 : state_int(m, "consumed_valid_samples", dir));
  });
  return loaded;
}

template void BasicTrainer<float>::save_checkpoint(const fs::path&, bool, bool, bool);
template void BasicTrainer<double>::save_checkpoint(const fs::path&, bool, bool, bool);
template void BasicTrainer<float>::recover_checkpoint_dirs(std::ostream&);
template void BasicTrainer<double>::recover_checkpoint_dirs(std::ostream&);
template parallel::Communicator* BasicTrainer<float>::world_comm() const;
template parallel::Communicator* BasicTrainer<double>::world_comm() const;
template int64_t BasicTrainer<float>::finish_pending_save(bool);
template int64_t BasicTrainer<double>::finish_pending_save(bool);
template std::optional<int64_t> BasicTrainer<float>::load_checkpoint(const fs::path&,
                                                                     const LoadOptions&);
template std::optional<int64_t> BasicTrainer<double>::load_checkpoint(const fs::path&,
                                                                      const LoadOptions&);

}  // namespace moecore::train
