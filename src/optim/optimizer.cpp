// AdamW over a parameter registry (all parameters or one kind): moments planned in an arena, the
// gradient sum of squares for the global norm, Megatron's clip coefficient, and the update.
#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/check.h"
#include "core/profiler.h"
#include "ops/adamw.h"
#include "ops/grad_clip.h"
#include "ops/memory.h"
#include "ops/sum_squares.h"

namespace moecore::optim {

void AdamWConfig::validate() const {
  MOE_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
            "[optimizer] --adam-beta1={} and --adam-beta2={} must be in [0, 1)", beta1, beta2);
  MOE_CHECK(eps > 0, "[optimizer] --adam-eps={} must be > 0", eps);
  MOE_CHECK(weight_decay >= 0, "[optimizer] --weight-decay={} must be >= 0", weight_decay);
  MOE_CHECK(clip_grad >= 0, "[optimizer] --clip-grad={} must be >= 0", clip_grad);
}

void grad_sum_squares(const ParamRegistry& params, ParamKind k, DevPtr<double> out) {
  if (params.dtype() == DType::F32) {
    ops::sum_squares(params.exec(), out, dev_ptr_cast<const float>(params.flat_grad(k)),
                     params.numel(k));
  } else {
    ops::sum_squares(params.exec(), out, dev_ptr_cast<const double>(params.flat_grad(k)),
                     params.numel(k));
  }
}

double global_grad_norm(const ParamRegistry& params) {
  MOE_CHECK(params.exec().on_cpu(), "[optimizer] global_grad_norm reads host memory");
  double s = 0;
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    double part = 0;
    grad_sum_squares(params, k, &part);  // the CPU backend's ops write host memory
    s += part;
  }
  return std::sqrt(s);
}

void OptimizerStepBuffers::layout(Arena& a) {
  step = a.alloc<ops::AdamWStep>(1, "optimizer.step", MemKind::State);
  sum_sq = a.alloc<double>(2, "optimizer.grad_sum_sq", MemKind::State);
  norm = a.alloc<double>(1, "optimizer.grad_norm", MemKind::State);
}

void OptimizerStepBuffers::write_inputs(const Exec& ex, double lr, int64_t step_number) {
  // The one upload of a step besides its token ids.
  lr_host_ = lr;
  step_host_ = step_number;
  ops::copy<double>(ex, member_ptr(step, &ops::AdamWStep::lr), &lr_host_, 1);
  ops::copy<int64_t>(ex, member_ptr(step, &ops::AdamWStep::step), &step_host_, 1);
}

StepInfo read_step_info(const Exec& ex, const OptimizerStepBuffers& b, double max_norm) {
  const ops::AdamWStep s = ops::read_value<ops::AdamWStep>(ex, b.step);
  const double norm = ops::read_value<double>(ex, b.norm);
  // Clipping scales a finite norm down; it cannot repair a NaN or an overflow, so the advice
  // names it only when it is off.
  MOE_CHECK(std::isfinite(norm),
            "[optimizer] gradient norm is {} at step {}: {} (the update was skipped: the weights "
            "are those before this step){}",
            norm, s.step,
            max_norm > 0 ? fmt::format("lower --lr (clipping at --clip-grad={} cannot scale a "
                                       "non-finite norm)",
                                       max_norm)
                         : std::string("lower --lr or enable --clip-grad"),
            std::isnan(norm) ? "; --check-for-nan-in-loss-and-grad (on by default) names the "
                               "rank and the parameter"
                             : "");
  StepInfo info;
  info.grad_norm = norm;
  info.clip_coeff = s.grad_scale;
  info.skipped = s.skip != 0;
  return info;
}

AdamWOptimizer::AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg)
    : params_(params), cfg_(cfg), arena_(params.exec()), step_arena_(params.exec()) {
  plan();
}

AdamWOptimizer::AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg, ParamKind only)
    : params_(params),
      cfg_(cfg),
      all_kinds_(false),
      only_(only),
      arena_(params.exec()),
      step_arena_(params.exec()) {
  plan();
}

AdamWOptimizer::AdamWOptimizer(ParamRegistry& params, const AdamWConfig& cfg, ParamKind only,
                               const ShardedState& sharded)
    : params_(params),
      cfg_(cfg),
      all_kinds_(false),
      only_(only),
      arena_(params.exec()),
      step_arena_(params.exec()),
      sharded_(sharded) {
  plan_pieces();
  plan();
  if (master_) init_master(sharded.seed);
}

