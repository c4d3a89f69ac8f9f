// Built without MOECORE_MPI: a single process. Being launched by mpirun with several ranks is an
// error, not N copies of the same single-rank job.
#include <cstdio>
#include <cstdlib>

#include "core/check.h"
#include "parallel/runtime.h"

namespace moecore::parallel {

bool mpi_available() { return false; }

Runtime runtime_init(int*, char***) {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const char* v = std::getenv(var);
    MOE_CHECK(v == nullptr || std::atoi(v) <= 1,
              "[runtime] launched with {}={} but this moecore was built without MPI "
              "(unavailable): rebuild with -DMOECORE_MPI=ON",
              var, v ? v : "");
  }
  return Runtime{};
}

void runtime_finalize() {}

void runtime_abort(const Runtime&, int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::exit(code);
}

void runtime_exit_without_finalize(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

}  // namespace moecore::parallel
