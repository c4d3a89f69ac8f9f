// Open MPI runtime.
#include <mpi.h>

#include "core/check.h"
#include "parallel/runtime.h"

namespace moecore::parallel {

bool mpi_available() { return true; }

Runtime runtime_init(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    MOE_CHECK(rc == MPI_SUCCESS, "[runtime] MPI_Init_thread failed with code {}", rc);
  }
  Runtime rt;
  MPI_Comm_rank(MPI_COMM_WORLD, &rt.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &rt.world_size);
  return rt;
}

void runtime_finalize() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Finalize();
}

}  // namespace moecore::parallel
