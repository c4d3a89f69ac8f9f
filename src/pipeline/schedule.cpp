// Megatron-Core's pipeline schedules (schedules.py: get_pp_rank_microbatches, get_schedule_table,
// forward_backward_pipelining_with/without_interleaving, forward_backward_no_pipelining). All
// three are one procedure: a table of forwards, a warmup of W forwards, then one forward and one
// backward per step, then the W remaining backwards; they differ in the table and in W.
#include "pipeline/schedule.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "pipeline/lockstep.h"

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

std::vector<Message> messages_sent(const ScheduleConfig& c, int sender, int receiver) {
  ScheduleConfig s = c;
  s.rank = sender;
  const std::vector<Work> order = schedule(s);  // validates
  std::vector<Message> out;
  const int last = c.pp - 1;
  for (const Work& w : order) {
    if (w.pass == Pass::Forward) {
      if (sender == last && w.chunk == c.vp - 1) continue;  // the loss
      // The last rank's chunk c feeds the first rank's chunk c + 1.
      if ((sender + 1) % c.pp == receiver)
        out.push_back(Message{false, w.microbatch, sender == last ? w.chunk + 1 : w.chunk});
    } else {
      if (sender == 0 && w.chunk == 0) continue;  // the embedding
      if ((sender + c.pp - 1) % c.pp == receiver)
        out.push_back(Message{true, w.microbatch, sender == 0 ? w.chunk - 1 : w.chunk});
    }
  }
  return out;
}

namespace {
// The lowest free slot of a pool (grown by one when all are taken), marked taken.
int take_slot(std::vector<char>& taken) {
  const auto it = std::find(taken.begin(), taken.end(), 0);
  const auto slot = static_cast<int>(it - taken.begin());
  if (it == taken.end()) {
    taken.push_back(1);
  } else {
    *it = 1;
  }
  return slot;
}
}  // namespace

