// Backend-independent parts of the runtime: error formatting and quiet ranks.
#include <fmt/format.h>

#include <cstdlib>
#include <iostream>

#include "parallel/runtime.h"

namespace moecore::parallel {
namespace {

// The rank the launcher gave this process, for errors raised before the runtime is up.
int launcher_rank(int* world) {
  for (auto [rank_var, size_var] : {std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                    std::pair{"PMI_RANK", "PMI_SIZE"}}) {
    const char* r = std::getenv(rank_var);
    const char* s = std::getenv(size_var);
    if (r && s) {
      *world = std::atoi(s);
      return std::atoi(r);
    }
  }
  *world = 1;
  return 0;
}

}  // namespace

std::string format_rank_error(const Runtime& rt, std::string_view what) {
  int rank = rt.rank, world = rt.world_size;
  if (world <= 1) rank = launcher_rank(&world);
  if (world > 1) return fmt::format("[rank {}] error: {}", rank, what);
  return fmt::format("error: {}", what);
}

bool started_by_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    const char* s = std::getenv(v);
    if (s != nullptr && *s != '\0') return true;
  }
  return false;
}

void quiet_stdout_on_other_ranks(const Runtime& rt) {
  if (rt.rank != 0) std::cout.setstate(std::ios::badbit);
}

}  // namespace moecore::parallel
