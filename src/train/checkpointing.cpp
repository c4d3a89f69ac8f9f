// The trainer's checkpoints (docs/checkpoint_format.md): which tensors of the run state a rank
// writes (train/checkpoint_state.h: without the distributed optimizer the ranks holding copies of
// a slice take turns writing it, parameter by parameter; with it every rank writes its own pieces
// of the weights and moments, and nothing is gathered; the routers' state by the ranks in turn),
// the multi-rank save protocol (every rank streams its shards into the staging directory, rank 0
// merges the ranks' descriptions into the manifest, publishes the directory and writes the
// tracker last; the protocol's agreements and the gather of the descriptions are the only
// communication), and the load, in which every rank reads its own slices from whatever slices
// the checkpoint holds (src/ckpt/): a checkpoint loads into any layout. Each step is agreed by
// all ranks, so a failure on one rank stops every rank with its message instead of leaving the
// others waiting.
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <cstring>
#include <map>
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

// A tensor of the run state on this rank, as the checkpoint holds it: its global name, dtype
// and global shape (the model's rows: checkpoint_shape), the slice it is stored as, and where
// its elements are here. `held` elements at `data` are this rank's (the local tensor, or the
// distributed optimizer's piece of it); the first `count` of them are in the checkpoint, the
// rest padding rows (ParamSpec::model_rows), zero at load.
struct StateTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> global_shape;
  ckpt::SliceRef slice;
  DevPtr<void> data = nullptr;
  int64_t held = 0;
  int64_t count = 0;
  bool optim = false;  // in the optimizer shard
  bool write = false;  // this rank writes it (writes_slice, writes_owned_pieces)
  bool read = true;    // a load fills it
  // The parameter's bf16 values when the registry holds no master (--bf16 with the distributed
  // optimizer): `data` is null; a load rounds the checkpoint's fp32 weights into them
  // (ParamRegistry::write_bf16); never written (the master pieces are).
  const Param* bf16_of = nullptr;
};