RecvPlan recv_plan(const ScheduleConfig& c) {
  const std::vector<Work> order = schedule(c);  // validates
  const size_t n = order.size();
  RecvPlan p;
  p.first.assign(1, 0);
  p.input_slot.assign(n, -1);
  p.grad_slot.assign(n, -1);
  p.stash_slots.assign(c.vp, 0);
  if (c.pp == 1) {
    p.first.assign(n + 1, 0);
    return p;
  }
  // The senders: the previous rank's activations, the next rank's gradients (with pp 2 both
  // the other rank, in one sequence).
  struct Sender {
    int rank;
    std::vector<Message> sent;
    size_t posted = 0;
  };
  const int prev = (c.rank + c.pp - 1) % c.pp, next = (c.rank + 1) % c.pp;
  std::vector<Sender> senders;
  senders.push_back(Sender{prev, messages_sent(c, prev, c.rank)});
  if (next != prev) senders.push_back(Sender{next, messages_sent(c, next, c.rank)});
  const auto sender_of = [&](int rank) -> Sender& { return rank == prev ? senders[0] : senders.back(); };
  // Per chunk and micro-batch, the slot holding its activation / its output's gradient (-1: none).
  const size_t m = static_cast<size_t>(c.num_microbatches);
  std::vector<std::vector<int>> stash_of(c.vp, std::vector<int>(m, -1)), grad_of = stash_of;
  std::vector<std::vector<char>> stash_taken(c.vp);
  std::vector<char> grad_taken;
  // Posts the receive step j reads (if not yet posted) and every earlier one of its sender.
  const auto post_through = [&](size_t j) {
    const Work& w = order[j];
    const auto mb = static_cast<size_t>(w.microbatch);
    const bool first_stage = c.rank == 0 && w.chunk == 0;
    const bool last_stage = c.rank == c.pp - 1 && w.chunk == c.vp - 1;
    const bool reads = w.pass == Pass::Forward ? !first_stage : !last_stage;
    std::vector<std::vector<int>>& held = w.pass == Pass::Forward ? stash_of : grad_of;
    if (!reads || held[w.chunk][mb] >= 0) return;
    Sender& s = sender_of(w.pass == Pass::Forward ? prev : next);
    const Message want{w.pass == Pass::Backward, w.microbatch, w.chunk};
    const auto it = std::find(s.sent.begin() + static_cast<ptrdiff_t>(s.posted), s.sent.end(), want);
    MOE_CHECK(it != s.sent.end(),
              "[pipeline] internal: pp rank {} reads micro-batch {}'s {} of chunk {} that pp "
              "rank {} does not send it",
              c.rank, w.microbatch, want.gradient ? "gradient" : "activation", w.chunk, s.rank);
    const auto upto = static_cast<size_t>(it - s.sent.begin());
    for (; s.posted <= upto; ++s.posted) {
      const Message& msg = s.sent[s.posted];
      const auto at = static_cast<size_t>(msg.microbatch);
      int& slot = (msg.gradient ? grad_of : stash_of)[msg.chunk][at];
      MOE_CHECK(slot < 0, "[pipeline] internal: micro-batch {}'s {} of chunk {} received twice",
                msg.microbatch, msg.gradient ? "gradient" : "activation", msg.chunk);
      slot = take_slot(msg.gradient ? grad_taken : stash_taken[msg.chunk]);
      p.posts.push_back(RecvPost{msg, s.rank, slot});
    }
  };
  // The interleaved schedule: the lockstep rounds' receives, each round's group before its step.
  std::vector<Round> rounds;
  if (c.vp > 1) rounds = lockstep_rounds(c);
  size_t next_round = 0;
  const auto take_rounds_before = [&](size_t i) {
    for (; next_round < rounds.size() && rounds[next_round].before == i; ++next_round) {
      const Round& r = rounds[next_round];
      Exchange e{r.before, r.sends, p.posts.size(), 0};
      for (const auto& [msg, from] : r.recvs) {
        const auto at = static_cast<size_t>(msg.microbatch);
        int& slot = (msg.gradient ? grad_of : stash_of)[msg.chunk][at];
        MOE_CHECK(slot < 0, "[pipeline] internal: micro-batch {}'s {} of chunk {} received twice",
                  msg.microbatch, msg.gradient ? "gradient" : "activation", msg.chunk);
        slot = take_slot(msg.gradient ? grad_taken : stash_taken[msg.chunk]);
        p.posts.push_back(RecvPost{msg, from, slot});
      }
      e.end_post = p.posts.size();
      p.exchanges.push_back(std::move(e));
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const Work& w = order[i];
    const auto mb = static_cast<size_t>(w.microbatch);
    const bool first_stage = c.rank == 0 && w.chunk == 0;
    const bool last_stage = c.rank == c.pp - 1 && w.chunk == c.vp - 1;
    if (c.vp > 1) {
      take_rounds_before(i);
    } else {
      post_through(i);
    }
    p.first.push_back(p.posts.size());
    if (!first_stage) p.input_slot[i] = stash_of[w.chunk][mb];
    if (w.pass == Pass::Backward && !last_stage) p.grad_slot[i] = grad_of[w.chunk][mb];
    MOE_CHECK(first_stage || p.input_slot[i] >= 0,
              "[pipeline] internal: pp rank {} runs micro-batch {} of chunk {} without its input",
              c.rank, w.microbatch, w.chunk);
    MOE_CHECK(w.pass == Pass::Forward || last_stage || p.grad_slot[i] >= 0,
              "[pipeline] internal: pp rank {} runs the backward of micro-batch {} of chunk {} "
              "without its output's gradient",
              c.rank, w.microbatch, w.chunk);
    // The slots the step read are free after it: the activation once no backward needs it.
    const auto release = [](int& slot, std::vector<char>& taken) {
      if (slot >= 0) taken[static_cast<size_t>(slot)] = 0;
      slot = -1;
    };
    if (w.pass == Pass::Backward || c.forward_only) {
      release(stash_of[w.chunk][mb], stash_taken[w.chunk]);
    }
    if (w.pass == Pass::Backward) release(grad_of[w.chunk][mb], grad_taken);
  }
  // The last outputs' sends (nothing is received after the last step: every message is read).
  const size_t posted = p.posts.size();
  take_rounds_before(n);
  MOE_CHECK(next_round == rounds.size() && p.posts.size() == posted,
            "[pipeline] internal: pp rank {} receives after its last step", c.rank);
  for (int ch = 0; ch < c.vp; ++ch)
    p.stash_slots[ch] = static_cast<int64_t>(stash_taken[ch].size());
  p.grad_slots = static_cast<int64_t>(grad_taken.size());
  return p;
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
