// Placeholder schedule (1F1B without interleaving).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore::pipeline {

enum class Pass : uint8_t { Forward, Backward };
struct Work {
  Pass pass;
  int64_t microbatch;
  int chunk;
};
struct ScheduleConfig {
  int pp = 1, rank = 0, vp = 1;
  int64_t num_microbatches = 1;
  int64_t group_size = 0;
  bool forward_only = false;
};
void validate_schedule(const ScheduleConfig& c);
std::vector<Work> schedule(const ScheduleConfig& c);
int64_t warmup_forwards(const ScheduleConfig& c);
std::vector<int64_t> in_flight_per_chunk(const ScheduleConfig& c);
std::string format_schedule(const ScheduleConfig& c);

}  // namespace moecore::pipeline