void AdamWOptimizer::init_master(uint64_t seed) {
  // The f32 initial values the registry's bf16 values were rounded from (the same function).
  std::vector<float> host;
  for (const Piece& pc : pieces_) {
    host.resize(static_cast<size_t>(pc.count));
    param_init_f32(*pc.p, seed, pc.begin - pc.p->offset, host.data(), pc.count);
    ops::copy<float>(arena_.exec(), w_ + pc.owned, host.data(), pc.count);
    exec_synchronize(arena_.exec());  // `host` is reused
  }
}

uint64_t AdamWOptimizer::owned_master_digest(
    const std::function<bool(const Param&)>& counted) const {
  MOE_CHECK(master_, "[optimizer] no master weights here: they are the registry's");
  uint64_t total = 0;
  std::vector<float> host;
  for (const Piece& pc : pieces_) {
    if (counted && !counted(*pc.p)) continue;
    host.resize(static_cast<size_t>(pc.count));
    ops::read_back<float>(arena_.exec(), host.data(), w_ + pc.owned, pc.count);
    total += param_digest_f32(*pc.p, pc.begin - pc.p->offset, host.data(), pc.count);
  }
  return total;
}

void AdamWOptimizer::plan_pieces() {
  const int k = static_cast<int>(only_);
  std::vector<OwnedRange> ranges = sharded_->ranges[k];
  std::sort(ranges.begin(), ranges.end(),
            [](const OwnedRange& a, const OwnedRange& b) { return a.begin < b.begin; });
  int64_t covered = 0;
  for (Param& p : params_.params()) {
    if (p.spec.kind != only_) continue;
    const int64_t lo = p.offset, hi = p.offset + p.local_numel();
    // The first range ending after the parameter's start; ranges do not overlap.
    auto it = std::upper_bound(ranges.begin(), ranges.end(), lo, [](int64_t x, const OwnedRange& r) {
      return x < r.begin + r.count;
    });
    for (; it != ranges.end() && it->begin < hi; ++it) {
      const int64_t b = std::max(lo, it->begin), e = std::min(hi, it->begin + it->count);
      if (b >= e) continue;
      pieces_.push_back(Piece{&p, b, e - b, it->owned + (b - it->begin)});
      covered += e - b;
    }
  }
  for (const OwnedRange& r : ranges) {
    if (r.count > 0) owned_flat_.push_back(ops::ElemRange{r.begin, r.count});
  }
  MOE_CHECK(covered == sharded_->owned_numel[k],
            "[optimizer] the owned ranges cover {} of the {} owned {} elements: they do not lie "
            "inside the parameters",
            covered, sharded_->owned_numel[k], k == 0 ? "dense" : "expert");
}

void adamw_state_layout(Arena& a, const int64_t numel[2], DevPtr<float> m[2], DevPtr<float> v[2],
                        int64_t master_numel, DevPtr<float>* master) {
  for (int k = 0; k < 2; ++k) {
    m[k] = a.alloc<float>(numel[k], "adam.m", MemKind::OptimizerState);
    v[k] = a.alloc<float>(numel[k], "adam.v", MemKind::OptimizerState);
  }
  // Megatron counts the fp32 main weights as optimizer state.
  if (master_numel > 0) *master = a.alloc<float>(master_numel, "adam.master", MemKind::OptimizerState);
}

void AdamWOptimizer::plan() {
  cfg_.validate();
  // Planned for both kinds; a one-kind optimizer leaves the other's state empty.
  int64_t n[2];
  for (int k = 0; k < 2; ++k) {
    n[k] = !covers(static_cast<ParamKind>(k)) ? 0
           : sharded_ ? sharded_->owned_numel[k]
                      : params_.numel(static_cast<ParamKind>(k));
  }
  master_ = sharded_ && !params_.holds_master();
  MOE_CHECK(sharded_ || params_.holds_master(),
            "[optimizer] the registry holds no master weights: only the distributed optimizer "
            "keeps them (in its shards)");
  const int64_t owned = master_ ? sharded_->owned_numel[static_cast<int>(only_)] : 0;
  arena_.plan([this, &n, owned](Arena& a) { adamw_state_layout(a, n, m_, v_, owned, &w_); });
  step_arena_.plan([this](Arena& a) { buf_.layout(a); });
}

