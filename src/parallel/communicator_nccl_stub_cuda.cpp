// The NCCL communicator of a build without CUDA: not available, said so.
#include "core/check.h"
#include "parallel/communicator_nccl.h"

namespace moecore::parallel {

bool nccl_built() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, const Exec&,
                                                     double) {
  MOE_FAIL("[comm] group '{}': the NCCL communicator needs the CUDA build (cmake "
           "-DMOECORE_CUDA=ON, docs/gpu.md); this build communicates through MPI only",
           bootstrap.name());
}

}  // namespace moecore::parallel
