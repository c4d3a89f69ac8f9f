#include "pipeline/schedule.h"

#include <algorithm>

namespace moecore::pipeline {

void validate_schedule(const ScheduleConfig&) {}

int64_t warmup_forwards(const ScheduleConfig& c) {
  if (c.forward_only) return c.num_microbatches;
  if (c.pp == 1) return 0;
  return std::min<int64_t>(c.pp - c.rank - 1, c.num_microbatches);
}

std::vector<Work> schedule(const ScheduleConfig& c) {
  std::vector<Work> out;
  const int64_t M = c.num_microbatches;
  if (c.forward_only) {
    for (int64_t m = 0; m < M; ++m) out.push_back({Pass::Forward, m, 0});
    return out;
  }
  const int64_t w = warmup_forwards(c);
  int64_t f = 0, b = 0;
  for (; f < w; ++f) out.push_back({Pass::Forward, f, 0});
  while (f < M) {
    out.push_back({Pass::Forward, f++, 0});
    out.push_back({Pass::Backward, b++, 0});
  }
  while (b < M) out.push_back({Pass::Backward, b++, 0});
  return out;
}

std::vector<int64_t> in_flight_per_chunk(const ScheduleConfig& c) {
  std::vector<int64_t> cur(c.vp, 0), mx(c.vp, 0);
  for (const Work& w : schedule(c)) {
    cur[w.chunk] += w.pass == Pass::Forward ? 1 : -1;
    mx[w.chunk] = std::max(mx[w.chunk], cur[w.chunk]);
  }
  return mx;
}

std::string format_schedule(const ScheduleConfig&) { return ""; }

}  // namespace moecore::pipeline