template <typename T>
void AdamWOptimizer::update_typed(DevPtr<const ops::AdamWStep> s) {
  auto adamw_params = [this](const Param& p) {
    ops::AdamWParams a;
    a.beta1 = cfg_.beta1;
    a.beta2 = cfg_.beta2;
    a.eps = cfg_.eps;
    a.weight_decay = p.spec.weight_decay ? cfg_.weight_decay : 0.0;
    return a;
  };
  if (sharded_) {
    // The summed gradients of the owned elements lie where the elements do (the in-place
    // reduce-scatter); the moments (and the master weights this optimizer holds) are packed in
    // the owned layout. Master weights here: the owned elements' bf16 values are written in
    // the same pass, and the gathers move those (their f32 copies, values32, follow each
    // gather: refresh_bf16). Master weights in the registry: the gathers move them.
    const int k = static_cast<int>(only_);
    for (const Piece& pc : pieces_) {
      const Param& p = *pc.p;
      const int64_t at = pc.begin - p.offset;
      if (master_) {
        if constexpr (std::is_same_v<T, float>) {
          ops::adamw_step(arena_.exec(), w_ + pc.owned, p.grad_as<T>() + at, m_[k] + pc.owned,
                          v_[k] + pc.owned, pc.count, adamw_params(p), s,
                          p.data16 ? p.data16 + at : nullptr,
                          p.values32 ? p.values32 + at : nullptr);
        }
        continue;
      }
      ops::adamw_step(arena_.exec(), p.data_as<T>() + at, p.grad_as<T>() + at, m_[k] + pc.owned,
                      v_[k] + pc.owned, pc.count, adamw_params(p), s);
    }
    return;
  }
  for (Param& p : params_.params()) {
    if (!covers(p.spec.kind)) continue;
    const int k = static_cast<int>(p.spec.kind);
    const ops::AdamWParams a = adamw_params(p);
    // --bf16: the compute copy is written in the same pass, so refresh_bf16 can skip it.
    // (values32: the f32 copy of the bf16 values, data16w on the widened path.)
    DevPtr<bf16> p16 = std::is_same_v<T, float> ? p.data16 : nullptr;
    DevPtr<float> p16w = std::is_same_v<T, float> ? p.values32 : nullptr;
    ops::adamw_step(arena_.exec(), p.data_as<T>(), p.grad_as<T>(), m_[k] + p.offset,
                    v_[k] + p.offset, p.local_numel(), a, s, p16, p16w);
  }
  if (std::is_same_v<T, float> && params_.has_bf16_copies()) {
    for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
      if (covers(k)) params_.mark_bf16_current(k);
    }
  }
}

void AdamWOptimizer::count_only(const std::function<bool(const Param&)>& counted) {
  for (int k = 0; k < 2; ++k) counted_[k].reset();
  if (!counted) return;
  bool skips[2] = {false, false};
  for (const Param& p : params_.params()) {
    if (covers(p.spec.kind) && !counted(p)) skips[static_cast<int>(p.spec.kind)] = true;
  }
  // The covered elements of each counted parameter: all of it, or its owned piece.
  std::vector<ops::ElemRange> pieces[2];
  if (sharded_) {
    for (const Piece& pc : pieces_) {
      if (counted(*pc.p)) pieces[static_cast<int>(only_)].push_back({pc.begin, pc.count});
    }
  } else {
    for (const Param& p : params_.params()) {
      if (covers(p.spec.kind) && counted(p) && p.local_numel() > 0) {
        pieces[static_cast<int>(p.spec.kind)].push_back({p.offset, p.local_numel()});
      }
    }
  }
  for (int k = 0; k < 2; ++k) {
    if (!skips[k]) continue;
    std::sort(pieces[k].begin(), pieces[k].end(),
              [](const ops::ElemRange& a, const ops::ElemRange& b) { return a.begin < b.begin; });
    std::vector<ops::ElemRange> merged;
    for (const ops::ElemRange& r : pieces[k]) {
      if (!merged.empty() && merged.back().begin + merged.back().count == r.begin) {
        merged.back().count += r.count;
      } else {
        merged.push_back(r);
      }
    }
    counted_[k] = std::move(merged);
  }
}

