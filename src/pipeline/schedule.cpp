// Megatron-Core's pipeline schedules (schedules.py: get_pp_rank_microbatches, get_schedule_table,
// forward_backward_pipelining_with/without_interleaving, forward_backward_no_pipelining). All
// three are one procedure: a table of forwards, a warmup of W forwards, then one forward and one
// backward per step, then the W remaining backwards; they differ in the table and in W.
#include "pipeline/schedule.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"

namespace moecore::pipeline {

namespace {

constexpr const char* kGroupFlag = "--microbatch-group-size-per-virtual-pipeline-stage";

int64_t group_of(const ScheduleConfig& c) { return c.group_size > 0 ? c.group_size : c.pp; }

}  // namespace

void validate_schedule(const ScheduleConfig& c) {
  MOE_CHECK(c.pp >= 1, "[pipeline] --pipeline-model-parallel-size {} must be >= 1", c.pp);
  MOE_CHECK(c.rank >= 0 && c.rank < c.pp, "[pipeline] pipeline rank {} outside [0, {})", c.rank,
            c.pp);
  MOE_CHECK(c.vp >= 1, "[pipeline] {} virtual stages per rank: must be >= 1", c.vp);
  MOE_CHECK(c.num_microbatches >= 1,
            "[pipeline] {} micro-batches per step: --global-batch-size / (--micro-batch-size x "
            "data-parallel size) must be >= 1",
            c.num_microbatches);
  MOE_CHECK(c.group_size >= 0, "[pipeline] {} {} must be >= 1 (or unset: the pipeline size)",
            kGroupFlag, c.group_size);
  // forward_backward_no_pipelining runs one model chunk.
  MOE_CHECK(c.vp == 1 || c.pp > 1,
            "[pipeline] {} virtual stages per rank need --pipeline-model-parallel-size > 1 (got "
            "{}): drop --num-virtual-stages-per-pipeline-rank or raise the pipeline size",
            c.vp, c.pp);
  if (c.vp == 1) return;  // the group size shapes only the interleaved schedule
  const int64_t g = group_of(c), m = c.num_microbatches;
  MOE_CHECK(g >= c.pp && g <= m,
            "[pipeline] the interleaved schedule runs {} micro-batches in a row per virtual stage "
            "({}{}), which must lie in [pp, M] = [{}, {}] (--pipeline-model-parallel-size, "
            "micro-batches per step): {}",
            g, kGroupFlag, c.group_size > 0 ? "" : ", default the pipeline size", c.pp, m,
            m < c.pp ? fmt::format("give at least {} micro-batches per step (raise "
                                   "--global-batch-size or lower --micro-batch-size)",
                                   c.pp)
                     : fmt::format("set {} between {} and {}", kGroupFlag, c.pp, m));
  const int64_t last_group = m % g;
  MOE_CHECK(last_group == 0 || last_group >= c.pp,
            "[pipeline] {} micro-batches per step in groups of {} ({}) leave a last group of {}, "
            "fewer than --pipeline-model-parallel-size {}: the pipeline would wait on its own "
            "dependencies. Make the micro-batches a multiple of {} or leave a remainder >= {}, "
            "or change {}",
            m, g, kGroupFlag, last_group, c.pp, g, c.pp, kGroupFlag);
}

std::vector<std::pair<int64_t, int>> schedule_table(int64_t num_microbatches, int vp,
                                                    int64_t group_size) {
  MOE_CHECK(num_microbatches >= 1 && vp >= 1 && group_size >= 1,
            "[pipeline] schedule table of {} micro-batches, {} chunks, groups of {}: all must be "
            ">= 1",
            num_microbatches, vp, group_size);
  std::vector<std::pair<int64_t, int>> table;
  table.reserve(static_cast<size_t>(num_microbatches) * vp);
  for (int64_t lo = 0; lo < num_microbatches; lo += group_size) {
    // Megatron's last group takes the rest (also when it is a whole group).
    const int64_t hi =
        lo + group_size >= num_microbatches ? num_microbatches : lo + group_size;
    for (int chunk = 0; chunk < vp; ++chunk) {
      for (int64_t mb = lo; mb < hi; ++mb) table.emplace_back(mb, chunk);
    }
    if (hi == num_microbatches) break;
  }
  return table;
}

int64_t warmup_forwards(const ScheduleConfig& c) {
  validate_schedule(c);
  const int64_t total = c.num_microbatches * c.vp;
  if (c.forward_only) return total;
  int64_t w = 0;
  if (c.pp == 1) {
    w = 0;  // forward_backward_no_pipelining: each forward followed by its backward
  } else if (c.vp == 1) {
    w = c.pp - c.rank - 1;
  } else {
    // Every rank first runs (vp - 1) groups ahead; earlier ranks two more per stage behind them.
    w = int64_t{c.pp - c.rank - 1} * 2 + int64_t{c.vp - 1} * group_of(c);
  }
  return std::min(w, total);
}

std::vector<Work> schedule(const ScheduleConfig& c) {
  const int64_t w = warmup_forwards(c);  // validates
  const std::vector<std::pair<int64_t, int>> table =
      schedule_table(c.num_microbatches, c.vp, c.vp == 1 ? c.num_microbatches : group_of(c));
  const int64_t total = static_cast<int64_t>(table.size());
  const auto forward = [&](int64_t k) { return Work{Pass::Forward, table[k].first, table[k].second}; };
  const auto backward = [&](int64_t k) {
    return Work{Pass::Backward, table[k].first, c.vp - 1 - table[k].second};
  };
  std::vector<Work> out;
  out.reserve(static_cast<size_t>(c.forward_only ? total : 2 * total));
  for (int64_t k = 0; k < w; ++k) out.push_back(forward(k));
  if (c.forward_only) return out;
  for (int64_t k = 0; k < total - w; ++k) {
    out.push_back(forward(w + k));
    out.push_back(backward(k));
  }
  for (int64_t k = total - w; k < total; ++k) out.push_back(backward(k));
  return out;
}

std::vector<int64_t> in_flight_per_chunk(const ScheduleConfig& c) {
  const std::vector<Work> order = schedule(c);
  if (c.forward_only) return std::vector<int64_t>(c.vp, 1);
  std::vector<int64_t> now(c.vp, 0), most(c.vp, 0);
  for (const Work& w : order) {
    if (w.pass == Pass::Forward) {
      most[w.chunk] = std::max(most[w.chunk], ++now[w.chunk]);
    } else {
      --now[w.chunk];
    }
  }
  return most;
}

int64_t recomputed_forwards(const ScheduleConfig& c) {
  if (c.forward_only) {
    validate_schedule(c);
    return 0;
  }
  const std::vector<Work> order = schedule(c);
  int64_t n = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const Work& w = order[i];
    if (w.pass != Pass::Backward) continue;
    const bool follows_own_forward = i > 0 && order[i - 1].pass == Pass::Forward &&
                                     order[i - 1].microbatch == w.microbatch &&
                                     order[i - 1].chunk == w.chunk;
    if (!follows_own_forward) ++n;
  }
  return n;
}

std::string format_schedule(const ScheduleConfig& c) {
  std::string out;
  for (const Work& w : schedule(c)) {
    if (!out.empty()) out += ' ';
    out += fmt::format("{}{}.{}", w.pass == Pass::Forward ? 'F' : 'B', w.microbatch, w.chunk);
  }
  return out;
}

}  // namespace moecore::pipeline
