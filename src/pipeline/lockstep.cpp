#include "pipeline/lockstep.h"

#include <algorithm>
#include <cstdint>

#include "core/check.h"

namespace moecore::pipeline {

std::vector<std::pair<size_t, size_t>> iterations(const ScheduleConfig& c) {
  const auto w = static_cast<size_t>(warmup_forwards(c));  // validates
  const size_t n = schedule(c).size();
  std::vector<std::pair<size_t, size_t>> out;
  size_t i = 0;
  for (; i < w; ++i) out.emplace_back(i, 1);
  // The steady state alternates one forward and one backward (schedule()); the cool-down is the
  // last w backwards.
  const size_t steady_end = c.forward_only ? n : n - w;
  for (; i < steady_end; i += 2) out.emplace_back(i, 2);
  for (; i < n; ++i) out.emplace_back(i, 1);
  return out;
}

namespace {

// A step's messages: the forward's activation to the next rank (not from the loss's chunk),
// the backward's input gradient to the previous one (not from the embedding's).
struct Sent {
  int to;
  Message msg;
};
std::vector<Sent> sent_by(const ScheduleConfig& c, int rank, const Work& w) {
  if (w.pass == Pass::Forward) {
    if (rank == c.pp - 1 && w.chunk == c.vp - 1) return {};
    return {Sent{(rank + 1) % c.pp,
                 Message{false, w.microbatch, rank == c.pp - 1 ? w.chunk + 1 : w.chunk}}};
  }
  if (rank == 0 && w.chunk == 0) return {};
  return {Sent{(rank + c.pp - 1) % c.pp,
               Message{true, w.microbatch, rank == 0 ? w.chunk - 1 : w.chunk}}};
}

// The message a step reads (false: none, the embedding's forward or the loss's backward).
bool read_by(const ScheduleConfig& c, int rank, const Work& w, Message* m) {
  const bool first = rank == 0 && w.chunk == 0, last = rank == c.pp - 1 && w.chunk == c.vp - 1;
  if (w.pass == Pass::Forward ? first : last) return false;
  *m = Message{w.pass == Pass::Backward, w.microbatch, w.chunk};
  return true;
}

}  // namespace

std::vector<Round> lockstep_rounds(const ScheduleConfig& c) {
  MOE_CHECK(c.pp > 1 && c.vp > 1,
            "[pipeline] internal: lockstep rounds are the interleaved schedule's (pp {}, vp {})",
            c.pp, c.vp);
  struct Rank {
    std::vector<Work> order;
    std::vector<std::pair<size_t, size_t>> its;
    size_t next = 0;                // the next iteration
    std::vector<size_t> pending;    // the last iteration's steps: their outputs go next round
    std::vector<Message> received;  // everything received so far
  };
  std::vector<Rank> ranks(c.pp);
  for (int r = 0; r < c.pp; ++r) {
    ScheduleConfig s = c;
    s.rank = r;
    ranks[r].order = schedule(s);
    ranks[r].its = iterations(s);
  }
  const Rank& me = ranks[c.rank];
  std::vector<Round> out;
  // Every iteration runs in its own round, and a rank waits only while a message it reads is
  // still to be sent: the schedule finishes (AllRanksTogetherNeverDeadlock) in at most as many
  // rounds as all ranks' iterations plus the sends after them.
  size_t bound = 1;
  for (const Rank& r : ranks) bound += 2 * r.its.size();
  for (size_t t = 0;; ++t) {
    MOE_CHECK(t <= bound,
              "[pipeline] internal: the lockstep rounds of pp {} vp {} M {} (groups of {}) do not "
              "finish within {} rounds",
              c.pp, c.vp, c.num_microbatches, c.group_size, bound);
    // The exchange: every rank's last outputs to its neighbours, received in this round.
    Round round;
    round.before = me.next < me.its.size() ? me.its[me.next].first : me.order.size();
    for (size_t s : me.pending) {
      if (!sent_by(c, c.rank, me.order[s]).empty()) round.sends.push_back(s);
    }
    std::vector<std::pair<Message, int>> activations, gradients;
    bool any = false;
    for (int r = 0; r < c.pp; ++r) {
      for (size_t s : ranks[r].pending) {
        for (const Sent& m : sent_by(c, r, ranks[r].order[s])) {
          any = true;
          ranks[m.to].received.push_back(m.msg);
          if (m.to == c.rank) (m.msg.gradient ? gradients : activations).emplace_back(m.msg, r);
        }
      }
      ranks[r].pending.clear();
    }
    round.recvs = std::move(activations);
    round.recvs.insert(round.recvs.end(), gradients.begin(), gradients.end());
    if (!round.sends.empty() || !round.recvs.empty()) out.push_back(std::move(round));
    // The compute: each rank runs its next iteration once everything it reads is in.
    bool done = true, ran = false;
    for (int r = 0; r < c.pp; ++r) {
      Rank& k = ranks[r];
      if (k.next == k.its.size()) continue;
      done = false;
      const auto [first, count] = k.its[k.next];
      bool ready = true;
      for (size_t s = first; s < first + count && ready; ++s) {
        Message m;
        ready = !read_by(c, r, k.order[s], &m) ||
                std::find(k.received.begin(), k.received.end(), m) != k.received.end();
      }
      if (!ready) continue;
      for (size_t s = first; s < first + count; ++s) k.pending.push_back(s);
      ++k.next;
      ran = true;
    }
    bool pending = false;
    for (const Rank& r : ranks) pending = pending || !r.pending.empty();
    if (done && !pending) break;
    MOE_CHECK(ran || any,
              "[pipeline] internal: the lockstep rounds of pp {} vp {} M {} (groups of {}) stall "
              "in round {}: no rank can run its next iteration",
              c.pp, c.vp, c.num_microbatches, c.group_size, t);
  }
  return out;
}

}  // namespace moecore::pipeline
