// The NCCL communicator (the CUDA build): the Communicator of a process group whose buffers are
// device memory, its collectives run by NCCL on a stream of its own, ordered after the work the
// caller's context enqueued before the call and before what it enqueues after wait_on(). The
// NCCL calls of each collective come from the descriptors of ops/desc/nccl_desc.h (tested on the
// CPU through the NCCL interpreter); the group is bootstrapped through another communicator of
// the same members (MPI, or the local one for one rank), which carries NCCL's unique id.
//
// What differs from the MPI communicator:
// - every buffer is device memory of the context's device (not pinned, not the host's);
// - send / recv have no tags: NCCL matches a pair's messages in the order they were posted;
// - bf16 reductions keep the Communicator's semantics (reduced in f32, rounded once; NCCL alone
//   would round at every step): the bf16 values are widened into f32 device staging by the cast
//   kernel, reduced there and rounded once into recv, on the communicator's stream; the staging
//   grows to the largest such collective and stays (nothing allocates once it is sized), its
//   growth ordered on that stream (cudaFreeAsync, cudaMallocAsync): the host never waits for it;
// - wait_on(ex) makes ex's stream wait for the collective and returns at once: the host does not
//   wait (the emulated build, whose launches complete as they are called, completes it there);
// - a wait past the group's timeout reports the group and the call, aborts every NCCL
//   communicator of the process (ncclCommAbort) and ends it, as MPI's timeout ends the job; the
//   destructor's wait for the communicator's stream is bounded the same way (it polls the stream,
//   never a blocking cudaStreamSynchronize).
// The emulated CUDA build links tests/emu/device/communicator_nccl_emu.cpp in place of the real
// one: the same plans run over MPI on the emulated device memory, with strict buffer rules
// (docs/testing.md, "The emulated NCCL").
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

// A second communicator over the members of `group`, named `name`, whose operations never match
// `group`'s own (MPI: a duplicate of its MPI communicator, sharing its timeout, its progress of
// the rings in flight and its timeout diagnosis; a group of one without MPI: a local
// communicator). Collective over the members. The emulated NCCL's transport (defined with the
// MPI communicator: parallel/communicator_mpi.cpp, communicator_stub_mpi.cpp).
std::unique_ptr<Communicator> duplicate_communicator(Communicator& group, std::string name);

}  // namespace moecore::parallel
