// MOE_CHECK_MPI: every MPI call is checked; a failure names the call, MPI's own message and the
// context given by the caller. Include only from *_mpi.cpp files (needs mpi.h).
#pragma once

#include <mpi.h>

#include <string>

#include "core/check.h"

namespace moecore::parallel {

inline std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(buf, len);
}

}  // namespace moecore::parallel

// MOE_CHECK_MPI(MPI_Iallreduce(...), "[comm] all_reduce on group '{}'", name);
#define MOE_CHECK_MPI(call, ...)                                                           \
  do {                                                                                     \
    const int moe_mpi_rc_ = (call);                                                        \
    if (moe_mpi_rc_ != MPI_SUCCESS) {                                                      \
      ::moecore::fail(#call, __FILE__, __LINE__,                                           \
                      fmt::format(__VA_ARGS__) + ": MPI error " + std::to_string(moe_mpi_rc_) + \
                          " (" + ::moecore::parallel::mpi_error_string(moe_mpi_rc_) + ")"); \
    }                                                                                      \
  } while (0)
