// Open MPI runtime.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "parallel/mpi_check.h"
#include "parallel/runtime.h"

namespace moecore::parallel {

bool mpi_available() { return true; }

Runtime runtime_init(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    MOE_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided),
                  "[runtime] MPI_Init_thread");
    // Errors come back as codes so MOE_CHECK_MPI can say which call on which group failed.
    MOE_CHECK_MPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN),
                  "[runtime] MPI_Comm_set_errhandler");
  }
  Runtime rt;
  MOE_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rt.rank), "[runtime] MPI_Comm_rank");
  MOE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &rt.world_size), "[runtime] MPI_Comm_size");
  return rt;
}

void runtime_finalize() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Finalize();
}

void runtime_abort(const Runtime& rt, int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (rt.world_size > 1 && inited && !finalized) {
    // Ranks failing together (the same bad flag everywhere) each get a moment to print their
    // own error before the first abort kills them.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  runtime_finalize();
  std::exit(code);
}

}  // namespace moecore::parallel
