// The NCCL communicator (the CUDA build): the Communicator of a process group whose buffers are
// device memory, its collectives run by NCCL on a stream of its own, ordered after the work the
// caller's context enqueued before the call and before what it enqueues after wait_on(). The
// NCCL calls of each collective come from the descriptors of ops/desc/nccl_desc.h (tested on the
// CPU through the NCCL interpreter); the group is bootstrapped through another communicator of
// the same members (MPI, or the local one for one rank), which carries NCCL's unique id.
//
// What differs from the MPI communicator:
// - send / recv have no tags: NCCL matches a pair's messages in the order they were posted;
// - bf16 reductions (the Communicator reduces bf16 in f32 and rounds once, NCCL would round at
//   every step) are refused until the backend's cast kernels stage them in f32;
// - a wait past the group's timeout reports the call and aborts the process, as MPI's does.
#pragma once

#include <memory>

#include "core/exec.h"
#include "parallel/communicator.h"

namespace moecore::parallel {

// Whether this build has the NCCL communicator (the CUDA build).
bool nccl_built();
// A communicator over the members of `bootstrap` on the context's device (ex: a CUDA context),
// collectives bounded by timeout_s. Throws naming what is missing in a build without CUDA.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, const Exec& ex,
                                                     double timeout_s);

}  // namespace moecore::parallel