// The shape slice s of a tensor of `global` is stored as.
std::vector<int64_t> stored_shape(const std::vector<int64_t>& global, const ckpt::SliceRef& s) {
  return ckpt::GlobalTensor{"", "", global, {}}.slice_shape(s);
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

// Whether a tensor of the model is held by another pipeline stage than this rank's: a decoder
// layer of the model that this rank does not hold, the embedding tables on a rank without the
// embedding, the output layer on a rank without the loss, the final norm and the MTP depths on a
// rank without them.
template <typename T>
bool on_another_stage(const model::GPTModel<T>& model, const std::string& name) {
  const int chunks = model.num_chunks();
  const bool whole = chunks == 1 && model.chunk(0).embedding && model.chunk(0).loss;
  if (whole) return false;
  const std::string layers = "decoder.layers.";
  if (name.rfind(layers, 0) == 0) {
    int64_t l = -1;
    const size_t end = name.find('.', layers.size());
    if (end == std::string::npos) return false;
    try {
      l = std::stoll(name.substr(layers.size(), end - layers.size()));
    } catch (const std::exception&) {
      return false;
    }
    const std::vector<int64_t>& mine = model.layers();
    return l >= 0 && l < model.config().num_layers &&
           std::find(mine.begin(), mine.end(), l) == mine.end();
  }
  if (name.rfind("embedding.", 0) == 0) return !model.chunk(0).embedding;
  // The final norm is the loss's stage's, or with MTP the decoder's last layer's; the MTP depths
  // are all on one stage (with the loss or before it).
  if (name.rfind("decoder.final_layernorm.", 0) == 0) return !model.has_final_norm();
  if (name.rfind("mtp.", 0) == 0) return model.mtp() == nullptr;
  if (name.rfind("output_layer.", 0) == 0) return !model.chunk(chunks - 1).loss;
  return false;
}

HolderRanks holder_ranks(const parallel::ProcessGroups* groups) {
  HolderRanks h;
  if (groups == nullptr) return h;
  const auto at = [&](parallel::GroupKind k, int& rank, int& size) {
    rank = groups->group(k).rank;
    size = groups->group(k).size();
  };
  at(parallel::GroupKind::DpCp, h.dp_cp, h.dp_cp_size);
  at(parallel::GroupKind::Tp, h.tp, h.tp_size);
  at(parallel::GroupKind::ExptDp, h.expt_dp, h.expt_dp_size);
  at(parallel::GroupKind::ExptTp, h.expt_tp, h.expt_tp_size);
  h.ep = groups->group(parallel::GroupKind::Ep).rank;
  at(parallel::GroupKind::TpDpCp, h.world, h.world_size);  // the stage's ranks
  return h;
}

// Every tensor of the run state on this rank: the parameters, their AdamW moments, the
// routers' balancing state, with who writes each. Without the distributed optimizer the ranks
// holding identical copies of a slice take turns writing it (writes_slice). With it each rank
// writes, and reads, its own pieces of the moments and of the weights (owned_piece: flat, or
// ranged for a slice that is no run of the flattened tensor): nothing is gathered, and a load
// reads the whole local weights (a bf16 run: rounds them into its compute copy).
template <typename T>
std::vector<StateTensor> state_tensors(model::GPTModel<T>& model, optim::ChainedOptimizer& opt,
                                       const parallel::ProcessGroups* groups) {
  const HolderRanks holder = holder_ranks(groups);
  const bool sharded = opt.sharded();
  std::vector<StateTensor> out;
  std::map<const Param*, int> index;  // the parameter's position in the registry
  for (const Param& p : model.params().params()) {
    const int i = static_cast<int>(index.size());
    index[&p] = i;
    const CheckpointPiece whole = slice_piece(p.spec);
    const bool write = !sharded && writes_slice(p.spec, i, holder);
    const auto add = [&](std::string name, DType dtype, DevPtr<void> data, bool optim) {
      out.push_back({std::move(name), dtype, checkpoint_shape(p.spec), whole.slice, data,
                     p.local_numel(), whole.count, optim, write});
    };
    add(p.name(), p.dtype, p.data, false);
    if (p.data == nullptr) out.back().bf16_of = &p;
    if (sharded) continue;
    add("exp_avg." + p.name(), DType::F32, DevPtr<void>(opt.exp_avg(p)), true);
    add("exp_avg_sq." + p.name(), DType::F32, DevPtr<void>(opt.exp_avg_sq(p)), true);
  }
  if (sharded) {
    for (const optim::AdamWOptimizer* o : {&opt.dense(), &opt.expert()}) {
      for (const optim::AdamWOptimizer::Piece& pc : o->pieces()) {
        const Param& p = *pc.p;
        const int64_t begin = pc.begin - p.offset;  // in the local tensor
        const CheckpointPiece piece = owned_piece(p.spec, begin, pc.count);
        const bool write = writes_owned_pieces(p.spec, index.at(&p), holder);
        const auto add = [&](std::string name, DType dtype, DevPtr<void> data, bool optim,
                             bool read) {
          out.push_back({std::move(name), dtype, checkpoint_shape(p.spec), piece.slice, data,
                         pc.count, piece.count, optim, write, read});
        };
        add("exp_avg." + p.name(), DType::F32, DevPtr<void>(o->owned_exp_avg() + pc.owned), true,
            true);
        add("exp_avg_sq." + p.name(), DType::F32, DevPtr<void>(o->owned_exp_avg_sq() + pc.owned),
            true, true);
        if (o->holds_master()) {  // --bf16: the fp32 master weights are the optimizer's
          add(p.name(), DType::F32, DevPtr<void>(o->owned_master() + pc.owned), false, true);
        } else {  // the registry's values of the piece (the whole local tensor loads above)
          const size_t es = dtype_size(p.dtype);
          add(p.name(), p.dtype,
              DevPtr<void>(dev_ptr_cast<std::byte>(p.data) + static_cast<int64_t>(begin * es)),
              false, false);
        }
      }
    }
  }
  int k = 0;  // the routers' state tensors in order: who writes each
  for (moe::Router<T>* r : model.routers()) {
    const int64_t E = r->config().num_experts;
    const auto add = [&](const char* what, DevPtr<float> data) {
      out.push_back({router_state_name(r->weight(), what),
                     DType::F32,
                     {E},
                     ckpt::SliceRef{},
                     DevPtr<void>(data),
                     E,
                     E,
                     false,
                     writes_replicated(k++, holder)});
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

  // 2. Every rank describes what it writes (nothing is communicated: each rank writes what it
  // holds); rank 0 the run state. The shards read the values while they are written (a save
  // the step waits for: no host copy), or from one host copy made now (--async-save: the step
  // changes the values meanwhile).
  parallel::run_on_all_ranks(world, [&] {
    s->part.iteration = iteration_;
    s->part.world_size = groups_ ? groups_->world_size() : 1;
    s->files[0] = ckpt::shard_name("model", s->rank);
    s->files[1] = ckpt::shard_name("optim", s->rank);
    for (const StateTensor& t : state_tensors(*model_, *optimizer_, groups_)) {
      if (!t.write || (t.optim && !save_optim) || t.count == 0) continue;
      const std::string dtype(ckpt::safetensors_dtype(t.dtype));
      const std::string& file = s->files[t.optim];
      ckpt::SliceRef slice = t.slice;
      slice.file = file;
      const std::vector<int64_t> shape = stored_shape(t.global_shape, slice);
      const DevPtr<const std::byte> src = dev_ptr_cast<const std::byte>(t.data);
      const int64_t nbytes = t.count * static_cast<int64_t>(dtype_size(t.dtype));
      if (async) {
        const std::span<std::byte> dst = s->shards[t.optim].add_buffer(t.name, dtype, shape);
        ops::read_back<std::byte>(ex, dst.data(), src, nbytes);
      } else {
        s->shards[t.optim].add_source(
            t.name, dtype, shape, [&ex, src](uint64_t at, std::span<std::byte> dst) {
              ops::read_back<std::byte>(ex, dst.data(), src + static_cast<int64_t>(at),
                                        static_cast<int64_t>(dst.size()));
            });
      }
      s->part.tensors.push_back({t.name, dtype, t.global_shape, {slice}});
    }
    for (ckpt::SafetensorsWriter& shard : s->shards) {
      shard.set_metadata("format", "moecore");
      // The version of this rank's slices (the manifest's is the highest of the ranks').
      shard.set_metadata("format_version", std::to_string(s->part.needed_version()));
      shard.set_metadata("iteration", std::to_string(iteration_));
      shard.set_metadata("rank", std::to_string(s->rank));
    }
    const auto size_of = [&](parallel::GroupKind k) {
      return groups_ ? groups_->group(k).size() : 1;
    };
    s->head.layout = {{"dp", dp_size_},
                      {"cp", size_of(parallel::GroupKind::Cp)},
                      {"tp", size_of(parallel::GroupKind::Tp)},
                      {"ep", size_of(parallel::GroupKind::Ep)},
                      {"expt_tp", size_of(parallel::GroupKind::ExptTp)},
                      {"expt_dp", size_of(parallel::GroupKind::ExptDp)},
                      {"pp", size_of(parallel::GroupKind::Pp)}};
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
  s->finish(world);  // writes the shards (streamed from the values), then the protocol
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
    ckpt::CheckpointReader reader(ckpt::find_iteration_dir(load, *loaded), ckpt::HashCheck::OnRead);
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
    // The `held` elements of a tensor held here (padding rows zero), into their place.
    const auto store = [&](const StateTensor& t, const std::vector<std::byte>& bytes) {
      if (t.bf16_of != nullptr) {
        model_->params().write_bf16(*t.bf16_of, 0, reinterpret_cast<const float*>(bytes.data()),
                                    t.held);
        return;
      }
      ops::copy<std::byte>(ex, dev_ptr_cast<std::byte>(t.data), bytes.data(),
                           static_cast<int64_t>(bytes.size()));
      exec_synchronize(ex, "a checkpoint load's copy");  // `bytes` goes out of scope
    };
    std::set<std::string> read;
    for (const StateTensor& t : state_tensors(*model_, *optimizer_, groups_)) {
      if (!t.read || (t.optim && !optim)) continue;
      const size_t es = dtype_size(t.dtype);
      if (up && m.find(t.name) == nullptr) {
        // Upcycling: each local expert a copy of the dense MLP of its layer; the routers keep
        // their initialization (with top-k probabilities that sum to 1 the layer's output is the
        // dense MLP's).
        const size_t e = t.name.find(".mlp.experts.linear_fc");
        if (e == std::string::npos) continue;  // a router's weight or balancing state
        const std::string dense = t.name.substr(0, e) + ".mlp." + t.name.substr(e + 13);
        const ckpt::GlobalTensor& g = reader.tensor(dense);
        const std::vector<int64_t> want(t.global_shape.begin() + 1, t.global_shape.end());
        const ckpt::SliceRef& sl = t.slice;
        MOE_CHECK(sl.flat() || (!sl.ranged() && sl.dim <= 0 && sl.parts == 1 && !sl.second.split()),
                  "[checkpoint] '{}': upcycling '{}' into a slice split along dimension {} ({} "
                  "parts{}) is not supported: upcycle at expert tensor parallel size 1 and "
                  "reshard the upcycled checkpoint",
                  dir, t.name, sl.dim, sl.parts,
                  sl.second.split() ? ", and a second dimension" : "");
        MOE_CHECK(g.shape == want && g.dtype == ckpt::safetensors_dtype(t.dtype) &&
                      (sl.dim == 0 || sl.flat()),
                  "[checkpoint] '{}': the dense '{}' is {} {}; upcycling '{}' needs {} {}", dir,
                  dense, g.dtype, ckpt::format_shape(g.shape), t.name,
                  ckpt::safetensors_dtype(t.dtype), ckpt::format_shape(want));
        const int64_t per_expert = g.numel();  // g.shape == want
        std::vector<std::byte> one(static_cast<size_t>(per_expert) * es);
        reader.read(dense, g.dtype, -1, 0, 0, one);
        // Element i of the held run is element (start + i) mod per_expert of the dense tensor.
        const int64_t start = sl.flat() ? sl.offset : 0;
        std::vector<std::byte> bytes(static_cast<size_t>(t.held) * es);
        for (int64_t i = 0; i < t.held; ++i) {
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
      // Zero-filled: the padding rows past the checkpoint's (ParamSpec::model_rows) stay zero.
      std::vector<std::byte> bytes(static_cast<size_t>(t.held) * es);
      if (t.count > 0) {
        reader.read(t.name, g.dtype, t.slice,
                    std::span<std::byte>(bytes).first(static_cast<size_t>(t.count) * es));
      }
      store(t, bytes);
      read.insert(t.name);
    }
    // Every model tensor of the checkpoint has a place here (another model fails above or here):
    // on this pipeline stage, or on another that holds its layer, the embedding or the loss (which
    // checks it there).
    std::string unused;
    int n_unused = 0;
    for (const ckpt::GlobalTensor& g : m.tensors) {
      if (is_optimizer_tensor(g.name) || read.count(g.name) > 0) continue;
      if (on_another_stage(*model_, g.name)) continue;
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