void AdamWOptimizer::grad_sum_squares(DevPtr<double> sum_sq) const {
  bool restricted = false;
  for (int k = 0; k < 2; ++k) restricted |= covers(static_cast<ParamKind>(k)) && counted_[k];
  if (restricted) {
    // count_only: the counted ranges of each covered kind (a kind with none: an exact 0).
    for (int k = 0; k < 2; ++k) {
      const ParamKind kind = static_cast<ParamKind>(k);
      if (!covers(kind)) continue;
      const std::vector<ops::ElemRange>* rs = counted_[k] ? &*counted_[k]
                                              : sharded_  ? &owned_flat_
                                                          : nullptr;
      if (rs == nullptr) {
        optim::grad_sum_squares(params_, kind, sum_sq + k);
        continue;
      }
      const int64_t nr = static_cast<int64_t>(rs->size());
      if (params_.dtype() == DType::F32) {
        ops::sum_squares_ranges(params_.exec(), sum_sq + k,
                                dev_ptr_cast<const float>(params_.flat_grad(kind)), rs->data(), nr);
      } else {
        ops::sum_squares_ranges(params_.exec(), sum_sq + k,
                                dev_ptr_cast<const double>(params_.flat_grad(kind)), rs->data(),
                                nr);
      }
    }
    return;
  }
  if (sharded_) {
    // This rank's owned elements only, so that the group's sum counts each once: one sum over
    // the owned ranges of the flat gradient buffer, in flat order (each range blocked as
    // sum_squares blocks a buffer, the range sums added in order: ops::sum_squares_ranges).
    const int k = static_cast<int>(only_);
    const ParamKind kind = static_cast<ParamKind>(k);
    const int64_t nr = static_cast<int64_t>(owned_flat_.size());
    if (params_.dtype() == DType::F32) {
      ops::sum_squares_ranges(params_.exec(), sum_sq + k,
                              dev_ptr_cast<const float>(params_.flat_grad(kind)),
                              owned_flat_.data(), nr);
    } else {
      ops::sum_squares_ranges(params_.exec(), sum_sq + k,
                              dev_ptr_cast<const double>(params_.flat_grad(kind)),
                              owned_flat_.data(), nr);
    }
    return;
  }
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    if (covers(k)) optim::grad_sum_squares(params_, k, sum_sq + static_cast<int>(k));
  }
}

void AdamWOptimizer::update(DevPtr<const ops::AdamWStep> s) {
  ++step_;
  if (params_.dtype() == DType::F32)
    update_typed<float>(s);
  else
    update_typed<double>(s);
}

void AdamWOptimizer::set_steps_taken(int64_t n) {
  MOE_CHECK(n >= 0, "[optimizer] {} steps taken < 0", n);
  step_ = n;
}

DevPtr<float> AdamWOptimizer::exp_avg(const Param& p) const {
  MOE_CHECK(!sharded_, "[optimizer] '{}': this rank holds pieces of its moments only "
            "(--use-distributed-optimizer)", p.name());
  MOE_CHECK(covers(p.spec.kind), "[optimizer] '{}' is not updated by this optimizer", p.name());
  return m_[static_cast<int>(p.spec.kind)] + p.offset;
}

DevPtr<float> AdamWOptimizer::exp_avg_sq(const Param& p) const {
  MOE_CHECK(!sharded_, "[optimizer] '{}': this rank holds pieces of its moments only "
            "(--use-distributed-optimizer)", p.name());
  MOE_CHECK(covers(p.spec.kind), "[optimizer] '{}' is not updated by this optimizer", p.name());
  return v_[static_cast<int>(p.spec.kind)] + p.offset;
}

DevPtr<float> AdamWOptimizer::owned_exp_avg() const {
  MOE_CHECK(sharded_, "[optimizer] owned moments: not the distributed optimizer");
  return m_[static_cast<int>(only_)];
}

DevPtr<float> AdamWOptimizer::owned_exp_avg_sq() const {
  MOE_CHECK(sharded_, "[optimizer] owned moments: not the distributed optimizer");
  return v_[static_cast<int>(only_)];
}

void AdamWOptimizer::apply(double lr) {
  MOE_CHECK(!sharded_, "[optimizer] a sharded AdamW steps inside a ChainedOptimizer, which sums "
            "its norm over the group");
  ScopedPhase phase(Phase::Optimizer);
  buf_.write_inputs(step_arena_.exec(), lr, step_ + 1);
  // A kind this optimizer does not cover adds an exact 0 (the sum of no squares): the norm is
  // (0 + dense) + expert as always.
  for (ParamKind k : {ParamKind::Dense, ParamKind::Expert}) {
    DevPtr<double> out = buf_.sum_sq + static_cast<int>(k);
    if (covers(k))
      optim::grad_sum_squares(params_, k, out);
    else
      ops::sum_squares(step_arena_.exec(), out, DevPtr<const double>(nullptr), 0);
  }
  ops::grad_clip(step_arena_.exec(), buf_.norm, buf_.step, buf_.sum_sq, 2, cfg_.clip_grad);
  update(buf_.step);
}

}  // namespace moecore::optim
