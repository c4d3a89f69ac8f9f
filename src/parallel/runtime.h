// The distributed runtime: one process per device. With MOECORE_MPI the processes come from
// mpirun and talk through Open MPI; without it, a stub that runs one process and refuses to
// start under a multi-process launcher ("unavailable").
#pragma once

#include <string>
#include <string_view>

namespace moecore::parallel {

struct Runtime {
  int rank = 0;
  int world_size = 1;
  // Rank 0 alone prints progress; every rank prints its errors (see format_rank_error).
  bool is_logging_rank() const { return rank == 0; }
};

bool mpi_available();
// Initializes MPI when built with it (idempotent: later calls return the same rank and world
// size); checks the launch matches the build. MPI errors are returned, not fatal, so every MPI
// call can be checked and reported with its context.
Runtime runtime_init(int* argc, char*** argv);
void runtime_finalize();

// "[rank R] error: <what>" when several ranks run (also when the launcher started several
// ranks but the runtime never came up), "error: <what>" otherwise.
std::string format_rank_error(const Runtime& rt, std::string_view what);
// Ends the whole job after an error on this rank. With several ranks, MPI_Abort: the other ranks
// would otherwise wait for this one in their next collective. With one rank, finalizes and
// exits with `code`.
[[noreturn]] void runtime_abort(const Runtime& rt, int code);
// Ends this process with `code` without MPI_Finalize, once its work is saved, when the launcher
// is killing the job: mpirun, between the signals of its kill sequence, serves no MPI_Finalize,
// which would wait for it until its SIGKILL. Flushes stdout and stderr first.
[[noreturn]] void runtime_exit_without_finalize(int code);
// Whether a multi-process launcher (mpirun, a PMI launcher) started this process. Its stdout is
// then the launcher's: Open MPI forwards a rank's output through a pseudo-terminal whatever
// mpirun's own output is (a log file, a pipe), so isatty() says nothing about the user's screen.
bool started_by_launcher();
// Rank 0 alone prints progress: on the other ranks std::cout discards its output (std::cerr,
// where errors go, is untouched).
void quiet_stdout_on_other_ranks(const Runtime& rt);

}  // namespace moecore::parallel
