// The distributed runtime: one process per device. With MOECORE_MPI the processes come from
// mpirun and talk through Open MPI; without it, a stub that runs one process and refuses to
// start under a multi-process launcher.
#pragma once

#include <string>

namespace moecore::parallel {

struct Runtime {
  int rank = 0;
  int world_size = 1;
};

bool mpi_available();
// Initializes MPI when built with it (idempotent); checks the launch matches the build.
Runtime runtime_init(int* argc, char*** argv);
void runtime_finalize();

}  // namespace moecore::parallel
